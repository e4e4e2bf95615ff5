"""Tests of ``trl_lite.core.reward`` (pairwise ranking loss and preference statistics) against float64
references written element by element from the equations, never by calling the functions under test."""

import math
import random

import pytest
import torch

from trl_lite import core


def ref_neg_log_sigmoid(x: float) -> float:
    """``-log(1 / (1 + e^-x))`` in float64, in the form that does not overflow for either sign of x."""
    if x >= 0:
        return math.log1p(math.exp(-x))
    return -x + math.log1p(math.exp(x))


def ref_losses(chosen, rejected, margin=None, center=None):
    out = []
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        m = margin[i] if margin is not None else 0.0
        loss = ref_neg_log_sigmoid(c - r - m)
        if center:
            loss += center * (c + r) ** 2
        out.append(loss)
    return out


def random_pairs(n: int, seed: int, scale: float = 3.0):
    rng = random.Random(seed)
    chosen = [rng.gauss(0, scale) for _ in range(n)]
    rejected = [rng.gauss(0, scale) for _ in range(n)]
    return chosen, rejected


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_pairwise_ranking_loss_matches_reference(use_margin, center):
    chosen, rejected = random_pairs(37, seed=1)
    margin = [random.Random(2).uniform(0, 2) for _ in range(37)] if use_margin else None
    expected = ref_losses(chosen, rejected, margin, center)
    got = core.pairwise_ranking_loss(
        torch.tensor(chosen, dtype=torch.float64),
        torch.tensor(rejected, dtype=torch.float64),
        torch.tensor(margin, dtype=torch.float64) if margin is not None else None,
        center,
    )
    assert got.shape == (37,)
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_pairwise_ranking_loss_is_finite_for_large_differences():
    chosen, rejected = [200.0, -200.0, 0.0], [-200.0, 200.0, 0.0]
    got = core.pairwise_ranking_loss(torch.tensor(chosen), torch.tensor(rejected))
    assert got.tolist() == pytest.approx(ref_losses(chosen, rejected), rel=1e-6)
    assert got[1].item() == pytest.approx(400.0)  # a confidently wrong pair costs its whole difference


def test_pairwise_ranking_loss_gradient_matches_reference():
    # d/dr_c [-log sigmoid(d)] = -(1 - sigmoid(d)) = -1 / (1 + e^d), and the opposite for r_r.
    chosen, rejected = random_pairs(9, seed=3)
    c = torch.tensor(chosen, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(rejected, dtype=torch.float64, requires_grad=True)
    core.pairwise_ranking_loss(c, r, center_rewards_coefficient=0.1).sum().backward()
    for i in range(9):
        d = chosen[i] - rejected[i]
        expected = -1.0 / (1.0 + math.exp(d)) + 0.2 * (chosen[i] + rejected[i])
        assert c.grad[i].item() == pytest.approx(expected, rel=1e-12)
        expected_r = 1.0 / (1.0 + math.exp(d)) + 0.2 * (chosen[i] + rejected[i])
        assert r.grad[i].item() == pytest.approx(expected_r, rel=1e-12)


def test_preference_stats_match_reference_with_ties():
    chosen, rejected = random_pairs(20, seed=4)
    chosen[3] = rejected[3]  # a tie is not a correct ranking
    chosen[7] = rejected[7] + 1e-9
    stats = core.preference_stats(torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64))
    correct = 0
    for c, r in zip(chosen, rejected):
        if c > r:
            correct += 1
    assert stats["accuracy"].item() == pytest.approx(correct / 20, abs=1e-15)
    assert stats["rewards/chosen"].item() == pytest.approx(sum(chosen) / 20, rel=1e-12)
    assert stats["rewards/rejected"].item() == pytest.approx(sum(rejected) / 20, rel=1e-12)
    margins = sum(c - r for c, r in zip(chosen, rejected)) / 20
    assert stats["rewards/margins"].item() == pytest.approx(margins, rel=1e-12, abs=1e-15)
