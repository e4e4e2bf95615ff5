"""The run's sampling distribution (``PPOConfig``) against the kwargs of a ``generate`` call and the model's own
``generation_config``.

The trainer scores every token under ``softmax(logits / T)`` (docs/temperature.md): a rollout drawn from another
distribution - another temperature, or a top-k/top-p/min-p cut, or a repetition penalty the run never asked for
(a model's ``generation_config`` ships them: Qwen2.5-Instruct samples at 0.7 with top-k 20 and top-p 0.8) -
would be scored as another policy's, with nothing to show it. :func:`resolve_sampling_kwargs` is the one rule
every generating path applies - the trainer's ``generate``, both engines, ``run_episodes``, ``AsyncRollouts`` and
``BestOfNSampler``: a call's kwarg that disagrees with ``PPOConfig`` is refused (the caller wrote it), and a
model default that does is overridden with one warning naming both (the caller did not). The one exception is
classic ``PPOTrainer.generate(**kwargs)``, which samples as its kwargs say, as classic TRL did, and warns once per
run (docs/algorithm_rollouts.md section 23, docs/truncated_sampling.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """The distribution a run samples from (``PPOConfig.temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``); the defaults are the untruncated ``softmax(z)``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, config) -> Sampling:
        """The sampling settings of a ``PPOConfig``."""
        return cls(config.temperature, config.top_k, config.top_p, config.min_p, config.repetition_penalty)


# transformers' generate() arguments that reshape the next-token distribution, each at the value that leaves it
# unchanged, and whether it acts on greedy decoding too (the warpers act on sampling only). Length and token
# constraints (min_new_tokens, suppress_tokens, bad_words_ids, forced_*_token_id, ...) are not sampling settings:
# they pass as given.
_SHAPING = {
    "temperature": (1.0, False), "top_k": (0, False), "top_p": (1.0, False), "min_p": (0.0, False),
    "typical_p": (1.0, False), "epsilon_cutoff": (0.0, False), "eta_cutoff": (0.0, False), "top_h": (None, False),
    "repetition_penalty": (1.0, True), "encoder_repetition_penalty": (1.0, True), "no_repeat_ngram_size": (0, True),
    "encoder_no_repeat_ngram_size": (0, True), "guidance_scale": (1.0, True),
}  # fmt: skip
# Set explicitly on every sampling call, whatever the model says: transformers' own default top_k is 50.
_ALWAYS_SET = ("temperature", "top_k", "top_p")


def _normal(name: str, value):
    """``value`` of the generate() argument ``name`` in one spelling per distribution (None: off)."""
    neutral = _SHAPING[name][0]
    if value is None or value == neutral:
        return neutral
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value  # a list (top_h's None aside, none of these takes one): compared as given
    if name == "top_k":
        return int(value) if float(value).is_integer() else float(value)
    if name in ("top_p", "typical_p") and value >= 1.0:
        return 1.0
    if name in ("epsilon_cutoff", "eta_cutoff") and not 0.0 < value < 1.0:
        return 0.0
    return float(value)


def is_neutral(name: str, value) -> bool:
    """Whether the generate() argument ``name`` at ``value`` leaves the distribution as it is (False for names
    that do not shape it)."""
    return name in _SHAPING and _normal(name, value) == _SHAPING[name][0]


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the generation kwarg {name} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"the generation kwarg {name} must be a finite number, got {value!r}.")


def _wanted(sampling: Sampling, name: str):
    """The run's value of the generate() argument ``name``: ``PPOConfig``'s, or off where it has no field."""
    return getattr(sampling, name) if name in Sampling.__dataclass_fields__ else _SHAPING[name][0]


def _run_value(sampling: Sampling, name: str) -> str:
    if name in Sampling.__dataclass_fields__:
        return f"PPOConfig.{name}={getattr(sampling, name)!r}"
    return f"PPOConfig, which has no {name} setting (it samples without one, {name}={_SHAPING[name][0]!r})"


