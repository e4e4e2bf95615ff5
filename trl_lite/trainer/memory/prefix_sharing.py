"""Prefix sharing: the packed layout that runs a prompt once for all the rows of a pass that share it, and the
one object that decides where it runs (:class:`PrefixSharing`).

Rows with identical query tokens (the groups of ``num_samples_per_query`` / ``group_ids``, equal queries
in a GAE batch) are found once per ``step()`` (:func:`prompt_ids`); each packed pass then lays out every
such group as ``prompt + response_1 + ... + response_g`` (:func:`shared_inputs`), attended as
:mod:`trl_lite.models.shared_prefix_attention` describes. The compact slot ``(j, 0)`` of every row of a
group reads the prompt's last token (the shared logits of each response's first token, and the shared
value); slot ``(j, k)`` reads response ``j``'s token ``k - 1``. Exact: every slot sees what it sees in its
own row (docs/prefix_sharing.md).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ...models.shared_prefix_attention import shared_rows
from ..layout.rows import Rows, to_device, token_slots
from .token_budget import split_by_tokens

#: The automatic rule's threshold: sharing is on for a step when the passes it will run save at least this share
#: of their tokens (:meth:`PrefixSharing.estimated_saving`).
AUTOMATIC_SAVING = 0.25
#: A training pass's tokens weigh this many times a rollout pass's in the automatic rule: forward and backward.
TRAINING_WEIGHT = 3
#: Row shuffles the automatic rule draws (from a generator of its own) to estimate the training passes' saving.
ESTIMATE_DRAWS = 4


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What the automatic rule needs of a step's passes: rows per rollout pass (``mini_batch_size``), per
    backward batch, the epochs, the rollout's model passes (policy, reference), whether the estimator is
    one of groups (critic-free), and ``PPOConfig.shuffle_by_prompt`` (None: automatic)."""

    mini_batch_size: int
    backward_batch_size: int
    epochs: int = 1
    rollout_models: int = 2
    group_estimator: bool = False
    shuffle_by_prompt: bool | None = None

    @classmethod
    def of(cls, config, rollout_models: int = 2) -> Schedule:
        return cls(config.mini_batch_size, config.backward_batch_size, config.ppo_epochs, max(rollout_models, 1),
                   config.critic_free, config.shuffle_by_prompt)  # fmt: skip


def prompt_ids(queries: list[torch.Tensor]) -> tuple:
    """Per row, the number of the first row whose query tokens equal its own (itself when none before it does).

    Call it on the host tensors of ``step()`` (before the batch's copy to the device): the queries are read
    as ints in one read (queries a user left on an accelerator wait for it once, not per row). One dictionary look-up
    per row, so the automatic rule's look costs O(tokens), not a comparison with every earlier query.
    """
    if not queries:
        return ()
    tokens, first, ids, start = torch.cat([q.reshape(-1) for q in queries]).tolist(), {}, [], 0  # one read
    for i, query in enumerate(queries):
        end = start + query.numel()
        ids.append(first.setdefault(tuple(tokens[start:end]), i))
        start = end
    return tuple(ids)


def epoch_order(rows: int, prompts: tuple | None) -> list[int]:
    """One epoch's order of ``rows`` rows (``PPOConfig.shuffle_by_prompt``), drawn from torch's global generator.

    ``prompts``: None, a shuffle of the rows (``torch.randperm(rows)``, what the learner always drew); else the
    rows' :func:`prompt_ids`, and the shuffle permutes prompts: the rows of each prompt follow one another in
    their order in the batch. Given ``prompts`` it depends on the query tokens alone, so with ``shuffle_by_prompt``
    set the mini-batches are the same with sharing on and off (whether the learner passes them:
    :meth:`PrefixSharing.epoch_prompts`).
    """
    if prompts is None:
        return torch.randperm(rows).tolist()
    groups = list(_members(prompts).values())
    return [i for g in torch.randperm(len(groups)).tolist() for i in groups[g]]


def saved_tokens(rows: Rows, index: list[int], ids: tuple) -> int:
    """Prompt tokens a pass over rows ``index`` does not run again with the shared layout (host ints)."""
    seen, saved = set(), 0
    for i in index:
        if ids[i] in seen:
            saved += len(rows.queries[i])
        seen.add(ids[i])
    return saved


