"""Sequence parallelism (Ulysses) for packed passes: the processes of one group share a batch, each
holds a slice of every pass's token stream (docs/sequence_parallel.md, docs/algorithm.md section 21).

A packed pass is one stream ``(1, N_total)`` of whole rows (:meth:`~trl_lite.trainer.layout.rows.InputLayout.packed`).
With ``sp`` processes in a group, the stream is padded to a multiple of ``sp`` with one row of padding
and cut into ``sp`` equal slices; process ``k`` of the group runs the model on slice ``k``. Embeddings,
MLPs and the LM head see only the local tokens. Around attention, DeepSpeed's Ulysses all-to-all
(``UlyssesSPAttentionHF``) turns ``(1, H, N/sp, D)`` into ``(1, H/sp, N, D)``: whole rows on a share of
the heads, on which trl_lite's packed per-row attention runs unchanged, and back after. Labels are read
from the whole stream before the cut, so a slice's last token predicts the next slice's first.

The per-slot results of the LM head (log-probs, entropy) and the per-token values are gathered over
the group (:meth:`SequencePass.gather_slots`, :meth:`SequencePass.gather_tokens`): every process of the
group then holds the whole rows' numbers and computes the same losses and statistics. The gathers'
backward hands each process the gradient of its own slice only, so the processes' gradients add up to
the whole rows' gradient; DeepSpeed's sequence-parallel reduction sums over all processes and divides by
the number of groups (``world / sp``), which is the mean over the groups' batches: data parallelism.

Configured as accelerate configures it: ``ParallelismConfig(sp_size=..., sp_backend="deepspeed")`` (an
``Accelerator`` argument, or ``parallelism_config`` in the accelerate config file) under DeepSpeed, whose
``prepare`` builds the groups (``deepspeed.runtime.sequence_parallel.parallel_state_sp``).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..core.kept_sets import padded_ids
from ..models.packed_attention import ROW_LENGTHS, packed_sdpa_attention_forward, packed_sdpa_mask
from ..models.varlen_attention import packed_rows
from .no_sequence_parallel import NoSequenceParallel

ULYSSES_SDPA = "trl_lite_ulysses_sdpa"
SEQUENCE_PASS = "sequence_parallel_pass"


def sequence_parallel_size(accelerator) -> int:
    """Processes per sequence-parallel group of ``accelerator`` (its ``parallelism_config.sp_size``; 1 without)."""
    config = getattr(accelerator, "parallelism_config", None)
    return int(getattr(config, "sp_size", None) or 1)


def data_parallel_size(accelerator) -> int:
    """Groups that train on batches of their own: processes / sequence-parallel size."""
    return accelerator.num_processes // sequence_parallel_size(accelerator)


class _GatherPieces(torch.autograd.Function):
    """Concatenate every group member's ``(n_k, ...)`` piece in group order (``torch.distributed.all_gather``).

    Backward: this member's piece of the incoming gradient. Every member computes the same loss from
    the gathered tensor, so the gradient of each piece is the same on every member and belongs to the
    member that computed the piece; their parameter gradients add up to the whole rows' gradient.
    """

    @staticmethod
    def forward(ctx, piece, group, counts, rank):
        width = max(counts)
        padded = piece.new_zeros((width, *piece.shape[1:]))
        padded[: piece.shape[0]] = piece
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.count], None, None, None


@dataclass(frozen=True, eq=False)
class SequencePass:
    """This process's slice of one packed pass and what its attention layers need.

    ``parallel``: the :class:`SequenceParallel` group; ``start``/``stop``: the slice of the padded stream
    ``(1, sp * chunk)``; ``total``: the stream's tokens before padding; ``slot_counts``: the LM-head slots
    (:func:`~trl_lite.trainer.layout.rows.token_slots`) of each member's slice, host ints; ``rows``: the padded
    stream's :class:`~trl_lite.models.varlen_attention.PackedRows` (the padding is a row of its own);
    ``position_ids``: ``(1, chunk)`` this slice's position ids (each row's own).
    """

    parallel: SequenceParallel
    start: int
    stop: int
    total: int
    slot_counts: tuple
    rows: object
    position_ids: torch.Tensor

    @property
    def slots(self) -> slice:
        """This slice's slots within the pass's ``N`` slots (slots run in stream order)."""
        first = sum(self.slot_counts[: self.parallel.rank])
        return slice(first, first + self.slot_counts[self.parallel.rank])

    def gather_slots(self, *per_slot: torch.Tensor) -> tuple:
        """Each ``(n_local, ...)`` per-slot tensor of this slice gathered to the pass's ``(N, ...)``; differentiable."""
        parallel = self.parallel
        return tuple(
            _GatherPieces.apply(t, parallel.group, self.slot_counts, parallel.rank) if t is not None else None
            for t in per_slot
        )  # fmt: skip

    def gather_sets(self, ids: torch.Tensor, counts: torch.Tensor) -> tuple:
        """A truncated pass's kept sets of this slice's slots, ids ``(n_local, K_local)`` and counts ``(n_local,)``,
        gathered to the pass's ``(N, K)`` and ``(N,)``: ``K`` the group's widest (one small all-reduce), each set
        padded with its first id (docs/truncated_sampling.md)."""
        width = torch.tensor([ids.shape[1]], device=ids.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.parallel.group)
        return self.gather_slots(padded_ids(ids, int(width)), counts)

    @property
    def attention_keywords(self) -> dict:
        """The keywords the slice's attention layers take (see :func:`ulysses_attention_forward`)."""
        return {SEQUENCE_PASS: self}

    def gather_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """A model's per-token output ``(1, chunk)`` of this slice gathered to ``(1, N_total)``; differentiable."""
        parallel = self.parallel
        chunk = self.stop - self.start
        whole = _GatherPieces.apply(per_token[0], parallel.group, (chunk,) * parallel.size, parallel.rank)
        return whole[: self.total].unsqueeze(0)


