"""Prefix sharing: the packed layout that runs a prompt once for all the rows of a pass that share it.

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

import torch

from ...models.shared_prefix_attention import shared_rows
from ..layout.rows import Rows, to_device, token_slots

#: The automatic rule's threshold: sharing is on for a step when it saves at least this share of its tokens.
AUTOMATIC_SAVING = 0.25


def check_sharing(prefix_sharing, pack: bool, cut: bool, policy, row_attention: dict) -> None:
    """``prefix_sharing=True`` needs packed passes whose policy attends per row, not ``cut`` over a
    sequence-parallel group."""
    if prefix_sharing is not True:
        return
    if not pack:
        raise ValueError("prefix_sharing=True needs packed passes, but this trainer's passes are padded "
                         "(padding_free=False, or a model that cannot pack). Use prefix_sharing=None or False.")
    if cut:
        raise ValueError("prefix_sharing=True is not supported with sequence parallelism (sequence_parallel_size > 1) "
                         "yet. Use prefix_sharing=None or False.")
    if id(policy) not in row_attention:
        raise ValueError("prefix_sharing=True needs a policy whose packed passes attend per row (an sdpa "
                         "transformers model whose forward passes extra keywords on). Use prefix_sharing=None or False.")


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
    their order in the batch. It depends on the query tokens alone, never on ``prefix_sharing``, so the
    mini-batches are the same with sharing on and off.
    """
    if prompts is None:
        return torch.randperm(rows).tolist()
    members = {}
    for i, prompt in enumerate(prompts):
        members.setdefault(prompt, []).append(i)
    groups = list(members.values())
    return [i for g in torch.randperm(len(groups)).tolist() for i in groups[g]]


def saved_tokens(rows: Rows, index: list[int], ids: tuple) -> int:
    """Prompt tokens a pass over rows ``index`` does not run again with the shared layout (host ints)."""
    seen, saved = set(), 0
    for i in index:
        if ids[i] in seen:
            saved += len(rows.queries[i])
        seen.add(ids[i])
    return saved


def automatic(rows: Rows, ids: tuple) -> bool:
    """The automatic rule (``prefix_sharing=None``): share when the step's groups would save at least
    :data:`AUTOMATIC_SAVING` of its tokens. Below that the extra attention calls of the shared layout
    (a prompt and each response apart) cost about what the repeated prompt tokens cost."""
    everything = list(range(len(rows)))
    total = sum(rows.tokens(i) for i in everything)
    return saved_tokens(rows, everything, ids) >= AUTOMATIC_SAVING * total


def with_prompt_ids(rows: Rows, prompts, prefix_sharing: bool | None) -> Rows:
    """``rows`` with their prompt ids (``prompts``: the ids, or the queries to find them in) when the step's
    packed passes share prompts: ``prefix_sharing`` True, or None and :func:`automatic` finds it worth it."""
    ids = prompts if isinstance(prompts, tuple) else prompt_ids(prompts)
    if ids == tuple(range(len(rows))) or (prefix_sharing is None and not automatic(rows, ids)):
        return rows
    return dataclasses.replace(rows, prompt_ids=ids)


class PrefixSharing:
    """The prefix sharing of a :class:`~.forward.ForwardPass`: which steps' passes share prompts, their
    layout, and the count of the tokens that saved (``prefix_sharing/tokens_saved_fraction``).

    Args:
        setting: ``PPOConfig.prefix_sharing`` (None: automatic, see :func:`automatic`).
        possible: whether the trainer's passes can share prompts: packed, decoder-only, no sequence parallelism.
    """

    def __init__(self, setting: bool | None, possible: bool):
        self.setting = setting
        self.shares_prompts = setting is not False and possible
        self.tokens = [0, 0]  # prompt tokens saved, tokens without sharing: since the last take_saving()
        # Whether every model's packed passes attend per row, so every pass shares (set by ForwardPass.build):
        # only then may a token budget count a prompt once (:meth:`units`).
        self.in_budget = False

    def rows(self, rows: Rows, prompts) -> Rows:
        """``rows`` with their prompt ids when this step shares prompts (see :func:`with_prompt_ids`)."""
        return with_prompt_ids(rows, prompts, self.setting) if self.shares_prompts else rows

    def inputs(self, rows: Rows, index: list[int], attends: bool, device):
        """The shared layout of the pass over rows ``index`` (:func:`shared_inputs` less ``saved``), or None: the
        pass takes its own layout. ``attends``: the pass is packed and its models attend per row. Counts the
        pass's tokens either way."""
        self.tokens[1] += sum(rows.tokens(i) for i in index)
        if not attends or rows.prompt_ids is None:
            return None
        *inputs, saved = shared_inputs(rows, index, device)
        self.tokens[0] += saved
        return inputs

    def units(self, group: list[int], costs: list[int], rows: Rows | None, budget: int, passes: int = 1) -> tuple:
        """Rows ``group`` in the units a token-budget split keeps in one pass, and their costs: the rows of one
        prompt in runs whose cost with the prompt counted once fits ``budget`` (what the shared layout runs),
        every other row alone at ``costs[i]`` (its prompt + response tokens, PTX included). Each row alone
        when the passes of ``rows`` do not share prompts, or when that gives fewer units than ``passes`` (the
        pass count another process needs, see :meth:`~.forward.ForwardPass.split`: rows one by one always do)."""
        alone = [[i] for i in group], [costs[i] for i in group]
        if rows is None or rows.prompt_ids is None or not self.in_budget:
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
        if not self.shares_prompts:  # the same setting on every process: nothing saved anywhere, no collective
            return 0.0
        if accelerator is not None and accelerator.num_processes > 1:
            counts = torch.tensor([saved, total], dtype=torch.float64, device=accelerator.device)
            saved, total = accelerator.reduce(counts, reduction="sum").tolist()
        return saved / total if total else 0.0


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
