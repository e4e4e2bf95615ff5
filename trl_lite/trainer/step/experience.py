"""The data of one PPO step: the batch the user hands to ``step()``, the :class:`Experience` the
experience maker builds from it, and the :class:`Minibatch` views the learner trains on.

Every per-token tensor is in the compact layout of :mod:`.rows`: ``(B, L)``, column ``k`` predicting
response token ``k + shift``, zero outside the action mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout.rows import Rows, to_device


@dataclass(frozen=True)
class StepBatch:
    """What ``step()`` was given, checked: per row a query, a response and a score (B of each).

    ``response_masks``: per row 0/1 like the response, or None; ``groups``: ``(B,)`` group ids of
    'rloo'/'grpo' (None otherwise); ``generation_logprobs``: per row the engine's log-prob of each
    response token, or None; ``ptx_inputs``: per row a token sequence for the PTX loss, or None;
    ``staleness (B,)``: per row, the policy updates (``step()`` calls) since its generation, or None;
    ``num_groups``: how many groups ``groups`` names (its ids are dense in ``[0, num_groups)``), a host int;
    ``actions``: per row its action tokens (host ints, from the input checks), or None (then counted on the host
    before the batch's copy); ``kept_sets``: under truncated sampling per row the kept sets its sampler recorded
    (a one-row :class:`~trl_lite.core.kept_sets.KeptSets`) or None (re-derived), or None for every row.
    """

    queries: list
    responses: list
    scores: list
    response_masks: list | None = None
    groups: torch.Tensor | None = None
    generation_logprobs: list | None = None
    ptx_inputs: list | None = None
    staleness: torch.Tensor | None = None
    num_groups: int | None = None
    actions: tuple | None = None
    kept_sets: list | None = None


@dataclass(frozen=True)
class Experience:
    """Everything the learner needs from one step's rollout, built once by the experience maker.

    ``rows``: tokens, masks and layout; ``scores (B,)``: the shaped scores (docs/algorithm.md sections 2
    and 14); ``ends_with_eos (B,)`` bool or None (no EOS id known); ``groups (B,)`` or None;
    ``logprobs``, ``ref_logprobs``, ``kls``, ``rewards``, ``non_score_reward``, ``advantages``: ``(B, L)``;
    ``logprobs`` (and ``kls``) None when the policy's rollout pass did not run (the learner's training forwards
    give ``lp_old``, :class:`~.rollout_plan.RolloutPlan`), ``ref_logprobs`` and ``kls`` None when the
    reference's did not (the KL is not measured); ``generation``: the engine's log-probs ``lp_gen`` ``(B, L)``
    or None, kept for the learner's TIS weights when ``logprobs`` is None;
    ``values``, ``returns``: ``(B, L)``, None for critic-free estimators; ``token_weights``: the TIS
    weights ``(B, L)`` or None (section 15); ``kl_coef``: the KL coefficient of this step (in the reward or
    in the loss); ``kl_in_loss``: whether the learner adds ``kl_coef * k3`` to the policy loss (then it
    uses ``ref_logprobs``); ``ptx``: per row the PTX token sequence on the device, or None; ``staleness``:
    as in :class:`StepBatch`;
    ``gap_stats``: the ``rollout/*`` log-prob gap statistics; ``timings``: each phase's ``(start, end)`` marks
    (:class:`~.timing.StepClock`);
    ``num_groups`` and ``actions``: as in :class:`StepBatch` (host numbers: read without a device sync);
    ``prompts``: the rows' :func:`~.prefix_sharing.prompt_ids` (host ints) whose groups the learner's epoch shuffle
    keeps together (:func:`~.prefix_sharing.epoch_order`) - ``shuffle_by_prompt`` True, or None and this step's
    training passes share (:meth:`~.prefix_sharing.PrefixSharing.epoch_prompts`) - else None.
    """

    rows: Rows
    scores: torch.Tensor
    ends_with_eos: torch.Tensor | None
    groups: torch.Tensor | None
    logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    returns: torch.Tensor | None
    kls: torch.Tensor | None
    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor | None
    kl_coef: float
    kl_in_loss: bool
    ptx: list | None = None
    staleness: torch.Tensor | None = None
    generation: torch.Tensor | None = None
    gap_stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    num_groups: int | None = None
    actions: tuple | None = None
    prompts: tuple | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def action_mask(self) -> torch.Tensor:
        return self.rows.action_mask

    def minibatch(self, indices: list[int]) -> Minibatch:
        """The rows ``indices`` (a host list of row numbers) cut to their own compact width ``L_mb``."""
        index = list(indices)
        idx = to_device(index, self.advantages.device)
        width = self.rows.width(index)

        def cut(x):
            return None if x is None else x[idx, :width]

        return Minibatch(
            index=index,
            idx=idx,
            width=width,
            mask=cut(self.rows.action_mask),
            old_logprobs=cut(self.logprobs),
            old_values=cut(self.values),
            advantages=cut(self.advantages),
            returns=cut(self.returns),
            ref_logprobs=cut(self.ref_logprobs) if self.kl_in_loss else None,
            token_weights=cut(self.token_weights),
            generation=cut(self.generation) if self.logprobs is None else None,
            ptx=[self.ptx[i] for i in index] if self.ptx is not None else None,
        )


@dataclass(frozen=True)
class Minibatch:
    """Rows ``index`` of an :class:`Experience` (``idx``: the same on the device), every tensor ``(b, L_mb)``.

    ``old_values``/``returns`` are None for critic-free estimators, ``ref_logprobs`` when the KL is in
    the reward (or not measured), ``token_weights`` without TIS or when ``old_logprobs`` is None (no policy
    pass: the training forward gives them, and ``generation`` holds ``lp_gen`` for the TIS weights), ``ptx``
    without PTX.
    """

    index: list
    idx: torch.Tensor
    width: int
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    token_weights: torch.Tensor | None
    generation: torch.Tensor | None
    ptx: list | None


def scores_tensor(scores, device) -> torch.Tensor:
    """A list of B scalars (numbers or 0-d tensors), or a ``(B,)`` tensor, as a float32 ``(B,)`` tensor on ``device``."""
    if isinstance(scores, torch.Tensor):
        return scores.to(device=device, dtype=torch.float32).reshape(-1)
    return torch.stack([torch.as_tensor(s, dtype=torch.float32).to(device).reshape(()) for s in scores])
