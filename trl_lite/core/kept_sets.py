"""Truncated sampling's kept sets (docs/algorithm_rollouts.md section 23, docs/truncated_sampling.md): the rule that makes them and
the compact form they travel in.

A sampler that truncates (``top_k > 0``, ``top_p < 1``, ``min_p > 0``) draws a position's token from
``pi_T^K = pi_T / pi_T(K)`` over its kept set ``K``. :func:`kept_mask` applies the rule to ``z / T`` as the
engine does - transformers' warpers in their order (top-k, then top-p on the top-k-renormalised mass, then
min-p; ties at a boundary kept by top-k and min-p, top-p by its sort; at least one token), or vLLM's order
(min-p, top-k, top-p). :class:`KeptSets` holds the sets of a step's token positions as CSR (token ids per
position, int32), bounded: a set larger than :attr:`Truncation.max_kept` tokens (a top-p set without a top-k
bound, over a flat distribution) keeps its ``max_kept`` most probable tokens and the sampled one.

Shape names: ``R`` positions, ``V`` vocabulary, ``K`` the longest kept set of a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

# The documented bound of a stored kept set (tokens per position); see Truncation.max_kept.
MAX_KEPT = 1024


@dataclass(frozen=True)
class Truncation:
    """The cut of a run's sampler (``PPOConfig.top_k``, ``top_p``, ``min_p``) and the engine order it follows.

    ``order``: ``'transformers'`` (top-k, top-p, min-p) or ``'vllm'`` (min-p, top-k, top-p). ``max_kept``: the
    bound of one stored set (default :data:`MAX_KEPT`): a top-p set with no top-k bound that is larger keeps its
    ``max_kept`` most probable tokens (and the sampled one); the dropped tail is below ``1 - top_p`` of the mass
    plus what the bound cuts, which the run sees as ``policy/truncation/capped``.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    order: str = "transformers"
    max_kept: int = MAX_KEPT

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}.")
        for name, value in (("top_p", self.top_p), ("min_p", self.min_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}.")
        if self.top_p == 0.0:
            raise ValueError("top_p must be a number in (0, 1] (1.0: off), got 0.0.")
        if self.order not in ("transformers", "vllm"):
            raise ValueError(f"order must be 'transformers' or 'vllm', got {self.order!r}.")
        if isinstance(self.max_kept, bool) or not isinstance(self.max_kept, int) or self.max_kept < 1:
            raise ValueError(f"max_kept must be an int >= 1, got {self.max_kept!r}.")

    @classmethod
    def of(cls, sampling, **options) -> Truncation | None:
        """The cut of a ``PPOConfig`` or :class:`~trl_lite.engines.Sampling`, or None when it does not truncate."""
        cut = cls(int(sampling.top_k or 0), float(sampling.top_p), float(sampling.min_p or 0.0), **options)
        return cut if cut.active else None

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def bound(self) -> int:
        """The most tokens one stored set holds, the sampled one aside (a top-k set holds k, and its ties)."""
        return self.max_kept


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    k = min(max(k, 1), scores.shape[-1])
    return scores.masked_fill(scores < torch.topk(scores, k).values[..., -1:], -math.inf)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    # transformers' TopPLogitsWarper: ascending sort, drop the tokens whose cumulative mass is <= 1 - top_p.
    ordered, order = torch.sort(scores, descending=False)
    drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(scores, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.masked_fill(drop, -math.inf)


@torch.no_grad()
def kept_mask(scores: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """``(R, V)`` bool: the tokens each position's sampler keeps from ``scores`` ``(R, V)`` = ``z / T`` (any float
    dtype; the rule runs in float32 or wider), in ``truncation.order``."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    candidates = _top_k_candidates(scores, truncation)
    if candidates is not None:
        columns, kept = candidates
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, columns, kept)
    return _cut(scores, truncation)


def _top_k_candidates(scores: torch.Tensor, truncation: Truncation):
    """With top-k first (transformers' order): ``(columns (R, W), kept (R, W))``, the top-k tokens and their ties and
    which of them top-p and min-p keep - run on those columns alone (the rest are -inf to them), a sort of ``W``
    values per position instead of the vocabulary's; None for another order or no top-k."""
    k = truncation.top_k
    if truncation.order != "transformers" or not 0 < k < scores.shape[-1]:
        return None
    values, columns = torch.topk(scores, min(k + 1, scores.shape[-1]))
    threshold = values[..., k - 1 : k]
    if bool((values[..., k:] >= threshold).any()):  # ties with the k-th token: all kept, however many
        width = int((scores >= threshold).sum(-1).max())
        values, columns = torch.topk(scores, width)
    else:
        values, columns = values[..., :k], columns[..., :k]
    return columns, _cut(values.masked_fill(values < threshold, -math.inf), replace(truncation, top_k=0))


def _cut(scores: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    steps = {"top_k": lambda s: _top_k(s, truncation.top_k), "top_p": lambda s: _top_p(s, truncation.top_p),
             "min_p": lambda s: _min_p(s, truncation.min_p)}  # fmt: skip
    order = ("top_k", "top_p", "min_p") if truncation.order == "transformers" else ("min_p", "top_k", "top_p")
    for name, off in zip(order, [{"top_k": 0, "top_p": 1.0, "min_p": 0.0}[n] for n in order]):
        if getattr(truncation, name) != off:
            scores = steps[name](scores)
    return scores > -math.inf


@torch.no_grad()
def kept_ids(scores: torch.Tensor, labels: torch.Tensor, truncation: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept sets of ``scores`` ``(R, V)`` (``z / T``) in padded form: ids ``(R, K)`` int64 (padding: the
    position's label) and counts ``(R,)``; each set holds its ``labels`` ``(R,)`` token (added when the rule, run
    again on other logits than the sampler's, dropped it) and at most ``truncation.bound`` tokens besides."""
    candidates = _top_k_candidates(scores.to(torch.promote_types(scores.dtype, torch.float32)), truncation)
    if candidates is not None and candidates[0].shape[-1] <= truncation.bound:
        return _compact(*candidates, labels.reshape(-1, 1))
    return ids_of_mask(kept_mask(scores, truncation), scores, labels, truncation.bound)


@torch.no_grad()
def ids_of_mask(keep: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, bound: int = MAX_KEPT):
    """:func:`kept_ids` of a kept mask ``keep`` ``(R, V)`` bool (written: each ``labels`` token set in it) - the
    rule's, or the tokens a sampler left finite - capped at ``bound`` tokens besides the label, the most probable
    by ``scores`` ``(R, V)`` kept."""
    keep.scatter_(-1, labels.reshape(-1, 1), True)
    counts = keep.sum(-1)
    width = int(counts.max()) if counts.numel() else 1
    bound = bound + 1
    if width > bound:  # the most probable bound - 1 tokens and the label
        ranked = scores.to(torch.float32).masked_fill(~keep, -math.inf)
        ranked.scatter_(-1, labels.reshape(-1, 1), math.inf)
        top = torch.topk(ranked, bound, dim=-1)
        valid = top.values > -math.inf
        return torch.where(valid, top.indices, labels.reshape(-1, 1)), valid.sum(-1)
    # Row-major nonzero lists each row's ids in vocabulary order: CSR directly.
    ids = labels.reshape(-1, 1).expand(-1, max(width, 1)).clone()
    rows, cols = keep.nonzero(as_tuple=True)
    starts = torch.cumsum(counts, 0) - counts
    ids[rows, torch.arange(rows.numel(), device=rows.device) - starts[rows]] = cols
    return ids, counts


@torch.no_grad()
def finite_ids(scores: torch.Tensor, bound: int = MAX_KEPT) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampler's processed ``scores`` ``(R, V)`` leave finite, before its token is known: padded ids
    ``(R, K)`` int64 and counts ``(R,)`` - in vocabulary order, or (when a set holds over ``bound + 1`` tokens) the
    ``bound + 1`` most probable of every set, most probable first, so :func:`with_labels` can drop the last."""
    keep = scores > -math.inf
    counts = keep.sum(-1)
    width = int(counts.max()) if counts.numel() else 1
    if width > bound + 1:
        top = torch.topk(scores.to(torch.float32).masked_fill(~keep, -math.inf), bound + 1, dim=-1)
        valid = top.values > -math.inf
        return torch.where(valid, top.indices, top.indices[:, :1]), valid.sum(-1)
    ids = torch.zeros(scores.shape[0], max(width, 1), dtype=torch.int64, device=scores.device)
    rows, cols = keep.nonzero(as_tuple=True)
    starts = torch.cumsum(counts, 0) - counts
    ids[rows, torch.arange(rows.numel(), device=rows.device) - starts[rows]] = cols
    return ids, counts


@torch.no_grad()
def with_labels(ids: torch.Tensor, counts: torch.Tensor, labels: torch.Tensor, bound: int = MAX_KEPT):
    """:func:`finite_ids`'s sets with each position's sampled token ``labels`` ``(R,)`` in them: the sets
    :func:`ids_of_mask` makes of the same scores (the label added where missing; a set over the cap keeps its
    ``bound`` most probable tokens and the label). Padded ids ``(R, K)`` (padding: the label) and counts ``(R,)``."""
    labels = labels.reshape(-1, 1).to(ids.device)
    inside = torch.arange(ids.shape[1], device=ids.device) < counts.unsqueeze(-1)
    missing = ~((ids == labels) & inside).any(-1, keepdim=True)
    ids = torch.cat([ids, labels], dim=-1)
    at = torch.where(counts > bound, counts - 1, counts).unsqueeze(-1)  # capped: the least probable makes room
    ids.scatter_(-1, at, torch.where(missing, labels, ids.gather(-1, at)))
    counts = counts + (missing.squeeze(-1) & (counts <= bound))
    inside = torch.arange(ids.shape[1], device=ids.device) < counts.unsqueeze(-1)
    return torch.where(inside, ids, labels), counts


def padded_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Padded set ids ``(N, K)`` widened to ``(N, width)`` with each set's first id (the padding of a set)."""
    return ids if ids.shape[1] >= width else torch.cat([ids, ids[:, :1].expand(-1, width - ids.shape[1])], 1)


@torch.no_grad()
def fill_holes(scores: torch.Tensor, labels: torch.Tensor, ids, counts, truncation: Truncation):
    """The replayed sets ``ids`` ``(R, K)`` / ``counts`` ``(R,)`` of ``R`` positions with every position that has
    none (count 0: no recorded set; ``ids`` None: none has one) given the set ``truncation``'s rule makes from
    ``scores`` ``(R, V)`` (``z / T``) - the re-derivation fallback (docs/truncated_sampling.md)."""
    if ids is None:
        return kept_ids(scores, labels, truncation)
    holes = (counts == 0).nonzero().squeeze(-1)
    if holes.numel() == 0:
        return ids, counts
    made, made_counts = kept_ids(scores[holes], labels[holes], truncation)
    width = max(ids.shape[1], made.shape[1])
    ids, counts = padded_ids(ids, width).clone(), counts.clone()
    ids[holes], counts[holes] = padded_ids(made, width), made_counts
    return ids, counts


def _compact(columns: torch.Tensor, kept: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded sets from candidate ``columns`` ``(R, W)`` and which are ``kept``: the kept ones first, then the label
    ``(R, 1)`` where it is not among them; padding: the label. (A top-k set: at most k tokens and ties.)"""
    order = torch.argsort(kept.to(torch.int8), dim=-1, descending=True, stable=True)
    ids = torch.cat([columns.gather(-1, order), labels], dim=-1)
    counts = kept.sum(-1)
    inside = torch.arange(ids.shape[1], device=ids.device) < counts.unsqueeze(-1)
    missing = ~((ids == labels) & inside).any(-1)
    ids.scatter_(-1, counts.unsqueeze(-1), labels)  # the label right after the kept ones (kept only if missing)
    counts = counts + missing
    inside = torch.arange(ids.shape[1], device=ids.device) < counts.unsqueeze(-1)
    return torch.where(inside, ids, labels), counts


@dataclass
class KeptSets:
    """The kept sets of a step's token positions: CSR over ``(row, compact position)`` keys ``row * width + k``.

    ``offsets`` ``(B * width + 1,)`` int64, ``ids`` ``(nnz,)`` int32; a position with no set (padding, a prompt)
    holds none. Built from padded passes by :meth:`from_passes`; a pass reads its slots' sets back padded by
    :meth:`for_slots`.
    """

    offsets: torch.Tensor
    ids: torch.Tensor
    width: int

    @classmethod
    def from_passes(cls, rows: int, width: int, passes: list, device) -> KeptSets:
        """``passes``: ``(keys (N,), ids (N, K), counts (N,))`` per pass, ``keys`` the flat ``row * width + k``."""
        counts = torch.zeros(rows * width, dtype=torch.int64, device=device)
        pieces = []
        for keys, ids, n in passes:
            counts[keys] = n
            pieces.append((keys, ids, n))
        offsets = torch.zeros(rows * width + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=offsets[1:])
        flat = torch.empty(int(offsets[-1]), dtype=torch.int32, device=device)
        for keys, ids, n in pieces:
            column = torch.arange(ids.shape[1], device=device)
            inside = column < n.reshape(-1, 1)
            flat[(offsets[keys].reshape(-1, 1) + column)[inside]] = ids[inside].to(torch.int32)
        return cls(offsets, flat, width)

    def for_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sets of the slots ``(rows[i], positions[i])`` ``(N,)`` padded: ids ``(N, K)`` int64 (padding: the
        set's first id) and counts ``(N,)``."""
        keys = rows.to(torch.int64) * self.width + positions.to(torch.int64)
        starts, counts = self.offsets[keys], self.offsets[keys + 1] - self.offsets[keys]
        width = max(1, int(counts.max())) if counts.numel() else 1
        column = torch.arange(width, device=keys.device)
        at = starts.reshape(-1, 1) + torch.minimum(column, (counts.reshape(-1, 1) - 1).clamp(min=0))
        return self.ids[at.clamp(max=max(self.ids.numel() - 1, 0))].to(torch.int64), counts

    def select_rows(self, index: torch.Tensor) -> KeptSets:
        """The sets of rows ``index`` (a new batch of ``len(index)`` rows, the same width)."""
        rows = index.to(torch.int64)
        keys = (rows.reshape(-1, 1) * self.width + torch.arange(self.width, device=rows.device)).reshape(-1)
        counts = self.offsets[keys + 1] - self.offsets[keys]
        offsets = torch.zeros(keys.numel() + 1, dtype=torch.int64, device=rows.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        ids, _ = self.for_slots(keys // self.width, keys % self.width)
        inside = torch.arange(ids.shape[1], device=rows.device) < counts.reshape(-1, 1)
        return KeptSets(offsets, ids[inside].to(torch.int32), self.width)

    @classmethod
    def one_row(cls, ids: torch.Tensor, counts: torch.Tensor) -> KeptSets:
        """The sets of one response's ``n`` positions from padded ``ids`` ``(n, K)`` and ``counts`` ``(n,)`` (0: none)."""
        n = counts.shape[0]
        return cls.from_passes(1, n, [(torch.arange(n, device=ids.device), ids, counts)], ids.device)

    @classmethod
    def joined(cls, pieces: list) -> KeptSets:
        """One row's sets: ``pieces`` one-row :class:`KeptSets` and ints (that many positions without a set, e.g. a
        tool's tokens), in order along the response."""
        device = next((p.ids.device for p in pieces if isinstance(p, KeptSets)), torch.device("cpu"))
        counts = [p.counts.to(device) if isinstance(p, KeptSets) else torch.zeros(p, dtype=torch.int64, device=device)
                  for p in pieces]  # fmt: skip
        counts = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64, device=device)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=offsets[1:])
        ids = [p.ids.to(device) for p in pieces if isinstance(p, KeptSets)]
        return cls(offsets, torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32, device=device), counts.numel())

    @classmethod
    def stacked(cls, records: list, width: int, device) -> KeptSets:
        """The sets of ``len(records)`` rows of ``width`` positions: row ``b``'s first positions from ``records[b]``
        (a one-row :class:`KeptSets` of at most ``width`` positions), none where it is None."""
        counts = torch.zeros(len(records), width, dtype=torch.int64, device=device)
        ids = []
        for b, record in enumerate(records):
            if record is not None:
                counts[b, : record.width] = record.counts.to(device)
                ids.append(record.ids.to(device))
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts.reshape(-1), 0, out=offsets[1:])
        return cls(offsets, torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32, device=device), width)

    def first(self, n: int) -> KeptSets:
        """The sets of a one-row :class:`KeptSets`'s first ``n`` positions."""
        end = int(self.offsets[n])
        return KeptSets(self.offsets[: n + 1], self.ids[:end], n)

    @property
    def counts(self) -> torch.Tensor:
        """Each position's set size ``(rows * width,)`` (0: no set)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def nbytes(self) -> int:
        return self.offsets.numel() * 8 + self.ids.numel() * 4


def rows_of_sets(kept_sets: list | None) -> list | None:
    """Per row one int64 tensor of its one-row :class:`KeptSets` (offsets, then ids; ``[-1]`` for None), to compare
    rows' sets across processes; None for None."""
    if kept_sets is None:
        return None
    return [torch.tensor([-1]) if kept is None else torch.cat([kept.offsets, kept.ids.to(torch.int64)])
            for kept in kept_sets]  # fmt: skip


# The most responses a RecordedSets holds between two takes (the oldest dropped first).
MAX_RECORDED_ROWS = 4096


class RecordedSets:
    """The kept sets a sampler recorded for the responses it returned, found again by their tokens.

    Classic code hands ``step()`` the responses ``generate()`` returned, sliced or copied: :meth:`take` finds each
    row's record by its query and response token ids (the response without the prompt; an encoder-decoder's with
    its start token). A row edited since, or sampled elsewhere, has none. Bounded: :meth:`take` empties the store
    (what it did not match is dropped), and past ``max_rows`` records the oldest go.
    """

    def __init__(self, max_rows: int = MAX_RECORDED_ROWS):
        self.max_rows = max_rows
        self._sets: dict = {}

    def __len__(self) -> int:
        return len(self._sets)

    def record(self, queries: list, responses: list, sets: list) -> None:
        """``sets[i]``: the one-row :class:`KeptSets` of ``responses[i]``'s generated tokens, or None."""
        for key, kept in zip(_token_keys(queries, responses), sets):
            if kept is not None:
                self._sets.pop(key, None)
                self._sets[key] = kept
        while len(self._sets) > self.max_rows:
            self._sets.pop(next(iter(self._sets)))

    def take(self, queries: list, responses: list) -> list | None:
        """Per row its record or None (None for all: no row has one); the store is empty afterwards.

        A row whose response is a recorded response's beginning (cut after its EOS, or to a length, as classic
        scripts cut ``generate``'s padded output) gets that record's first sets: a sampler's set at a position
        depends on the tokens before it only."""
        if not self._sets:
            return None
        keys = _token_keys(queries, responses)
        found = [self._sets.get(key) for key in keys]
        if any(kept is None for kept in found):
            by_query: dict = {}
            for query, response in self._sets:
                by_query.setdefault(query, []).append(response)
            for i, (query, response) in enumerate(keys):
                if found[i] is None:
                    found[i] = self._prefix_of(query, response, by_query.get(query, ()))
        self._sets.clear()
        return found if any(kept is not None for kept in found) else None

    def _prefix_of(self, query: tuple, response: tuple, recorded: list) -> KeptSets | None:
        """The sets of ``response``'s positions from a record of ``query`` whose response begins with it, or None."""
        n = len(response)
        for full in recorded:
            if n and len(full) > n and full[:n] == response:
                kept = self._sets[(query, full)]
                return kept.first(kept.width - (len(full) - n))  # an encoder-decoder's start token has no set
        return None

    def clear(self) -> None:
        self._sets.clear()


def _token_keys(queries: list, responses: list) -> list[tuple]:
    """``(query ids, response ids)`` per row, read to the host in one copy."""
    tensors = [t.reshape(-1) for pair in zip(queries, responses) for t in pair]
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([t.to(device=device, dtype=torch.long) for t in tensors]).tolist()
    keys, start = [], 0
    for query, response in zip(tensors[::2], tensors[1::2]):
        middle, end = start + query.numel(), start + query.numel() + response.numel()
        keys.append((tuple(flat[start:middle]), tuple(flat[middle:end])))
        start = end
    return keys