class SequenceParallel:
    """A sequence-parallel group: cuts packed passes into slices and runs Ulysses attention around them.

    The one part the trainer's other parts ask about sequence parallelism (without it they get a
    :class:`~.no_sequence_parallel.NoSequenceParallel`, whose every method is a no-op): the forward part cuts
    its packed passes (:meth:`cut`, :attr:`attention`), the learner shares its epoch order (:meth:`share`), the
    experience maker checks the group's rows (:meth:`check_same_rows`) and weighs its sums (:attr:`row_share`),
    the statistics keep one copy of the group's rows (:meth:`one_per_group`), generation hands out queries
    (:meth:`generate`).

    Args:
        group: the ``torch.distributed`` group of this process's sequence-parallel members.
    """

    cuts = True  # packed passes are cut into slices over the group, whose forwards exchange attention inputs
    attention = ULYSSES_SDPA  # the attention implementation of the packed passes (see :func:`ulysses_attention_forward`)

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._engines = {}

    @classmethod
    def from_accelerator(cls, accelerator) -> SequenceParallel | NoSequenceParallel:
        """The group of a prepared run whose ``parallelism_config`` has ``sp_size > 1``, else a
        :class:`~.no_sequence_parallel.NoSequenceParallel`.

        accelerate's DeepSpeed ``prepare`` built the groups and put DeepSpeed's Ulysses wrapper over
        transformers' ``"sdpa"`` for every model; trl_lite puts it around its packed attention
        (:data:`ULYSSES_SDPA`) instead, for the packed passes it cuts, and gives ``"sdpa"`` back its own
        function: passes every process runs whole (generation, padded layouts) must not be exchanged.
        """
        size = sequence_parallel_size(accelerator)
        if size == 1:
            return NoSequenceParallel()
        if getattr(accelerator.state, "deepspeed_plugin", None) is None:
            raise ValueError(
                f"parallelism_config.sp_size={size} needs DeepSpeed (accelerate's sp_backend='deepspeed' runs under "
                "distributed_type DEEPSPEED); launch with accelerate_configs/deepspeed_sequence_parallel.yaml."
            )
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
        return cls(parallel_state_sp.get_sequence_parallel_group())

    # ------------------------------------------------------------------------------------------
    # Generations: one batch per group
    # ------------------------------------------------------------------------------------------
    def generate(self, generate, queries, check=None):
        """``generate(queries)`` for the whole group, the same result on every process of it, so that ``step()``
        gets one batch per group. ``check``: called with a list of queries on every process before the group
        splits it (so that every process raises on a bad one).

        A list of at least ``size`` queries is split: each process generates its share (:meth:`own_share`) and
        the results - a list with one or more entries per query, or a tuple of such lists - are gathered in
        query order. A single query tensor, or fewer queries than processes, is generated by every process
        (ZeRO-3 generation is collective) and the group's first process's result kept (:meth:`share`).
        """
        if check is not None and isinstance(queries, (list, tuple)):
            check(queries)
        if not isinstance(queries, (list, tuple)) or len(queries) < self.size:
            return self.share(generate(queries))
        result = generate(self.own_share(list(queries)))
        parts = [None] * self.size
        dist.all_gather_object(parts, _to_device(result, "cpu"), group=self.group)
        device = next((t.device for t in _tensors(result)), None)
        if isinstance(result, tuple):
            whole = tuple([item for part in parts for item in part[i]] for i in range(len(result)))
        else:
            whole = [item for part in parts for item in part]
        return whole if device is None else _to_device(whole, device)

    def own_share(self, items: list) -> list:
        """This process's contiguous share of the group's ``items``: ``items[k n / S : (k + 1) n / S]`` for
        process ``k`` of ``S`` (none empty when ``n >= S``)."""
        count = len(items)
        return items[self.rank * count // self.size : (self.rank + 1) * count // self.size]

    def share(self, value):
        """``value`` as the group's first process has it, on every process of the group (tensors, lists and
        tuples of them); every process keeps its tensors' device."""
        holder = [_to_device(value, "cpu")]
        dist.broadcast_object_list(holder, group_src=0, group=self.group)
        device = next((t.device for t in _tensors(value)), None)
        return holder[0] if device is None else _to_device(holder[0], device)

    def check_same_rows(self, *parts) -> None:
        """Raise ValueError on every process of the group unless all were given the same rows of a step: equal
        ``parts`` (each a tensor, a list of per-row tensors, or None; ``step()``'s queries, responses, masks,
        PTX inputs, scores and kept sets).

        A group trains one batch: its processes cut the same packed passes and exchange their slices, which with
        different rows fail inside the attention exchange (or train on wrong numbers). Each process gathers every
        member's 8-byte fingerprint (:func:`fingerprint`) and compares them itself: all raise, none is left waiting.
        """
        fingerprints = [None] * self.size
        dist.all_gather_object(fingerprints, fingerprint(*parts), group=self.group)
        if len(set(fingerprints)) > 1:
            raise ValueError(
                f"step() got different rows on the {self.size} processes of a sequence-parallel group (fingerprints of "
                f"their queries, responses, response_masks, ptx_inputs, scores and kept sets, by rank in the group: {fingerprints}). "
                "A group trains one batch: pass each of its processes the same rows (choose the batch by "
                "accelerator.process_index // sp_size, or sample it with trainer.generate(), which gives the group one "
                "generation)."
            )

    @property
    def row_share(self) -> float:
        """Each process's weight in a sum over all processes of its rows: the group's processes hold the same
        rows, so each adds ``1 / size`` of its sum (exact for powers of two) and every row counts once."""
        return 1 / self.size

    def one_per_group(self, gathered: torch.Tensor, processes: int) -> torch.Tensor:
        """Of a gather of equal pieces from all ``processes``, the pieces of the first process of each group
        (its other processes hold the same rows)."""
        return gathered.reshape(processes, -1)[:: self.size].flatten()

    def check_models(self, pack: bool, modules: list, row_attention: dict) -> None:
        """Raise ValueError unless ``modules`` can run cut over the group (see :func:`check_models`)."""
        check_models(self.size, pack, modules, row_attention)

    def slice_buffer_rows(self, buffer_rows: int, tokens: list[int], mini_batch_size: int, max_tokens: int | None) -> int:
        """The most LM-head slots one slice of any pass of a step can hold: at most the slots of a whole pass
        (``buffer_rows``) and at most a slice's tokens, ``ceil(T / size)`` for the largest pass's ``T`` tokens
        (passes of ``mini_batch_size`` rows, or under a budget of ``max_tokens``; ``tokens``: each row's)."""
        longest = sorted(tokens, reverse=True)
        largest_pass = sum(longest[:mini_batch_size])
        if max_tokens is not None:
            largest_pass = max(min(max_tokens, sum(longest)), longest[0])
        return min(buffer_rows, math.ceil(largest_pass / self.size))

    # ------------------------------------------------------------------------------------------
    # Cutting a packed pass
    # ------------------------------------------------------------------------------------------
    def cut(self, inputs: dict, lengths: list[int], firsts: list[int], counts: list[int],
            pad_id: int) -> tuple[dict, SequencePass]:  # fmt: skip
        """This process's slice of a packed pass's model ``inputs`` (:meth:`~trl_lite.trainer.layout.rows.InputLayout.packed`).

        ``lengths``: the rows' tokens; ``firsts``: the stream position of each row's first slot; ``counts``:
        each row's slots (host ints); ``pad_id``: the token id of the padding row. Returns the inputs of the
        slice - ``input_ids``, ``position_ids`` ``(1, chunk)`` and ``logits_positions`` of its slots, relative to
        the slice - and its :class:`SequencePass`.
        """
        total = sum(lengths)
        chunk = math.ceil(total / self.size)
        pad = chunk * self.size - total
        start, stop = self.rank * chunk, (self.rank + 1) * chunk
        slot_counts = slice_slot_counts(self.size, chunk, firsts, counts)
        input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=pad_id)
            padding_positions = torch.arange(pad, device=position_ids.device).unsqueeze(0)
            position_ids = torch.cat((position_ids, padding_positions), dim=1)
        rows = packed_rows(list(lengths) + ([pad] if pad else []), input_ids.device)
        local_positions = position_ids[:, start:stop]
        piece = SequencePass(self, start, stop, total, slot_counts, rows, local_positions)
        batch_index, token_positions = inputs["logits_positions"]
        local = {
            **inputs,
            "input_ids": input_ids[:, start:stop],
            "position_ids": local_positions,
            "logits_positions": (batch_index[piece.slots], token_positions[piece.slots] - start),
        }
        return local, piece

    # ------------------------------------------------------------------------------------------
    # Attention
    # ------------------------------------------------------------------------------------------
    def engine(self, query: torch.Tensor, key: torch.Tensor):
        """DeepSpeed's Ulysses attention for layers of ``query (1, Hq, n, D)`` and ``key (1, Hkv, n, D)``, made once."""
        heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
        engine = self._engines.get((heads, kv_heads, head_dim))
        if engine is None:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            engine = UlyssesSPAttentionHF(
                attn=_whole_rows_attention, batch_size=1, attn_head_count=heads, attn_head_size=head_dim,
                kv_head_count=kv_heads, num_hidden_layers=1, process_group=self.group, seq_length_is_variable=True,
            )  # fmt: skip
            self._engines[(heads, kv_heads, head_dim)] = engine
        return engine


