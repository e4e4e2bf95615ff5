"""Critic-free advantages of docs/algorithm.md section 12: RLOO, GRPO, REINFORCE++ returns, and the k3
KL estimate the loss takes when the KL penalty is not in the reward.

Groups are given as ``group_ids (B,)``: integer ids, rows with equal ids form one group (rows of a
group answer one query). Ids need not be contiguous or sorted.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("gae", "rloo", "grpo", "reinforce_pp")
# Added to a group's standard deviation before dividing by it (GRPO).
GRPO_EPS = 1e-6


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the sum of ``values`` over its group and the group's size. Shape: ``(B,)`` twice -> ``(B,)`` twice.

    ``num_groups``: with ids dense in ``[0, num_groups)`` (as the trainer gives them) the sums are taken
    in place, nothing read back; None: ids of any values, made dense with ``torch.unique`` (on a GPU a
    host sync for the unique ids and one for their count).
    """
    index = group_ids
    if num_groups is None:
        _, index = torch.unique(group_ids, return_inverse=True)
        num_groups = int(index.max()) + 1 if index.numel() else 0
    sums = values.new_zeros(num_groups).index_add_(0, index, values)
    counts = values.new_zeros(num_groups).index_add_(0, index, torch.ones_like(values))
    return sums[index], counts[index]


def _scored(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None):
    """Where ``rewards`` is not NaN (an unscored row), the rewards with 0 there, and per row its group's sum
    and count of the scored rows. Shapes ``(B,)``."""
    scored = ~torch.isnan(rewards)
    values = torch.where(scored, rewards, torch.zeros_like(rewards))
    sums, _ = _group_sums(values, group_ids, num_groups)
    counts, _ = _group_sums(scored.to(rewards.dtype), group_ids, num_groups)
    return scored, values, sums, counts


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j in G(i), j != i} r_j``.

    A NaN reward is an unscored row (TRL's ``None`` reward): it is left out of its siblings' baselines
    and its advantage is 0, as is that of the one scored row of a group (no sibling to compare with).
    Shape: rewards and group_ids ``(B,)`` -> ``(B,)``. ``num_groups``: see :func:`_group_sums`.
    """
    scored, values, sums, counts = _scored(rewards, group_ids, num_groups)
    advantages = values - (sums - values) / (counts - 1)
    return torch.where(scored & (counts > 1), advantages, torch.zeros_like(advantages))


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_rewards: bool = True, eps: float = GRPO_EPS,
    num_groups: int | None = None,
) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_G r) / (std_G r + eps)``, the unbiased std of the group; without
    ``scale_rewards`` only the group mean is subtracted.

    A NaN reward is an unscored row (TRL's ``None`` reward): the mean and std are those of the group's scored
    rows, and its advantage is 0, as are those of a group with one scored row when scaled (no spread to
    measure; TRL's NaN std). Shape: ``(B,)`` twice -> ``(B,)``. ``num_groups``: see :func:`_group_sums`.
    """
    if num_groups is None:  # made dense once, for every sum
        _, group_ids = torch.unique(group_ids, return_inverse=True)
        num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    scored, values, sums, counts = _scored(rewards, group_ids, num_groups)
    centred = torch.where(scored, values - sums / counts.clamp(min=1), torch.zeros_like(values))
    if not scale_rewards:
        return centred
    squares, _ = _group_sums(centred**2, group_ids, num_groups)
    scaled = centred / ((squares / (counts - 1)).sqrt() + eps)
    return torch.where(counts > 1, scaled, torch.zeros_like(scaled))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns before whitening: ``R_t = sum_{s >= t} gamma^(s-t) r_s`` along each row.

    Rewards outside the mask count as 0. Shape: rewards and mask ``(B, L)`` -> ``(B, L)``, zero
    outside the mask.
    """
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def sequence_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row given to every action token of the row. Shape: ``(B,)``, ``(B, L)`` -> ``(B, L)``."""
    return advantages.unsqueeze(-1) * mask


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token: ``exp(ref - lp) - (ref - lp) - 1``.

    Non-negative and unbiased for samples of the policy. Shape: ``(B, L)`` twice -> ``(B, L)``.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1
