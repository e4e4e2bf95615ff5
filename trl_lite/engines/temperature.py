"""The run's sampling temperature (``PPOConfig.temperature``) against the kwargs of a ``generate`` call.

The trainer scores every token under ``softmax(logits / T)`` (docs/temperature.md): a rollout drawn at
another temperature would be scored as another policy's, with nothing to show it. :func:`resolve_sampling_kwargs`
is the one rule every generating path applies - the trainer's ``generate``, both engines, ``run_episodes``,
``AsyncRollouts`` and ``BestOfNSampler``.
"""

from __future__ import annotations

import math


def resolve_sampling_kwargs(generation_kwargs: dict, temperature: float, defaults=None) -> dict:
    """``generation_kwargs`` (transformers ``generate`` keyword arguments) that sample at ``temperature``; a new dict.

    ``temperature``: the run's (``PPOConfig.temperature``). At 1.0, the classic behaviour, the kwargs come back
    as given: a ``temperature`` kwarg samples at it and the trainer still scores under the raw logits. Otherwise
    a ``temperature`` kwarg must equal it (else ``ValueError`` naming both), and a sampling call without one
    gets it - sampling as ``do_sample`` says, else as ``defaults`` (the model's ``GenerationConfig``, whose own
    temperature it overrides) says. A greedy call gets none: its tokens do not depend on it, and transformers
    warns about a temperature it does not use.
    """
    kwargs = dict(generation_kwargs)
    if temperature == 1.0:
        return kwargs
    given = kwargs.get("temperature")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise TypeError(f"the generation kwarg temperature must be a number, got {given!r}.")
        if not math.isfinite(given):
            raise ValueError(f"the generation kwarg temperature must be a finite number, got {given!r}.")
        if float(given) != float(temperature):
            raise ValueError(
                f"generate() got temperature={given!r}, but PPOConfig.temperature={temperature!r}: the trainer scores "
                f"the rollouts under logits / {temperature!r}, so they must be sampled at it. Drop the temperature "
                f"kwarg (generate() then samples at {temperature!r}), pass temperature={temperature!r}, or set "
                f"PPOConfig.temperature={given!r}."
            )
        return kwargs
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = getattr(defaults, "do_sample", None)
    if do_sample:
        kwargs["temperature"] = float(temperature)
    return kwargs


def vllm_logprobs_mode(temperature: float) -> str:
    """The ``logprobs_mode`` a colocated vLLM engine starts with for a run at ``temperature``.

    vLLM's ``raw_logprobs`` (its default) are ``log_softmax(z)``, taken before any sampling processor: the
    log-probs at temperature 1, kept for the classic run. ``processed_logprobs`` are taken after them all -
    penalties, the temperature, then min-p, top-k and top-p truncation - and equal ``log_softmax(z / T)`` only
    for a row sampled at ``T`` without any of the others (:func:`check_vllm_logprobs`).
    """
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def check_vllm_logprobs(params: dict, temperature: float, logprobs_mode: str) -> None:
    """Refuse a vLLM request whose returned log-probs would not be ``log_softmax(z / temperature)`` of the sampled
    tokens (the untruncated distribution the trainer scores with; docs/temperature.md).

    ``params``: one prompt's ``vllm.SamplingParams`` arguments (:func:`~.vllm_engine.sampling_params`);
    ``logprobs_mode``: the engine's (``'raw_logprobs'``, ``'processed_logprobs'``, ...).
    """
    if logprobs_mode == "raw_logprobs":
        if temperature != 1.0:
            raise ValueError(
                f"return_logprobs=True with PPOConfig.temperature={temperature!r}: this vLLM engine returns "
                "logprobs_mode='raw_logprobs', the log-probs at temperature 1. Start it with "
                "logprobs_mode='processed_logprobs' (a vLLM server: python -m trl_lite.vllm_server ... -- "
                "--logprobs-mode processed_logprobs)."
            )
        return
    if logprobs_mode != "processed_logprobs":
        raise ValueError(
            f"return_logprobs=True needs a vLLM engine whose logprobs_mode is 'raw_logprobs' (temperature 1.0) or "
            f"'processed_logprobs'; this one returns {logprobs_mode!r}."
        )
    sampled_at = params.get("temperature", 1.0)
    # What vLLM's processed log-probs went through besides logits / temperature, each one named.
    extra = [f"{name}={params[name]!r}" for name, off in (("top_k", (0, -1)), ("top_p", (1.0,)), ("min_p", (0.0,)),
             ("repetition_penalty", (1.0,))) if params.get(name) is not None and params[name] not in off]  # fmt: skip
    if sampled_at == 0.0 and temperature != 1.0:
        extra.insert(0, "greedy decoding (vLLM takes a greedy row's log-probs at temperature 1)")
    elif sampled_at not in (0.0, temperature):
        extra.insert(0, f"sampling temperature {sampled_at!r}")
    if extra:
        raise ValueError(
            "return_logprobs=True on vLLM (logprobs_mode='processed_logprobs') gives the log-probs after every "
            f"sampling processor, and this request has {', '.join(extra)}: they would not be "
            f"log_softmax(logits / {temperature!r}) of the sampled tokens, the distribution the trainer scores with. Sample with do_sample=True, top_k=0, "
            "top_p=1.0 and no min_p or repetition_penalty, or generate with use_vllm=False (whose log-probs are "
            "always the untruncated ones)."
        )
