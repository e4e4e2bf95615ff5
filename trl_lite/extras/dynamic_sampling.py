"""DAPO's dynamic sampling: fill a batch with groups whose scores are not all equal.

Under a group baseline (``advantage_estimator="grpo"`` or ``"rloo"``, docs/algorithm.md section 12) a group
whose rows all score the same has zero advantage on every token: it costs a forward and a backward
pass and teaches nothing, and as training solves more prompts more groups look like that. DAPO (Yu et
al., 2025, "over-sampling and filtering") drops such groups and samples more until the batch is full.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

REQUIRED_KEYS = ("queries", "responses", "scores")


@dataclass
class SampledBatch:
    """A batch from :class:`DynamicSampler`: ``batch_size`` rows, the ``group_size`` rows of a group adjacent.

    Attributes:
        queries, responses, scores: lists of ``batch_size`` entries, as ``generate_and_score`` returned
            them (``PPOTrainer.step(batch.queries, batch.responses, batch.scores)`` takes them as they are).
        extras: every other key ``generate_and_score`` returned, each a list of ``batch_size`` entries
            aligned with the rows above.
        tries: calls made to ``generate_and_score`` (1 to ``max_tries``).
        dropped_groups: groups whose rows all had the same score, over all the calls (those put back by
            the fill below included).
        filled_with_zero_std: dropped groups put back at the end of the batch because ``max_tries`` calls
            did not find enough groups with unequal scores (0 unless a warning was raised).
    """

    queries: list
    responses: list
    scores: list
    extras: dict[str, list]
    tries: int
    dropped_groups: int
    filled_with_zero_std: int


def _as_rows(value, key: str, call: int) -> list:
    """One value of ``generate_and_score``'s dict as a list of rows (a tensor or array: along dim 0)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 1:
        return list(value)
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, (torch.Tensor, np.ndarray)) else ""
    raise TypeError(
        f"generate_and_score must return a list, tuple, or tensor/array of rows (along dim 0) for every key; "
        f"call {call} gave {key!r} as {type(value).__name__}{shape}."
    )


def _on_host(column: list) -> list:
    """A column of rows with its device tensors copied to the CPU (float64) in one transfer.

    The rows of a GPU tensor of scores are views of it: reading them one by one would block the host
    once per row. Rows on different devices are gathered on the first one's device first.
    """
    index = [i for i, row in enumerate(column) if isinstance(row, torch.Tensor) and row.device.type != "cpu"]
    if not index:
        return column
    device = column[index[0]].device
    flat = torch.cat([column[i].detach().reshape(-1).to(device, torch.float64) for i in index]).cpu()
    rows = list(column)
    for i, values in zip(index, flat.split([column[i].numel() for i in index])):
        rows[i] = values.reshape(column[i].shape)
    return rows


def _row_value(value, key: str, index: int, call: int) -> float:
    """A row's entry of the filtered key as a finite float (a number, or a tensor/array of one element)."""
    try:
        number = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"generate_and_score()[{key!r}] must hold one number per row (a number or a one-element tensor); "
            f"call {call} gave row {index} as {type(value).__name__} {value!r:.40}."
        ) from None
    if number.numel() != 1:
        raise ValueError(
            f"generate_and_score()[{key!r}] must hold one number per row; call {call} gave row {index} with "
            f"{number.numel()} elements (shape {tuple(number.shape)})."
        )
    number = float(number.reshape(()))
    if not math.isfinite(number):
        raise ValueError(f"generate_and_score()[{key!r}] must be finite; call {call} gave row {index} = {number}.")
    return number


