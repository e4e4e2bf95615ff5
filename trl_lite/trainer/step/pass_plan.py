"""The forward/backward passes of each backward batch of an epoch, and what each pass's losses divide by
(docs/algorithm.md sections 6, 13 and 18).

Without a token budget a backward batch is ``gradient_accumulation_steps`` mini-batches of
``mini_batch_size`` rows and accelerate's accumulation places the optimizer step. With
``max_tokens_per_minibatch`` its rows go into passes of the budget (:meth:`ForwardPass.split`) and each
pass's losses are its share of the backward batch's: every sum is divided by a count of the whole
backward batch (:class:`Denominators`), so the shares add up to the same loss whatever the split.
After an out-of-memory back-off in a run without a budget (:mod:`.oom_backoff`), each mini-batch is split
by the backed-off budget and each piece's losses are its share of its mini-batch's: the classic
definitions (each mini-batch its own mean) stay, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout.rows import to_device

# Statistics that are a pass's share of its backward batch's loss under a token budget: summed over the passes.
LOSS_STATS = ("loss/policy", "loss/value", "loss/total", "loss/ptx", "policy/kl_loss", "policy/entropy_loss")


@dataclass(frozen=True)
class Denominators:
    """What each loss of a pass divides its sum by: counts of the pass's whole backward batch.

    ``policy``: for the policy's terms (clipped surrogate, KL in the loss, entropy bonus), by
    ``loss_type``; ``value``: the action tokens (value loss); ``ptx``: the PTX tokens that are predicted
    (None without PTX inputs). A count of zero is taken as one: the sums it divides are zero too.
    ``actions``: the backward batch's action tokens on this process (0 when it has none).
    """

    policy: float
    value: float
    ptx: float | None
    actions: float


@dataclass(frozen=True)
class PassPlan:
    """The passes of one backward batch.

    ``passes``: per pass, row numbers of the experience; ``tokens``: per pass, the prompt+response tokens
    (and PTX tokens) it runs (a prompt its rows share counted once where the pass shares it); ``tokens_per_minibatch``: without a budget, the ``global_token_mean`` count of every
    mini-batch of the backward batch (None for other loss types); ``denominators``: with a budget, the
    backward batch's :class:`Denominators` (None without: each mini-batch is its own mean);
    ``actions``: with a budget, per pass its action tokens (host numbers, for the statistics).
    ``pieces``: after a back-off from no budget, per pass the mini-batch (0, 1, ... of the backward batch)
    it is a piece of; ``denominators`` is then the list of the mini-batches' :class:`Denominators`.
    """

    passes: list
    tokens: list
    tokens_per_minibatch: torch.Tensor | None = None
    denominators: Denominators | list | None = None
    actions: list | None = None
    pieces: list | None = None

    @property
    def by_tokens(self) -> bool:
        """Whether the passes come from a token budget (the learner then places the accumulation boundary)."""
        return self.denominators is not None

    def shares(self, j: int) -> Denominators | None:
        """The :class:`Denominators` pass ``j``'s losses divide by (None without a budget)."""
        return self.denominators if self.pieces is None else self.denominators[self.pieces[j]]

    def unit(self, j: int) -> int:
        """Which statistics pass ``j``'s join: one per backward batch under a budget, one per mini-batch for pieces."""
        return 0 if self.pieces is None else self.pieces[j]


def row_costs(experience) -> list[int]:
    """Per row of ``experience``, the tokens a pass holds for it: prompt + response, and its PTX sequence."""
    rows, ptx = experience.rows, experience.ptx
    return [rows.tokens(i) + (len(ptx[i]) if ptx is not None else 0) for i in range(len(rows))]


def run_tokens(forward, experience, passes: list, costs: list[int]) -> list[int]:
    """Per training pass, the tokens it runs: its rows' ``costs``, a prompt they share counted once where the
    pass shares it (:meth:`~.prefix_sharing.PrefixSharing.run_tokens`): what the back-off halves."""
    return [forward.prefix.run_tokens(experience.rows, p, True, costs) for p in passes]


def plan_epoch(config, accelerator, forward, objective, experience, order: list[int]) -> list[PassPlan]:
    """The :class:`PassPlan` of each backward batch of one epoch's row ``order``.

    At most two collectives per epoch: the action tokens of every process (``global_token_mean``) and,
    with a budget and several processes, the pass counts (see :meth:`ForwardPass.split`). The budget is
    ``forward.max_tokens``: the configured one, or what an out-of-memory back-off left.
    """
    size = config.backward_batch_size
    groups = [order[start : start + size] for start in range(0, len(order), size)]
    costs = row_costs(experience)
    if forward.max_tokens is None:
        per_minibatch = classic_tokens_per_minibatch(config, accelerator, objective, experience, order)
        step = config.mini_batch_size
        plans = []
        for b, group in enumerate(groups):
            passes = [group[start : start + step] for start in range(0, len(group), step)]
            count = None if per_minibatch is None else per_minibatch[b]
            plans.append(PassPlan(passes, run_tokens(forward, experience, passes, costs), count))
        return plans
    # Host numbers from step()'s input checks: planning the passes reads nothing from the device.
    actions = experience.actions
    if config.max_tokens_per_minibatch is None:
        return minibatch_pieces(config, accelerator, forward, objective, experience, order, groups, actions)
    denominators = backward_batch_denominators(config, accelerator, objective, experience, groups, actions)
    splits = forward.split(groups, costs, rows=experience.rows, training=True)
    return [
        PassPlan(passes, run_tokens(forward, experience, passes, costs), None, d, [sum(actions[i] for i in p) for p in passes])
        for passes, d in zip(splits, denominators)
    ]  # fmt: skip


