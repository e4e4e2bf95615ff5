"""``PPOTrainer.generate``: the classic entry point, on the generation engine the config picks.

:func:`build_generation` is the one place that reads ``use_vllm``/``vllm_mode``: the policy's
responses come from a :class:`~.engines.TransformersEngine` (transformers ``generate`` on the trained
model) or a :class:`~.engines.VLLMEngine` (colocated or server), and reference responses always
from a transformers engine on the reference. An engine with its own copy of the weights is pushed
the policy's weights lazily: before the first ``generate`` after the policy changed, once - for a
LoRA policy the engine serves as an adapter (``vllm_lora_sync``, :mod:`.lora_sync`), the base weights
with the first push and the adapter alone after that.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from ..core.kept_sets import KeptSets, RecordedSets
from ..parallel.fsdp import is_sharded, unsharded
from .base import GenerationEngine
from .lora_sync import AdapterSpec, AdapterSync, AdapterUpdate, ByteTally, adapter_spec, resolve_lora_sync
from .temperature import Sampling, resolve_sampling_kwargs
from .transformers_engine import TransformersEngine, eval_mode
from .vllm_engine import VLLMEngine, build_vllm_backend, check_vllm_can_load, require_vllm
from .vllm_options import engine_placement
from .weight_sync import WeightVersion, named_policy_weights

__all__ = ["RolloutGeneration", "build_generation", "eval_mode"]


class RolloutGeneration:
    """The trainer's generation part: the policy's engine, the reference's, and the weight pushes.

    Args:
        engine: generates the policy's responses.
        reference_engine: generates the reference's responses (``generate_ref_response=True``).
        timer: the trainer's :class:`~trl_lite.trainer.step.timing.PhaseTimer` (``rollout/generate``, ``rollout/weight_sync``).
        policy_weights: called for each push; yields the policy's ``(name, tensor)`` pairs, or gives an
            :class:`~.lora_sync.AdapterUpdate` (an adapter push).
        version: counts policy updates; None for an engine that needs no pushes.
        push: takes ``policy_weights()`` to the engine; default ``engine.load_weights`` (see
            :func:`build_generation` for adapter pushes and a server shared by several processes).
        full_weights: a context-manager factory around each push (FSDP2: the policy's shards gathered whole
            for it, :func:`~trl_lite.parallel.fsdp.unsharded`); default none.

    ``last_push_bytes``: the bytes of the tensors the last push read (0 before any). ``records``: the kept sets the
    engine's sampler recorded for the rows of the ``generate`` calls since the last ``step()`` took them
    (:class:`~trl_lite.core.kept_sets.RecordedSets`, docs/truncated_sampling.md).
    """

    def __init__(self, engine: GenerationEngine, reference_engine: GenerationEngine, timer,
                 policy_weights: Callable | None = None, version: WeightVersion | None = None,
                 push: Callable | None = None, full_weights: Callable = nullcontext):  # fmt: skip
        self.engine = engine
        self.full_weights = full_weights
        self.reference_engine = reference_engine
        self.timer = timer
        self.policy_weights = policy_weights
        self.push = engine.load_weights if push is None else push
        self.version = version
        self._held_version = None
        self.last_push_bytes = 0
        self.records = RecordedSets()
        self._pending = None  # under sequence parallelism, the rows a share's generate recorded (_group_generate)
        self._awake_depth = 0  # nesting of awake()
        self._warned_kwargs: set[str] = set()  # classic kwargs that differ from PPOConfig, warned once per run
        # The trainer's sequence-parallel part, whose group's processes return the same generations (see build_generation).
        self.sequence = None
        if engine.sleeps:
            # It holds nothing worth keeping yet: the first generate wakes it and pushes the weights.
            engine.sleep()
        elif engine.needs_weight_sync:
            # The engine starts without the policy's weights; this first push is not a rollout phase.
            self._push()

    def sync_weights(self) -> None:
        """Push the policy's weights to the engine if it holds older ones (a collective under ZeRO-3).

        A sleeping engine takes none: :meth:`generate` pushes them each time it wakes the engine.
        """
        if not self.engine.needs_weight_sync or self.engine.sleeps or self._held_version == self.version.version:
            return
        with self.timer("rollout/weight_sync"):
            self._push()

    @contextmanager
    def awake(self):
        """Around a rollout: the lazy push; for an engine that sleeps, wake its weights, push them (its
        sleep dropped them), wake its KV cache, and put it back to sleep after, so that the engine's
        memory is free while ``step()`` runs. Waking the cache after the push keeps it out of the
        push's peak (a ZeRO-3 gather). Re-entrant: a multi-turn rollout holds the engine awake across
        its turns (``trl_lite.agents.run_episodes``), and the ``generate`` calls inside wake nothing."""
        if self._awake_depth:
            self._awake_depth += 1
            try:
                yield
            finally:
                self._awake_depth -= 1
            return
        self._awake_depth = 1
        try:
            with self._wake():
                yield
        finally:
            self._awake_depth = 0

    @contextmanager
    def _wake(self):
        if not self.engine.sleeps:
            self.sync_weights()
            yield
            return
        with self.timer("rollout/weight_sync"):
            self.engine.wake_up(("weights",))
            self._push()
        try:
            with self.timer("rollout/generate"):
                self.engine.wake_up(("kv_cache",))
            yield
        finally:
            self._held_version = None
            with self.timer("rollout/generate"):
                self.engine.sleep()

    @torch.no_grad()  # merged LoRA weights are computed for the push, not for a backward pass
    def _push(self) -> None:
        tally = ByteTally()
        with self.full_weights():
            weights = self.policy_weights()
            self.push(weights.counted(tally) if isinstance(weights, AdapterUpdate) else tally.wrap(weights))
        self.last_push_bytes = tally.bytes
        self._held_version = self.version.version

    def weights_changed(self) -> None:
        """Mark the policy's weights changed outside an optimizer step (a loaded checkpoint)."""
        if self.version is not None:
            self.version.bump()

    @torch.no_grad()
    def generate(self, query_tensor, length_sampler=None, batch_size: int = 4, return_prompt: bool = True,
                 generate_ref_response: bool = False, remove_padding: bool = True, return_logprobs: bool = False,
                 classic: bool = False, **generation_kwargs):  # fmt: skip
        """See :meth:`PPOTrainer.generate`. ``classic``: on a transformers engine, a sampling kwarg that differs from
        ``PPOConfig`` samples as given, with one warning per run and kwarg (classic ``PPOTrainer.generate``, docs/algorithm_rollouts.md
        section 23); else (vLLM, and the engines' own entry points) it is refused: ``PPOConfig`` is the one source."""

        def generate(queries):
            return self._generate(queries, length_sampler, batch_size, return_prompt, generate_ref_response,
                                  remove_padding, return_logprobs, classic, **generation_kwargs)  # fmt: skip

        if self.sequence is None or not self.sequence.cuts:
            if self.sequence is None:
                return generate(query_tensor)
            return self.sequence.generate(generate, query_tensor, check=_check_queries)
        return self._group_generate(generate, query_tensor)

    def _group_generate(self, generate, queries):
        """``generate(queries)`` over a sequence-parallel group (:meth:`~trl_lite.parallel.SequenceParallel.generate`:
        each process samples a share, all return the group's rows) with the kept sets each process recorded gathered
        alongside, row by row, so every process of the group holds the same :attr:`records` and replays them alike."""
        shape = []

        def recording(share):
            self._pending = []  # _record keeps this call's rows here: (query, response, (offsets, ids) or None)
            try:
                out = generate(share)
            finally:
                pending, self._pending = self._pending, None
            shape.append(isinstance(out, tuple))
            return (*out, pending) if isinstance(out, tuple) else (out, pending)

        *out, pending = self.sequence.generate(recording, queries, check=_check_queries)
        if pending:
            rows = [(query, response, None if kept is None else KeptSets(kept[0], kept[1], kept[0].numel() - 1))
                    for query, response, kept in pending]  # fmt: skip
            self.records.record(*(list(column) for column in zip(*rows)))
        return tuple(out) if shape[0] else out[0]

    def _generate(self, query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
                  return_logprobs, classic, **generation_kwargs):  # fmt: skip
        if not isinstance(return_logprobs, bool):
            raise TypeError(f"return_logprobs must be a bool, got {return_logprobs!r}.")
        if isinstance(query_tensor, (list, tuple)):
            _check_queries(query_tensor)
        elif not isinstance(query_tensor, torch.Tensor) or query_tensor.dim() != 1:
            raise ValueError(
                "query_tensor must be a 1-D tensor of token ids or a list of them, got "
                f"{type(query_tensor).__name__}{tuple(query_tensor.shape) if isinstance(query_tensor, torch.Tensor) else ''}."
            )
        elif return_logprobs:
            raise ValueError("return_logprobs=True needs a list of queries; pass [query_tensor].")
        # A sampling kwarg other than the run's is refused (classic: kept, and named once) before any weight push
        # or wake-up. Resolved once here: the engines add the model's defaults only.
        # vLLM (use_vllm) keeps PPOConfig as the one source: only transformers' generate samples as classic did.
        classic = classic and isinstance(self.engine, TransformersEngine)
        generation_kwargs = resolve_sampling_kwargs(generation_kwargs, self.engine.sampling, classic=classic)
        self._warn_differing(generation_kwargs.differing)
        with self.awake(), self.timer("rollout/generate"):
            if not isinstance(query_tensor, (list, tuple)):
                if length_sampler is not None:
                    generation_kwargs["max_new_tokens"] = length_sampler()
                response = self.engine.generate_one(query_tensor, generation_kwargs, return_prompt)
                self._record([query_tensor], list(response), return_prompt, generation_kwargs)
                if not generate_ref_response:
                    return response
                reference = self.reference_engine.generate_one(query_tensor, generation_kwargs, return_prompt)
                self.reference_engine.take_kept_sets()  # the reference's samples are not the policy's to train on
                return response, reference
            args = (length_sampler, batch_size, return_prompt, remove_padding)
            responses, logprobs = self.engine.generate(list(query_tensor), generation_kwargs, *args, return_logprobs)
            self._record(list(query_tensor), responses, return_prompt, generation_kwargs)
            out = [responses]
            if generate_ref_response:
                out.append(self.reference_engine.generate(list(query_tensor), generation_kwargs, *args, False)[0])
                self.reference_engine.take_kept_sets()  # the reference's samples are not the policy's to train on
            if return_logprobs:
                out.append(logprobs)
            return out[0] if len(out) == 1 else tuple(out)

    def _record(self, queries, responses, return_prompt, generation_kwargs) -> None:
        """Keep the kept sets the engine's sampler used for ``responses`` in :attr:`records`, by their tokens."""
        kept = self.engine.take_kept_sets()
        if kept is None:
            return
        per_query = int(generation_kwargs.get("num_return_sequences") or 1)
        queries = [query for query in queries for _ in range(per_query)]
        if return_prompt and not getattr(self.engine, "is_encoder_decoder", False):
            responses = [response[len(query) :] for query, response in zip(queries, responses)]
        if self._pending is None:
            self.records.record(queries, responses, kept)
        else:  # a sequence-parallel share: gathered over the group with the responses (_group_generate)
            self._pending += [(query.cpu(), response.cpu(), None if sets is None else (sets.offsets.cpu(), sets.ids.cpu()))
                              for query, response, sets in zip(queries, responses, kept)]  # fmt: skip

    def _warn_differing(self, differing) -> None:
        """One warning per run for the classic kwargs, each named once, that sample other than ``PPOConfig``."""
        new = [(name, given) for name, given in differing if name not in self._warned_kwargs]
        if not new:
            return
        self._warned_kwargs.update(name for name, _ in new)
        sampling = self.engine.sampling
        config = ", ".join(
            f"PPOConfig.{name}={getattr(sampling, name)!r}" if name in Sampling.__dataclass_fields__
            else f"PPOConfig has no {name} setting"
            for name, _ in new
        )  # fmt: skip
        given = ", ".join(f"{name}={value!r}" for name, value in new)
        fields = [name for name, _ in new if name in Sampling.__dataclass_fields__]
        fix = (f"Set {', '.join(f'PPOConfig.{name}={value!r}' for name, value in new if name in fields)} to score "
               "what was sampled" if fields else "PPOConfig cannot express it; drop the kwarg to score what is sampled")
        warnings.warn(
            f"generate() got {given}, but {config}: it samples with the kwargs, as classic TRL did, while the trainer "
            f"scores the rollouts (log-probs, ratio, KL) under PPOConfig's distribution (temperature="
            f"{sampling.temperature!r}, top_k={sampling.top_k!r}, top_p={sampling.top_p!r}, min_p={sampling.min_p!r}). "
            f"{fix} (docs/truncated_sampling.md). Warned once per run.",
            stacklevel=6,  # the caller of PPOTrainer.generate
        )

    def close(self) -> None:
        self.engine.close()


def _check_queries(queries) -> None:
    for i, query in enumerate(queries):
        if not isinstance(query, torch.Tensor) or query.dim() != 1 or query.dtype.is_floating_point:
            raise ValueError(
                f"query_tensor[{i}] must be a 1-D tensor of token ids, got {type(query).__name__}"
                f"{tuple(query.shape) if isinstance(query, torch.Tensor) else ''}."
            )


def build_generation(config, *, model, unwrapped, accelerator, tokenizer, pad_token_id: int, is_encoder_decoder: bool,
                     is_zero3: bool, reference_context, optimizer, timer, sequence=None) -> RolloutGeneration:  # fmt: skip
    """The generation part ``config`` asks for (``use_vllm``, ``vllm_mode``); refuses what the engine cannot run.

    ``model``: the prepared policy; ``unwrapped``: its value-head wrapper; ``reference_context``: a
    context manager factory yielding the reference module; ``sequence``: the run's
    sequence-parallel part (:class:`~trl_lite.parallel.SequenceParallel`: its group's processes each generate a
    share of a list of queries and all return the group's responses, :meth:`~trl_lite.parallel.SequenceParallel.generate`;
    a :class:`~trl_lite.parallel.NoSequenceParallel` generates as it is asked), or None (the same).
    """
    generation = _build_generation(config, model, unwrapped, accelerator, tokenizer, pad_token_id, is_encoder_decoder,
                                   is_zero3, reference_context, optimizer, timer)  # fmt: skip
    generation.sequence = sequence
    return generation


def _build_generation(config, model, unwrapped, accelerator, tokenizer, pad_token_id, is_encoder_decoder, is_zero3,
                      reference_context, optimizer, timer) -> RolloutGeneration:  # fmt: skip
    """:func:`build_generation` without sequence parallelism."""

    @contextmanager
    def policy_context():
        yield model

    def transformers_engine(context):
        return TransformersEngine(context, accelerator, tokenizer, pad_token_id, is_encoder_decoder, is_zero3,
                                  sampling=Sampling.of(config), halve_on_oom=config.oom_backoff)  # fmt: skip

    reference = transformers_engine(reference_context)
    full_weights = (lambda: unsharded(model)) if is_sharded(model) else nullcontext  # FSDP2: a push sends whole tensors
    if not config.use_vllm:
        return RolloutGeneration(transformers_engine(policy_context), reference, timer, full_weights=full_weights)
    require_vllm()
    lm = unwrapped.pretrained_model
    transformers_model = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    model_config = copy.deepcopy(transformers_model.config)
    if not model_config.architectures:
        model_config.architectures = [type(transformers_model).__name__]
    check_vllm_can_load(model_config, is_encoder_decoder)
    spec, reason = adapter_spec(lm, model_config.architectures) if config.vllm_lora_sync is not False else (None, None)
    lora = None
    if config.vllm_mode == "colocate":
        lora = resolve_lora_sync(config.vllm_lora_sync, spec, reason)
    placement = None
    if config.vllm_mode == "colocate":
        # Every process's engine on the process's own device; engines differ in seed, or they would sample alike.
        device = accelerator.device
        on_cuda = device.type == "cuda" and device.index is not None
        local_rank = device.index if on_cuda else accelerator.local_process_index
        placement = engine_placement(
            accelerator.process_index, local_rank, accelerator.num_processes, config.vllm_tensor_parallel_size
        )
    backend = build_vllm_backend(
        config, model_config, getattr(transformers_model, "generation_config", None),
        policy_dtype=next(transformers_model.parameters()).dtype, mixed_precision=accelerator.mixed_precision,
        placement=placement, max_lora_rank=None if lora is None else lora.engine_rank,
    )  # fmt: skip
    if config.vllm_mode == "server":
        if spec is not None:
            reason = _server_lora_blocker(backend, spec)
            spec = None if reason else spec
        lora = resolve_lora_sync(config.vllm_lora_sync, spec, reason)
    eos = tokenizer.eos_token_id if tokenizer is not None else getattr(model_config, "eos_token_id", None)
    engine = VLLMEngine(backend, eos, pad_token_id, getattr(transformers_model, "generation_config", None),
                        sampling=Sampling.of(config))  # fmt: skip
    if lora is not None:
        adapter_sync = AdapterSync(lm, lora, engine, is_zero3)
        policy_weights, push = adapter_sync.updates, adapter_sync.push
    else:
        policy_weights, push = (lambda: named_policy_weights(lm, is_zero3)), engine.load_weights
    if config.vllm_mode == "server" and accelerator.num_processes > 1:
        send = push

        def push(weights):
            """One server for all processes: the main process sends, the others only join the ZeRO-3
            gathers; nobody generates before the new weights are in."""
            if accelerator.is_main_process:
                send(weights)
            else:
                for _ in weights:
                    pass
            accelerator.wait_for_everyone()

    return RolloutGeneration(engine, reference, timer, policy_weights, WeightVersion(optimizer), push=push,
                             full_weights=full_weights)  # fmt: skip


def _server_lora_blocker(client, spec: AdapterSpec) -> str | None:
    """Why the server cannot take ``spec``'s adapter, or None."""
    if client.shared_dir is None:
        return f"the server at {client.base_url} cannot read this machine's files, and adapters travel as files"
    served = client.max_lora_rank()
    if served is None:
        return (
            f"the server at {client.base_url} was launched without LoRA "
            f"(python -m trl_lite.vllm_server ... --max-lora-rank {spec.engine_rank})"
        )
    if spec.rank > served:
        return f"the adapter's rank {spec.rank} is over the server's --max-lora-rank {served}"
    return None