def obstacle(pack: bool, encoder_decoder: bool, cut: bool, not_attending: list[str]) -> str | None:
    """Why a trainer's passes cannot share prompts, or None when they can: they must be packed, of a
    decoder-only model, not cut over a sequence-parallel group, and every model's (``not_attending``: the names of
    those whose packed passes do not) attending per row."""
    if not pack:
        return "this trainer's passes are padded (padding_free=False, or a model that cannot pack)"
    if encoder_decoder:
        return "the policy is an encoder-decoder"
    if cut:
        return "sequence parallelism (sequence_parallel_size > 1) is not supported with it yet"
    if not_attending:
        return (f"the packed passes of the {' and the '.join(not_attending)} do not attend per row (an sdpa "
                "transformers model whose forward passes extra keywords on)")  # fmt: skip
    return None


class PrefixSharing:
    """The one decision of prefix sharing for a trainer: built once from what its passes can do, then asked by
    every step (:meth:`rows`: does this step share?) and every pass (:meth:`shares`, :meth:`inputs`,
    :meth:`units`, :meth:`run_tokens`), and by the learner's epoch order (:meth:`epoch_prompts`).

    Args:
        setting: ``PPOConfig.prefix_sharing`` (None: automatic, see :meth:`estimated_saving`).
        why_not: None when the trainer's passes can share prompts (packed, decoder-only, no sequence parallelism,
            every model's packed passes attending per row), else why not: ``True`` is then a ValueError.
        dropout: whether a trained model has a dropout above 0 (``disable_dropout=False``): its training passes (in
            train mode) would draw one dropout mask for the prompt a group shares, where the unshared rows draw
            one each - the same expected gradient, not the same noise. Automatic: the training passes do not share
            (the rollout's, in eval mode, still may); ``True``: they share, with one warning.
        schedule: the step's :class:`Schedule` (for the automatic rule and the epoch order).
    """

    def __init__(self, setting: bool | None, why_not: str | None = None, dropout: bool = False,
                 schedule: Schedule | None = None):  # fmt: skip
        if setting is True and why_not is not None:
            raise ValueError(f"prefix_sharing=True needs passes that can share a prompt, but {why_not}. "
                             "Use prefix_sharing=None or False.")  # fmt: skip
        if setting is True and dropout:
            warnings.warn(
                "prefix_sharing=True with dropout in a trained model (disable_dropout=False): the responses of a group "
                "share one dropout mask over their prompt in the training passes, where unshared rows draw one each. "
                "The expected update is the same, its noise is not; set disable_dropout=True (or prefix_sharing=None, "
                "which does not share training passes under dropout) for the unshared step's numbers.",
                stacklevel=3,
            )
        self.setting = setting
        self.why_not = why_not
        self.on = setting is not False and why_not is None  # whether any step may share
        self.training = self.on and (setting is True or not dropout)  # whether training passes may share
        self.schedule = schedule or Schedule(1, 1)
        self.tokens = [0, 0]  # prompt tokens saved, tokens without sharing: since the last take_saving()

    @property
    def looks(self) -> bool:
        """Whether a step looks for rows with equal queries (:func:`prompt_ids`): to share them, or to keep them
        together in the epoch order (``shuffle_by_prompt=True``)."""
        return self.on or self.schedule.shuffle_by_prompt is True

    # ------------------------------------------------------------------------------------------
    # A step
    # ------------------------------------------------------------------------------------------
    def rows(self, rows: Rows, prompts, budget: int | None = None) -> Rows:
        """``rows`` with their prompt ids (``prompts``: the ids, or the queries to find them in) when this step
        shares prompts: ``True``, or None and :meth:`estimated_saving` of the passes it will run (under the token
        ``budget``) reaches :data:`AUTOMATIC_SAVING`."""
        if not self.on:
            return rows
        ids = prompts if isinstance(prompts, tuple) else prompt_ids(prompts)
        if ids == tuple(range(len(rows))):
            return rows
        if self.setting is None and self.estimated_saving(rows, ids, budget) < AUTOMATIC_SAVING:
            return rows
        return dataclasses.replace(rows, prompt_ids=ids)

    def epoch_prompts(self, rows: Rows, prompts: tuple | None) -> tuple | None:
        """The prompt ids the learner's epoch order keeps together (:func:`epoch_order`), or None: a row shuffle.
        ``shuffle_by_prompt`` True or False as given; None: by prompt where this step's training passes share
        (``rows`` carry prompt ids) and the estimator is one of groups."""
        by_prompt = self.schedule.shuffle_by_prompt
        if by_prompt is None:
            by_prompt = self.training and rows.prompt_ids is not None and self.schedule.group_estimator
        return prompts if by_prompt else None

    def estimated_saving(self, rows: Rows, ids: tuple, budget: int | None = None) -> float:
        """The share of the step's pass tokens that sharing would not run, over the passes the step will run with
        sharing on: the rollout's (``mini_batch_size`` rows in batch order, or the split by ``budget``), once per
        model pass, and - where training passes share (else they do not count) - each epoch's training passes (weighted
        :data:`TRAINING_WEIGHT`: forward and backward) in the epoch order sharing gives them: groups whole
        (:meth:`epoch_prompts`), else a row shuffle, whose saving is averaged over :data:`ESTIMATE_DRAWS` shuffles
        from a generator of its own (torch's global one is not touched: the run's random stream stays as it is)."""
        schedule, shared = self.schedule, dataclasses.replace(rows, prompt_ids=ids)
        costs = [rows.tokens(i) for i in range(len(rows))]
        rollout = self._passes(shared, list(range(len(rows))), schedule.mini_batch_size, costs, budget)
        saved = schedule.rollout_models * sum(saved_tokens(rows, p, ids) for p in rollout)
        total = schedule.rollout_models * sum(costs)
        if not self.training:  # the training passes run unshared whatever the rule says: only the rollout's count
            return saved / total if total else 0.0
        if self.epoch_prompts(shared, ids) is not None:
            orders = [[i for g in _members(ids).values() for i in g]]  # the groups' order does not change the split much
        else:
            generator = torch.Generator().manual_seed(0)
            orders = [torch.randperm(len(rows), generator=generator).tolist() for _ in range(ESTIMATE_DRAWS)]
        size, trained = schedule.backward_batch_size, 0.0
        for order in orders:
            for start in range(0, len(order), size):
                for p in self._passes(shared, order[start : start + size], schedule.mini_batch_size, costs, budget):
                    trained += saved_tokens(rows, p, ids)
        weight = TRAINING_WEIGHT * schedule.epochs
        return (saved + weight * trained / len(orders)) / (total + weight * sum(costs))

    def _passes(self, rows: Rows, group: list[int], size: int, costs: list[int], budget: int | None) -> list:
        """The passes over rows ``group``: runs of ``size`` rows, or their split by ``budget`` (prompts shared)."""
        if budget is None:
            return [group[start : start + size] for start in range(0, len(group), size)]
        units, unit_costs = self.units(group, costs, rows, budget, training=False)
        return units_passes(split_by_tokens(unit_costs, budget), units, group)

    # ------------------------------------------------------------------------------------------
    # A pass
    # ------------------------------------------------------------------------------------------
    def shares(self, rows: Rows | None, training: bool = False) -> bool:
        """Whether a pass over ``rows`` lays out the prompts its rows share once: this step shares (its rows carry
        prompt ids) and, for a ``training`` pass (train mode: dropout active), training passes may."""
        return rows is not None and rows.prompt_ids is not None and (self.training or not training)

    def run_tokens(self, rows: Rows, index: list[int], training: bool = False, costs: list[int] | None = None) -> int:
        """The tokens a pass over rows ``index`` runs: each row's ``costs[i]`` (default its prompt + response), less
        the prompts it runs once (:meth:`shares`). What the back-off counts and halves (docs/out_of_memory.md)."""
        tokens = sum(rows.tokens(i) if costs is None else costs[i] for i in index)
        return tokens - saved_tokens(rows, index, rows.prompt_ids) if self.shares(rows, training) else tokens

    def inputs(self, rows: Rows, index: list[int], training: bool, device):
        """The shared layout of the pass over rows ``index`` (:func:`shared_inputs` less ``saved``), or None: the
        pass takes its own layout (:meth:`shares`). Counts the pass's tokens either way."""
        self.tokens[1] += sum(rows.tokens(i) for i in index)
        if not self.shares(rows, training):
            return None
        *inputs, saved = shared_inputs(rows, index, device)
        self.tokens[0] += saved
        return inputs

    def units(self, group: list[int], costs: list[int], rows: Rows | None, budget: int, passes: int = 1,
              training: bool = False) -> tuple:  # fmt: skip
        """Rows ``group`` in the units a token-budget split keeps in one pass, and their costs: the rows of one
        prompt in runs whose cost with the prompt counted once fits ``budget`` (what the shared layout runs),
        every other row alone at ``costs[i]`` (its prompt + response tokens, PTX included). Each row alone
        when the passes over ``rows`` do not share prompts (:meth:`shares`), or when that gives fewer units than
        ``passes`` (the pass count another process needs, see :meth:`~.forward.ForwardPass.split`: rows one by one
        always do)."""
        alone = [[i] for i in group], [costs[i] for i in group]
        if not self.shares(rows, training):
            return alone
        units, unit_costs, last = [], [], {}  # last: per prompt, its newest unit
        for i in group:
            u, extra = last.get(rows.prompt_ids[i]), costs[i] - len(rows.queries[i])
            if u is not None and unit_costs[u] + extra <= budget:
                units[u].append(i)
                unit_costs[u] += extra
            else:
                last[rows.prompt_ids[i]] = len(units)
                units.append([i])
                unit_costs.append(costs[i])
        return (units, unit_costs) if len(units) >= passes else alone

    def take_saving(self, accelerator=None) -> float:
        """The share of tokens the passes since the last call did not run thanks to shared prompts
        (``prefix_sharing/tokens_saved_fraction``), over every process of ``accelerator`` when given (each
        counts its own rows; the statistic is the run's, the same on all); the count starts again."""
        saved, total = self.tokens
        self.tokens = [0, 0]
        if not self.on:  # the same setting on every process: nothing saved anywhere, no collective
            return 0.0
        if accelerator is not None and accelerator.num_processes > 1:
            counts = torch.tensor([saved, total], dtype=torch.float64, device=accelerator.device)
            saved, total = accelerator.reduce(counts, reduction="sum").tolist()
        return saved / total if total else 0.0


def _members(ids: tuple) -> dict:
    """Per prompt id, its rows in batch order."""
    members = {}
    for i, prompt in enumerate(ids):
        members.setdefault(prompt, []).append(i)
    return members


def shared_inputs(rows: Rows, index: list[int], device):
    """:meth:`~.rows.InputLayout.packed` of rows ``index`` (decoder-only) with shared prompts, plus the
    :class:`~trl_lite.models.shared_prefix_attention.SharedRows` of the pass and the prompt tokens saved.

    Returns ``(inputs, positions (b, L_mb), slots, targets (N,), L_mb, attention_rows, saved)``: ``inputs`` holds
    ``input_ids``/``position_ids`` ``(1, N_total)`` and ``logits_positions``. Segments follow the first
    appearance of each prompt in ``index``; the compact rows stay in the order of ``index``.
    """
    ids, members = rows.prompt_ids, {}
    for j, i in enumerate(index):
        members.setdefault(ids[i], []).append(j)
    pieces, positions_host, groups = [], [], []  # positions_host: host ints
    first, response_start = [0] * len(index), [0] * len(index)
    start = 0
    for group in members.values():
        query = rows.queries[index[group[0]]]
        if len(group) == 1:  # a row of its own: its whole sequence is one causal segment
            j = group[0]
            pieces.append(rows.sequences[index[j]])
            length = len(pieces[-1])
            positions_host += range(length)
            first[j] = response_start[j] = start + len(query) - 1
            response_start[j] += 1
            groups.append((length, ()))
            start += length
            continue
        prompt = len(query)
        pieces.append(query)
        positions_host += range(prompt)
        offset = start + prompt
        for j in group:
            response = rows.responses[index[j]]
            pieces.append(response)
            positions_host += range(prompt, prompt + len(response))
            first[j], response_start[j] = start + prompt - 1, offset
            offset += len(response)
        groups.append((prompt, tuple(len(rows.responses[index[j]]) for j in group)))
        start = offset
    total = start
    input_ids = torch.cat(pieces).unsqueeze(0)
    position_ids = to_device(positions_host, device).unsqueeze(0)
    width = rows.width(index)
    k = torch.arange(width, device=device)
    # Slot 0 reads the prompt's last token; slot k > 0 the response's token k - 1. Past the response the
    # compact layout is padding (masked): any position in range does.
    later = to_device([s - 1 for s in response_start], device).unsqueeze(1) + k
    positions = torch.where(k == 0, to_device(first, device).unsqueeze(1), later).clamp(max=total - 1)
    slots = token_slots(rows, index, width, device)
    token_positions = positions[slots]
    targets = torch.cat([rows.responses[i][: min(rows.slot_count(i), width)] for i in index])
    inputs = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "logits_positions": (torch.zeros_like(token_positions), token_positions),
    }
    saved = sum(rows.tokens(i) for i in index) - total
    return inputs, positions, slots, targets, width, shared_rows(groups, device), saved



def units_passes(split: list[list[int]], units: list[list[int]], group: list[int]) -> list[list[int]]:
    """The passes of :func:`~.token_budget.split_by_tokens` over ``units`` (of :meth:`PrefixSharing.units`) as row
    numbers, each pass's rows in their order in ``group``."""
    order = {i: n for n, i in enumerate(group)}
    return [sorted((i for u in part for i in units[u]), key=order.get) for part in split]