class DynamicSampler:
    """DAPO's dynamic sampling: drop the groups whose scores are all equal, ask for more until the batch is full.

    ``sampler(generate_and_score)`` calls ``generate_and_score(num_groups)`` with the number of groups still
    missing, keeps the groups whose rows do not all score the same (in the order they come), and calls again
    until ``batch_size // group_size`` groups are kept or ``max_tries`` calls were made. Groups beyond the
    batch are cut. When the calls run out first it warns and fills the batch with groups it dropped (the
    earliest first), so that ``PPOTrainer.step`` still gets ``batch_size`` rows; the returned
    :class:`SampledBatch` counts them in ``filled_with_zero_std``.

    ``generate_and_score(num_groups: int) -> dict`` samples responses to at least ``num_groups`` queries,
    ``group_size`` per query, and returns ``{"queries": [...], "responses": [...], "scores": [...], **extras}``:
    lists (or tensors along dim 0) with one entry per row, the ``group_size`` rows of a query adjacent, so
    that ``step``'s default groups (runs of ``num_samples_per_query`` rows) are the sampler's. Every other
    key is carried along per row into ``SampledBatch.extras`` (decoded texts, rewards before shaping, ...);
    each call must return the same keys. It may return more groups than asked for: generating a whole batch
    of prompts per call costs about as much as a few, and needs fewer calls once most groups are all equal.

    Args:
        batch_size: rows of each returned batch (``PPOConfig.batch_size``), a multiple of ``group_size``.
        group_size: rows per group (``PPOConfig.num_samples_per_query``), at least 2.
        max_tries: calls of ``generate_and_score`` per batch at most.
        metric: the key whose all-equal groups are dropped: ``"scores"`` (default), or an extra key,
            e.g. the correctness of each row when ``scores`` also hold format or length terms (veRL's
            ``filter_groups.metric``).

    The filter sees the scores before ``step``'s shaping (``missing_eos_penalty``, the overlong penalty,
    score scaling); ``step`` reports the fraction of all-equal groups it trained on in ``env/frac_groups_zero_std``.

    Example, with a ``PPOTrainer`` configured with ``advantage_estimator="grpo"``, ``num_samples_per_query=8``::

        def generate_and_score(num_groups):
            prompts = next_prompts(num_groups)                          # num_groups prompts, token ids
            responses = trainer.generate(prompts, return_prompt=False, num_return_sequences=8, do_sample=True)
            queries = [q for q in prompts for _ in range(8)]            # the 8 rows of a prompt adjacent
            texts = tokenizer.batch_decode(responses)
            return {"queries": queries, "responses": responses, "scores": [reward(q, t) for q, t in ...], "texts": texts}

        sampler = DynamicSampler(batch_size=config.batch_size, group_size=8, max_tries=8)
        for _ in range(config.steps):
            batch = sampler(generate_and_score)
            stats = trainer.step(batch.queries, batch.responses, batch.scores)

    What the sampler does, with a scripted ``generate_and_score`` (groups of 2 rows, 2 groups a batch):

    >>> scripted = iter([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0], [1.0, 0.0, 0.5, 0.5]])
    >>> asked = []
    >>> def generate_and_score(num_groups):
    ...     asked.append(num_groups)
    ...     scores = next(scripted)
    ...     return {"queries": ["q"] * len(scores), "responses": ["r"] * len(scores), "scores": scores}
    >>> batch = DynamicSampler(batch_size=4, group_size=2)(generate_and_score)
    >>> batch.scores, asked, batch.tries, batch.dropped_groups, batch.filled_with_zero_std
    ([0.0, 1.0, 1.0, 0.0], [2, 1, 1], 3, 3, 0)
    """

    def __init__(self, batch_size: int, group_size: int, max_tries: int = 8, metric: str = "scores") -> None:
        for name, value, least in (("batch_size", batch_size, 1), ("group_size", group_size, 2), ("max_tries", max_tries, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                # A group of one row always has equal scores: every group would be dropped.
                why = " (a group of one row never has unequal scores)" if name == "group_size" else ""
                raise ValueError(f"{name} must be an int >= {least}{why}, got {value!r}.")
        if batch_size % group_size != 0:
            raise ValueError(
                f"batch_size must be a multiple of group_size (whole groups per batch), got batch_size={batch_size} "
                f"and group_size={group_size}."
            )
        if not isinstance(metric, str) or metric in ("queries", "responses"):
            raise ValueError(f"metric must be 'scores' or the name of an extra per-row key, got {metric!r}.")
        self.batch_size = int(batch_size)
        self.group_size = int(group_size)
        self.max_tries = int(max_tries)
        self.metric = metric

    @property
    def num_groups(self) -> int:
        """Groups per batch: ``batch_size // group_size``."""
        return self.batch_size // self.group_size

    def __repr__(self) -> str:
        return (
            f"DynamicSampler(batch_size={self.batch_size}, group_size={self.group_size}, max_tries={self.max_tries}, "
            f"metric={self.metric!r})"
        )

    def _checked_rows(self, output, asked: int, keys: tuple | None, call: int) -> dict[str, list]:
        """``generate_and_score``'s dict as ``{key: list of rows}`` after checking its keys and lengths."""
        if not isinstance(output, Mapping):
            raise TypeError(
                f"generate_and_score must return a dict with keys {', '.join(REQUIRED_KEYS)} (and any per-row "
                f"extras); call {call} returned {type(output).__name__}."
            )
        missing = [key for key in (*REQUIRED_KEYS, self.metric) if key not in output]
        if missing:
            raise ValueError(
                f"generate_and_score must return the keys {', '.join(dict.fromkeys((*REQUIRED_KEYS, self.metric)))}; "
                f"call {call} lacks {', '.join(map(repr, dict.fromkeys(missing)))} (it returned {sorted(map(str, output))})."
            )
        if keys is not None and set(output) != set(keys):
            raise ValueError(
                f"generate_and_score must return the same keys on every call; call 1 returned {list(keys)}, "
                f"call {call} returned {list(output)}."
            )
        rows = {key: _as_rows(value, key, call) for key, value in output.items()}
        n = len(rows["scores"])
        lengths = {key: len(value) for key, value in rows.items()}
        if any(length != n for length in lengths.values()):
            raise ValueError(
                f"generate_and_score must return one entry per row under every key; call {call} gave the lengths {lengths}."
            )
        if n % self.group_size != 0 or n < asked * self.group_size:
            raise ValueError(
                f"generate_and_score(num_groups={asked}) must return a whole number of groups of group_size="
                f"{self.group_size} rows, at least num_groups of them (>= {asked * self.group_size} rows); call {call} "
                f"returned {n} rows."
            )
        return rows

    def __call__(self, generate_and_score: Callable[[int], Mapping]) -> SampledBatch:
        """Call ``generate_and_score`` until ``batch_size`` rows in groups of unequal scores are found (or
        ``max_tries`` calls were made); returns them as a :class:`SampledBatch`."""
        if not callable(generate_and_score):
            raise TypeError(
                f"generate_and_score must be a callable num_groups -> dict, got {type(generate_and_score).__name__}."
            )
        size, needed = self.group_size, self.num_groups
        kept: list[dict[str, list]] = []  # groups with unequal scores, in arrival order
        zero_std: list[dict[str, list]] = []  # groups dropped, kept aside for the fill
        keys = None
        tries = 0
        while len(kept) < needed and tries < self.max_tries:
            asked = needed - len(kept)
            tries += 1
            rows = self._checked_rows(generate_and_score(asked), asked, keys, tries)
            keys = tuple(rows)
            values = [_row_value(v, self.metric, i, tries) for i, v in enumerate(_on_host(rows[self.metric]))]
            for start in range(0, len(values), size):
                group = {key: column[start : start + size] for key, column in rows.items()}
                group_values = values[start : start + size]
                (zero_std if max(group_values) == min(group_values) else kept).append(group)

        short = needed - len(kept)
        if short > 0:
            warnings.warn(
                f"DynamicSampler: after max_tries={self.max_tries} calls of generate_and_score, {short} of the "
                f"{needed} groups were still missing ({len(zero_std)} groups dropped because all their "
                f"{self.metric!r} were equal); filled the batch with {short} of those, which give no learning "
                f"signal under a group baseline. Raise max_tries, or let generate_and_score return more groups "
                f"per call, to keep such groups out.",
                stacklevel=2,
            )
            kept += zero_std[:short]
        groups = kept[:needed]
        columns = {key: [row for group in groups for row in group[key]] for key in keys}
        return SampledBatch(
            queries=columns.pop("queries"),
            responses=columns.pop("responses"),
            scores=columns.pop("scores"),
            extras=columns,
            tries=tries,
            dropped_groups=len(zero_std),
            filled_with_zero_std=max(short, 0),
        )