class SamplingKwargs(dict):
    """generate() keyword arguments :func:`resolve_sampling_kwargs` has checked: passed to it again (an engine with
    the model's defaults), the call's own settings are not checked twice. ``differing``: the classic kwargs kept
    although they differ from the run's (``classic=True``), as ``(name, given)`` pairs."""

    differing: tuple = ()


def resolve_sampling_kwargs(generation_kwargs: dict, sampling: Sampling, defaults=None, classic: bool = False) -> dict:
    """``generation_kwargs`` (transformers ``generate`` keyword arguments) that draw from ``sampling``; a new
    :class:`SamplingKwargs`.

    ``sampling``: the run's (:meth:`Sampling.of` a ``PPOConfig``); ``defaults``: the model's ``GenerationConfig``
    (None: transformers' own defaults). At every temperature, 1.0 included:

    - a kwarg that shapes the distribution (temperature, top_k, top_p, min_p, typical_p, the repetition
      penalties, ...; None is absent) must equal the run's value, in any spelling (``top_k=0.0`` is
      ``top_k=0``), else ``ValueError`` naming both - or, with ``classic`` (classic ``PPOTrainer.generate``,
      docs/algorithm_rollouts.md section 23), it is kept as given and named in the result's ``differing`` (the caller warns);
    - a sampling call (``do_sample``, else the model's ``do_sample``) gets the run's temperature, top_k and top_p
      written out, and any other setting the run asks for;
    - a model default that would shape the distribution otherwise (the settings greedy decoding uses too -
      repetition penalties, n-gram bans - on a greedy call) is overridden by the run's value, with one warning
      (per message and process, as ``warnings`` does) naming both.

    A greedy call gets no sampling settings: its tokens do not depend on them, and transformers warns about
    settings it does not use. Kwargs this function returned are not checked again (their ``differing`` kept).
    """
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a trl_lite.engines.Sampling (Sampling.of(config)), got {sampling!r}.")
    kwargs = SamplingKwargs(generation_kwargs)
    checked = isinstance(generation_kwargs, SamplingKwargs)
    kwargs.differing = generation_kwargs.differing if checked else ()
    for name, given in () if checked else generation_kwargs.items():
        if name not in _SHAPING or given is None:
            continue
        _check_number(name, given)
        if _normal(name, given) == _normal(name, _wanted(sampling, name)):
            continue
        if classic:
            kwargs.differing += ((name, given),)
            continue
        hint = (f"Drop the {name} kwarg (generate() then uses the run's), or set PPOConfig.{name}={given!r}"
                if name in Sampling.__dataclass_fields__ else f"Drop the {name} kwarg")  # fmt: skip
        raise ValueError(
            f"generate() got {name}={given!r}, but {_run_value(sampling, name)}: PPOConfig is the one source of "
            f"the sampling distribution, and the trainer scores the rollouts under logits / "
            f"{sampling.temperature!r}, truncated only where PPOConfig truncates. {hint}. (For greedy decoding "
            "pass do_sample=False; classic PPOTrainer.generate(**kwargs) on transformers, without use_vllm, samples as its "
            "kwargs say.)"
        )
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = getattr(defaults, "do_sample", None)
    overridden = []
    for name, (_, greedy_too) in _SHAPING.items():
        if not (do_sample or greedy_too) or kwargs.get(name) is not None:
            continue
        wanted, model = _wanted(sampling, name), getattr(defaults, name, None)
        if model is not None and _normal(name, model) != _normal(name, wanted):
            overridden.append((name, model, wanted))
        elif not ((do_sample and name in _ALWAYS_SET) or _normal(name, wanted) != _SHAPING[name][0]):
            continue
        kwargs[name] = wanted
    if overridden:
        warnings.warn(
            f"the model's generation_config has {', '.join(f'{n}={m!r}' for n, m, _ in overridden)}, but PPOConfig "
            f"samples with {', '.join(f'{n}={w!r}' for n, _, w in overridden)}: PPOConfig is the one source of the "
            "sampling distribution (the trainer scores the rollouts under it), so generate() uses PPOConfig's values. "
            "To sample as the model's generation_config says, set them in PPOConfig (temperature, top_k, top_p, "
            "min_p, repetition_penalty) - the trainer then scores under that temperature too.",
            stacklevel=1,  # one place: the default filter shows each message once per process, whoever calls
        )
    return kwargs


def vllm_logprobs_mode(temperature: float, truncates: bool = False) -> str:
    """The ``logprobs_mode`` a colocated vLLM engine starts with for a run at ``temperature`` (``truncates``: the
    run's ``PPOConfig`` sets top-k, top-p or min-p).

    vLLM's ``raw_logprobs`` (its default) are ``log_softmax(z)``, taken before any sampling processor: the
    log-probs at temperature 1, kept for the classic run. ``processed_logprobs`` are taken after them all -
    penalties, the temperature, then min-p, top-k and top-p truncation: ``log_softmax(z / T)`` for a row sampled
    at ``T`` without a cut, and ``log pi_T^K`` (renormalised over the set vLLM kept, docs/algorithm_rollouts.md section 23) for a
    row sampled with the run's cut (:func:`check_vllm_logprobs`).
    """
    return "raw_logprobs" if temperature == 1.0 and not truncates else "processed_logprobs"


def check_vllm_logprobs(params: dict, temperature: float, logprobs_mode: str, sampling: Sampling | None = None) -> None:
    """Refuse a vLLM request whose returned log-probs would not be those the trainer scores the sampled tokens
    with: ``log_softmax(z / temperature)``, or under a run whose ``sampling`` truncates, ``log pi_T^K`` over the
    set vLLM's sampler kept (docs/truncated_sampling.md).

    ``params``: one prompt's ``vllm.SamplingParams`` arguments (:func:`~.vllm_engine.sampling_params`);
    ``logprobs_mode``: the engine's (``'raw_logprobs'``, ``'processed_logprobs'``, ...); ``sampling``: the run's
    (None: untruncated).
    """
    cut = {} if sampling is None else {
        name: value for name, value in (("top_k", sampling.top_k), ("top_p", sampling.top_p), ("min_p", sampling.min_p))
        if value not in (0, 1.0)
    }  # fmt: skip
    if logprobs_mode == "raw_logprobs":
        if cut:
            raise ValueError(
                f"return_logprobs=True with PPOConfig's {', '.join(f'{n}={v!r}' for n, v in cut.items())}: this vLLM "
                "engine returns logprobs_mode='raw_logprobs', untruncated, not the truncated distribution that "
                "sampled. Start it with logprobs_mode='processed_logprobs' (a vLLM server: python -m "
                "trl_lite.vllm_server ... -- --logprobs-mode processed_logprobs)."
            )
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
    # The run's own cut is what sampled (vLLM's processed log-probs are then log pi_T^K); anything else is in the way.
    extra = [f"{name}={params[name]!r}" for name, off in (("top_k", (0, -1)), ("top_p", (1.0,)), ("min_p", (0.0,)),
             ("repetition_penalty", (1.0,))) if params.get(name) is not None and params[name] not in off
             and params[name] != cut.get(name)]  # fmt: skip
    if sampled_at == 0.0 and temperature != 1.0:
        extra.insert(0, "greedy decoding (vLLM takes a greedy row's log-probs at temperature 1)")
    elif sampled_at not in (0.0, temperature):
        extra.insert(0, f"sampling temperature {sampled_at!r}")
    if extra:
        raise ValueError(
            "return_logprobs=True on vLLM (logprobs_mode='processed_logprobs') gives the log-probs after every "
            f"sampling processor, and this request has {', '.join(extra)}: they would not be "
            f"log_softmax(logits / {temperature!r}) of the sampled tokens, the distribution the trainer scores "
            "with. Sample (do_sample=True) with PPOConfig's own top_k, top_p and min_p and repetition_penalty=1.0 "
            "(the default), or generate with use_vllm=False."
        )
