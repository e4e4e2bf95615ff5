"""The critic-free estimators of trl_lite.core.advantages against brute-force float64 loops (docs/algorithm.md section 12)."""

import math

import pytest
import torch

from trl_lite.core import discounted_returns, grpo_advantages, k3_kl, rloo_advantages, sequence_to_tokens


def _groups(seed=0):
    """Rewards (float32) and non-contiguous, unsorted group ids with groups of 2 to 5 rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([7, 3, 7, 0, 3, 0, 0, 7, 12, 12, 12, 12, 12, 3])
    return torch.randn(len(ids), generator=g), ids


def _members(ids, i):
    return [j for j in range(len(ids)) if int(ids[j]) == int(ids[i])]


def _dense(ids):
    """``ids`` renumbered 0..G-1 in order of value (the trainer's layout), and G: the ``num_groups`` path."""
    values = sorted(set(ids.tolist()))
    return torch.tensor([values.index(i) for i in ids.tolist()]), len(values)


# num_groups: the ids as they are (made dense by torch.unique), or dense with their count (nothing read back).
@pytest.mark.parametrize("dense", [False, True])
def test_rloo_matches_loop(dense):
    rewards, ids = _groups()
    got = rloo_advantages(rewards, *_dense(ids)) if dense else rloo_advantages(rewards, ids)
    r = rewards.double().tolist()
    for i in range(len(r)):
        others = [r[j] for j in _members(ids, i) if j != i]
        expected = r[i] - sum(others) / len(others)
        assert got[i].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_loop(scale, dense):
    rewards, ids = _groups(1)
    if dense:
        dense_ids, count = _dense(ids)
        got = grpo_advantages(rewards, dense_ids, scale_rewards=scale, num_groups=count)
    else:
        got = grpo_advantages(rewards, ids, scale_rewards=scale)
    r = rewards.double().tolist()
    for i in range(len(r)):
        group = [r[j] for j in _members(ids, i)]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        expected = (r[i] - mean) / (std + 1e-6) if scale else r[i] - mean
        assert got[i].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_grpo_equal_scores_give_zero_advantage():
    """A group whose scores are all equal teaches nothing: advantages 0, not NaN (the eps)."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    got = grpo_advantages(rewards, ids)
    assert torch.equal(got[:3], torch.zeros(3))
    assert got[3].item() == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-6)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_loop(gamma):
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    got = discounted_returns(rewards, mask, gamma)
    for b in range(3):
        for t in range(6):
            expected = 0.0
            if mask[b, t]:
                expected = sum(
                    gamma ** (s - t) * float(rewards[b, s]) * float(mask[b, s]) for s in range(t, 6)
                )
            assert got[b, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_sequence_to_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    got = sequence_to_tokens(torch.tensor([2.0, -3.0]), mask)
    assert torch.equal(got, torch.tensor([[2.0, 2.0, 0.0], [0.0, -3.0, -3.0]]))


def test_k3_matches_formula_and_is_unbiased():
    g = torch.Generator().manual_seed(3)
    lp, ref = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    got = k3_kl(lp, ref)
    for b in range(4):
        for t in range(5):
            d = float(ref[b, t]) - float(lp[b, t])
            assert got[b, t].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-5, abs=1e-6)
    assert (got >= 0).all()
    # Averaged over samples of p, k3 estimates KL(p || q) exactly in expectation.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    expected = float((p * (p / q).log()).sum())
    per_token = k3_kl(p.log(), q.log())
    assert float((p * per_token).sum()) == pytest.approx(expected, rel=1e-12)