def _tensors(value):
    """The tensors of ``value``: a tensor, or lists and tuples of them (nested)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _to_device(value, device):
    """``value`` (a tensor, or lists and tuples of them) with every tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def fingerprint(*parts) -> str:
    """A hex digest (BLAKE2b, 8 bytes) of ``parts``, each a tensor, a list of tensors (rows) or None: equal parts
    give equal digests on every process, and a difference in any value, dtype, shape or row length changes it.
    The tensors of a list are joined on their device first: one read to the host per part and device."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        rows = [] if part is None else [part] if isinstance(part, torch.Tensor) else list(part)
        digest.update(repr([(t.dtype, tuple(t.shape)) for t in rows]).encode())
        by_device = {}
        for tensor in rows:
            by_device.setdefault(tensor.device, []).append(tensor.detach().reshape(-1))
        for tensors in by_device.values():
            joined = torch.cat([t.view(torch.uint8) if t.numel() else t.new_zeros(0, dtype=torch.uint8) for t in tensors])
            digest.update(joined.cpu().numpy().tobytes())
    return digest.hexdigest()


def slice_slot_counts(size: int, chunk: int, firsts: list[int], counts: list[int]) -> tuple:
    """LM-head slots in each of ``size`` slices of ``chunk`` stream positions: row ``j``'s ``counts[j]`` slots
    sit at positions ``firsts[j] ..``, each slot counted in the slice holding its position (host ints)."""
    return tuple(
        sum(max(0, min(f + n, (k + 1) * chunk) - max(f, k * chunk)) for f, n in zip(firsts, counts))
        for k in range(size)
    )  # fmt: skip


def check_heads(size: int, transformers_model) -> None:
    """Raise ValueError when ``transformers_model``'s attention heads do not split over ``size`` processes."""
    config = transformers_model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"sequence parallelism over sp_size={size} processes splits the attention heads among them: "
            f"{type(transformers_model).__name__} has {heads} query and {kv_heads} key/value heads; the query heads "
            "must be a multiple of sp_size, the key/value heads a multiple or a divisor of it."
        )


def check_models(size: int, pack: bool, modules: list, row_attention: dict) -> None:
    """Raise ValueError unless every model of the passes (``modules``) can run cut over ``size`` processes:
    packed passes, attention per row (each slice's attention layers must see the rows), heads that split."""
    if not pack:
        raise ValueError(
            f"sequence parallelism (sp_size={size}) cuts packed passes: set padding_free=True (packed mini-batches) "
            "with models that can pack."
        )
    for module in modules:
        if id(module) not in row_attention:
            raise ValueError(
                f"sequence parallelism (sp_size={size}) needs models whose packed passes attend per row (sdpa "
                f"attention passing extra keywords to its layers); {type(module).__name__} does not."
            )
        check_heads(size, row_attention[id(module)])


def check_before_prepare(*models) -> None:
    """What sequence parallelism needs before accelerate's DeepSpeed ``prepare`` sees ``models`` (the policy
    and, when there is one, a separate critic; None entries are skipped).

    DeepSpeed's registration reads ``num_key_value_heads`` from each model's config, which configs of models
    whose every head has its own keys and values (GPT-2's) lack: it is set to the head count, which is what it
    means.
    """
    for model in (m for m in models if m is not None):
        text_config = model.config.get_text_config()
        if getattr(text_config, "num_key_value_heads", None) is None:
            text_config.num_key_value_heads = text_config.num_attention_heads


def configure_deepspeed(accelerator, model, critic=None) -> None:
    """What sequence parallelism changes in accelerate's DeepSpeed setup before ``prepare`` sees ``model`` and
    ``critic`` (or None); nothing without it (``sp_size`` 1)."""
    if sequence_parallel_size(accelerator) == 1:
        return
    check_before_prepare(model, critic)
    # accelerate sizes DeepSpeed's global batch by the parallelism config's data-parallel size, which it
    # leaves at 1 under DeepSpeed's sequence parallelism: the groups are the data-parallel replicas.
    accelerator.parallelism_config.dp_replicate_size = data_parallel_size(accelerator)
    zero = accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        # ZeRO-3's reduce-scatter path averages gradients over every process, its all-reduce path (and
        # ZeRO-1/2) over the groups (world / sp_size), which is the mean the slices' gradients need.
        zero["reduce_scatter"] = False


def preparing_again(accelerator):
    """The block of a second model's ``accelerator.prepare`` (a separate critic): :func:`groups_built_once`
    under sequence parallelism, nothing without it."""
    return groups_built_once() if sequence_parallel_size(accelerator) > 1 else nullcontext()


@contextmanager
def groups_built_once():
    """The block of a second model's ``accelerator.prepare`` (a separate critic) under sequence parallelism.

    accelerate's DeepSpeed ``prepare`` builds the sequence-parallel groups for every model it prepares, and
    DeepSpeed refuses to build them twice; inside this block a build finds the groups of the first
    ``prepare`` and keeps them, so the critic's engine reduces its gradients over the same groups as the
    policy's.
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    build = parallel_state_sp.initialize_sequence_parallel

    def build_once(sequence_parallel_size: int) -> None:  # accelerate asks with the one parallelism_config's size
        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
            build(sequence_parallel_size=sequence_parallel_size)

    parallel_state_sp.initialize_sequence_parallel = build_once
    try:
        yield
    finally:
        parallel_state_sp.initialize_sequence_parallel = build


def _whole_rows_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention Ulysses runs between its all-to-alls: packed per-row attention on whole rows
    (``query (1, H/sp, N, D)``); the gathered ``position_ids`` Ulysses adds are not needed (the rows are)."""
    kwargs.pop("position_ids", None)
    return packed_sdpa_attention_forward(module, query, key, value, None, **kwargs)


def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Attention of one slice of a packed pass (``kwargs[SEQUENCE_PASS]``): ``query (1, H, n, D)`` ->
    ``((1, n, H, D), None)``, through DeepSpeed's Ulysses all-to-all and packed attention on whole rows.

    Without a :class:`SequencePass` (a pass that was not cut): plain packed attention.
    """
    piece = kwargs.pop(SEQUENCE_PASS, None)
    if piece is None:
        return packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs[ROW_LENGTHS] = piece.rows
    kwargs["position_ids"] = piece.position_ids
    # With fewer key/value heads than processes DeepSpeed repeats them for the exchange and sets the module's
    # num_key_value_groups to the exchanged heads' ratio, for good: the passes that are not cut (generation,
    # padded passes) need the model's own.
    groups = getattr(module, "num_key_value_groups", None)
    try:
        out, weights = piece.parallel.engine(query, key)(module, query, key, value, None, **kwargs)
    finally:
        if groups is not None:
            module.num_key_value_groups = groups
    return out.reshape(query.shape[0], query.shape[2], query.shape[1], -1), weights


AttentionInterface.register(ULYSSES_SDPA, ulysses_attention_forward)
AttentionMaskInterface.register(ULYSSES_SDPA, packed_sdpa_mask)