def classic_tokens_per_minibatch(config, accelerator, objective, experience, order) -> torch.Tensor | None:
    """For ``global_token_mean`` without a budget: per backward batch of ``order``, the action tokens of that
    backward batch on all processes divided by the mini-batches averaged into its update (gradient
    accumulation steps x processes); None for the other loss types. One collective.

    accelerate divides each mini-batch's loss by the accumulation steps and DDP (or DeepSpeed)
    averages gradients over processes, so dividing each mini-batch's token sum by this number makes
    the update ``sum M l / N`` over the whole backward batch, whatever its split.
    """
    if not objective.needs_global_token_count:
        return None
    mask = experience.action_mask[to_device(order, experience.action_mask.device)]
    counts = torch.stack([part.sum() for part in mask.split(config.backward_batch_size)])
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    return counts / (config.gradient_accumulation_steps * accelerator.num_processes)


def backward_batch_denominators(config, accelerator, objective, experience, groups, actions) -> list[Denominators]:
    """The :class:`Denominators` of each backward batch ``groups[b]`` (row numbers) (docs/algorithm.md
    section 18). ``actions``: per row its action tokens (host numbers)."""
    all_tokens = [sum(actions[i] for i in g) for g in groups]
    if objective.needs_global_token_count and accelerator.num_processes > 1:
        reduced = accelerator.reduce(torch.tensor(all_tokens, device=accelerator.device), reduction="sum")
        all_tokens = reduced.tolist()
    # global_token_mean: DDP and DeepSpeed average the processes' gradients, hence the process count.
    return [
        group_denominators(objective, experience, group, actions, max(n, 1) / accelerator.num_processes)
        for group, n in zip(groups, all_tokens)
    ]  # fmt: skip


def group_denominators(objective, experience, group, actions, global_count: float) -> Denominators:
    """The :class:`Denominators` of the rows ``group`` taken as one batch: their action tokens, rows with an
    action token or ``rows * max_response_length`` by ``loss_type``; ``global_count`` for ``global_token_mean``."""
    tokens = sum(actions[i] for i in group)
    if objective.loss_type == "token_mean":
        policy = max(tokens, 1)
    elif objective.loss_type == "seq_mean_token_mean":
        policy = max(len(group) if objective.seq_mean_all_rows else sum(actions[i] > 0 for i in group), 1)
    elif objective.loss_type == "seq_mean_token_sum_norm":
        policy = len(group) * objective.max_response_length
    else:
        policy = global_count
    ptx = None if experience.ptx is None else float(max(sum(len(experience.ptx[i]) - 1 for i in group), 1))
    return Denominators(float(policy), float(max(tokens, 1)), ptx, float(tokens))


def minibatch_pieces(config, accelerator, forward, objective, experience, order, groups, actions) -> list[PassPlan]:
    """The plans of a run without a budget after an out-of-memory back-off: each mini-batch of ``mini_batch_size``
    rows split by the backed-off budget (one collective for the pass counts), each piece's losses its share
    of its mini-batch's - the classic definitions, whatever the split (docs/algorithm.md section 18);
    ``global_token_mean`` keeps its count of :func:`classic_tokens_per_minibatch`."""
    step, costs = config.mini_batch_size, row_costs(experience)
    minibatches = [[group[start : start + step] for start in range(0, len(group), step)] for group in groups]
    pieces = iter(forward.split([mb for mbs in minibatches for mb in mbs], costs, rows=experience.rows, training=True))
    per_minibatch = classic_tokens_per_minibatch(config, accelerator, objective, experience, order)
    counts = [1.0] * len(groups) if per_minibatch is None else per_minibatch.tolist()
    plans = []
    for mbs, count in zip(minibatches, counts):
        passes, owner = [], []
        for m, split in zip(range(len(mbs)), pieces):
            passes += split
            owner += [m] * len(split)
        shares = [group_denominators(objective, experience, mb, actions, count or 1.0) for mb in mbs]
        tokens = run_tokens(forward, experience, passes, costs)
        plans.append(PassPlan(passes, tokens, None, shares, [sum(actions[i] for i in p) for p in passes], owner))
    return plans


def combine_pass_stats(parts: list[tuple[dict, float]]) -> dict | None:
    """One backward batch's statistics from those of its passes under a budget: ``parts`` is per trained pass
    its statistics and action tokens. The loss shares (:data:`LOSS_STATS`) add up to the backward batch's
    losses; every other statistic, a masked mean over a pass, is averaged weighted by the action tokens, the
    mean over the backward batch's tokens; a variance (``X/var`` beside ``X/mean``) is pooled from the
    passes' means and variances into the backward batch's own, so no statistic depends on the split. None
    when no pass has an action token (no statistic has a value)."""
    weighted = [(stats, n) for stats, n in parts if n > 0]
    if not weighted:
        return None
    total = sum(n for _, n in weighted)
    combined = {}
    for key in weighted[0][0]:
        if key in LOSS_STATS:
            combined[key] = torch.stack([stats[key] for stats, _ in parts]).sum()
        else:
            combined[key] = sum(stats[key] * (n / total) for stats, n in weighted)
    for key in [k for k in combined if k.endswith("/var") and k[: -len("var")] + "mean" in combined]:
        mean_key = key[: -len("var")] + "mean"
        # Squared deviations of each pass about its own mean (masked_var is Bessel-corrected, 0 for one token),
        # plus each pass's offset from the pooled mean: the backward batch's sum of squares.
        squares = sum(
            stats[key] * max(n - 1, 1) + n * (stats[mean_key] - combined[mean_key]) ** 2 for stats, n in weighted
        )
        combined[key] = squares / max(total - 1, 1)
    return combined
