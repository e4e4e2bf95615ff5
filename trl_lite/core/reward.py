"""Reward-model training from preference pairs: the pairwise ranking loss and its statistics.

A pair is one prompt answered twice, ``chosen`` preferred to ``rejected``. A reward model gives each
answer a scalar reward ``r``; the Bradley-Terry model of preferences says
``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)``, and training maximises its log-likelihood
(InstructGPT, DeepSpeed-Chat step 2). Shape name: ``P`` pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_ranking_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Per-pair ranking loss ``-log sigmoid(r_chosen - r_rejected - margin)``.

    ``margin`` (Llama 2) asks pairs with a clear preference to be separated by at least that much.
    ``center_rewards_coefficient`` adds ``c * (r_chosen + r_rejected)^2``, which keeps rewards centred
    on zero (the loss alone only sees differences). The trainer's loss is the mean over pairs.
    Shape: ``(P,)``, ``(P,)``, margin ``(P,)`` or None -> ``(P,)``.
    """
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    # logsigmoid is evaluated without overflow for large negative differences.
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


def preference_stats(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over the pairs: accuracy (fraction with ``r_chosen > r_rejected``; a tie counts as wrong),
    the chosen and rejected rewards, and the margin ``r_chosen - r_rejected``.

    Shape: ``(P,)``, ``(P,)`` -> dict of 0-d tensors (keys ``accuracy``, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``).
    """
    return {
        "accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }
