"""Tests of ``trl_lite.core`` against independent float64 references.

Every reference below is written from the equations of ``docs/algorithm.md`` with plain Python / NumPy
loops over elements (brute force), never by calling or mirroring the function under test.
"""

import math
import random

import numpy as np
import pytest
import torch

from trl_lite import core
from trl_lite.core import lm_head as core_lm_head

F64_TOL = 1e-10
F32_TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# Brute-force references (float64, element by element)
# ----------------------------------------------------------------------------------------------


def ref_log_softmax_row(row):
    """Log-softmax of one row of logits, in float64 with the max subtracted."""
    row = [float(z) for z in row]
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return [z - lse for z in row]


def ref_logprobs(logits, labels):
    """``log softmax(logits)[label]`` at every position. Shape: ``(..., V)``, ``(...)`` -> ``(...)``."""
    flat = logits.double().reshape(-1, logits.shape[-1]).tolist()
    flat_labels = labels.reshape(-1).tolist()
    out = [ref_log_softmax_row(row)[label] for row, label in zip(flat, flat_labels)]
    return np.array(out).reshape(tuple(labels.shape))


def ref_entropy(logits):
    """``-sum_v p log p`` at every position. Shape: ``(..., V)`` -> ``(...)``."""
    out = []
    for row in logits.double().reshape(-1, logits.shape[-1]).tolist():
        logp = ref_log_softmax_row(row)
        out.append(-sum(math.exp(lp) * lp for lp in logp))
    return np.array(out).reshape(tuple(logits.shape[:-1]))


def ref_full_kl(logits, ref_logits):
    """``sum_v p (log p - log q)`` at every position. Shape: ``(..., V)`` twice -> ``(...)``."""
    p_rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    q_rows = ref_logits.double().reshape(-1, ref_logits.shape[-1]).tolist()
    out = []
    for p_row, q_row in zip(p_rows, q_rows):
        logp, logq = ref_log_softmax_row(p_row), ref_log_softmax_row(q_row)
        out.append(sum(math.exp(a) * (a - b) for a, b in zip(logp, logq)))
    return np.array(out).reshape(tuple(logits.shape[:-1]))


def masked_items(values, mask):
    """The float64 values where ``mask`` is nonzero, as a Python list."""
    return [float(v) for v, m in zip(values.double().flatten().tolist(), mask.flatten().tolist()) if m]


def ref_mean(items):
    return sum(items) / len(items)


def ref_var(items, unbiased):
    mean = ref_mean(items)
    return sum((x - mean) ** 2 for x in items) / (len(items) - (1 if unbiased else 0))


def ref_gae(values, rewards, mask, gamma, lam):
    """Brute-force GAE: ``A_t = sum_{l>=0} (gamma lam)^l delta_{t+l}``, ``returns = A + V`` (masked V)."""
    values = values.double().numpy() * mask.numpy()
    rewards = rewards.double().numpy() * mask.numpy()
    rows, length = values.shape
    advantages = np.zeros((rows, length))
    for b in range(rows):
        deltas = []
        for t in range(length):
            next_value = values[b, t + 1] if t + 1 < length else 0.0
            deltas.append(rewards[b, t] + gamma * next_value - values[b, t])
        for t in range(length):
            advantages[b, t] = sum((gamma * lam) ** l * deltas[t + l] for l in range(length - t))
    return advantages, advantages + values


def ref_policy_terms(lp, old_lp, adv, mask, cliprange):
    """Per-element clipped surrogate and statistics of docs/algorithm.md section 6, element by element."""
    losses, clipped, approx, policy, ratios = [], [], [], [], []
    for new, old, a, m in zip(*(x.flatten().tolist() for x in (lp, old_lp, adv, mask))):
        if not m:
            continue
        ratio = math.exp(new - old)
        clamped = min(max(ratio, 1.0 - cliprange), 1.0 + cliprange)
        losses.append(max(-a * ratio, -a * clamped))
        clipped.append(1.0 if -a * clamped > -a * ratio else 0.0)
        approx.append((new - old) ** 2)
        policy.append(old - new)
        ratios.append(ratio)
    return {
        "loss": ref_mean(losses),
        "clipfrac": ref_mean(clipped),
        "approxkl": 0.5 * ref_mean(approx),
        "policykl": ref_mean(policy),
        "ratio": ref_mean(ratios),
    }


def ref_policy_loss_autograd(lp, old_lp, adv, mask, cliprange):
    """The clipped surrogate as a differentiable float64 torch scalar, built element by element.

    Uses the case form of the clipped objective (``A >= 0``: ratio capped at ``1 + eps``;
    ``A < 0``: ratio floored at ``1 - eps``), which equals the max form of the spec.
    """
    terms = []
    rows, length = lp.shape
    for b in range(rows):
        for t in range(length):
            if not mask[b, t]:
                continue
            ratio = torch.exp(lp[b, t] - old_lp[b, t])
            ratio_value = math.exp(float(lp[b, t].detach() - old_lp[b, t]))
            a = float(adv[b, t])
            if a >= 0 and ratio_value > 1.0 + cliprange:
                ratio = torch.tensor(1.0 + cliprange, dtype=torch.float64)
            elif a < 0 and ratio_value < 1.0 - cliprange:
                ratio = torch.tensor(1.0 - cliprange, dtype=torch.float64)
            terms.append(-a * ratio)
    return torch.stack(terms).mean()


def ref_value_terms(v, old_v, returns, mask, cliprange_value):
    """Per-element clipped value loss and clip fraction of docs/algorithm.md section 6."""
    losses, clipped = [], []
    for vn, vo, r, m in zip(*(x.flatten().tolist() for x in (v, old_v, returns, mask))):
        if not m:
            continue
        v_clip = min(max(vn, vo - cliprange_value), vo + cliprange_value)
        losses.append(max((vn - r) ** 2, (v_clip - r) ** 2))
        clipped.append(1.0 if (v_clip - r) ** 2 > (vn - r) ** 2 else 0.0)
    return {"loss": 0.5 * ref_mean(losses), "clipfrac": ref_mean(clipped)}


def random_mask(rows, length, generator, min_ones=2):
    """A 0/1 float mask with a random contiguous block of at least ``min_ones`` ones per row."""
    mask = torch.zeros(rows, length, dtype=torch.float64)
    for b in range(rows):
        start = int(torch.randint(0, length - min_ones + 1, (1,), generator=generator))
        stop = int(torch.randint(start + min_ones, length + 1, (1,), generator=generator))
        mask[b, start:stop] = 1.0
    return mask


# ----------------------------------------------------------------------------------------------
# Log-probs, entropy, full KL
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.float64, F64_TOL), (torch.float32, F32_TOL)])
def test_logprobs_from_logits_gather(dtype, tol):
    g = torch.Generator().manual_seed(0)
    logits = (3.0 * torch.randn(3, 7, 11, generator=g)).to(dtype)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    out = core.logprobs_from_logits(logits, labels)
    assert out.shape == (3, 7)
    np.testing.assert_allclose(out.double().numpy(), ref_logprobs(logits, labels), rtol=0, atol=tol)


def test_logprobs_from_logits_large_logits_are_stable():
    g = torch.Generator().manual_seed(1)
    logits = 1000.0 + 5.0 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (4,), generator=g)
    out = core.logprobs_from_logits(logits, labels)
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(out.numpy(), ref_logprobs(logits, labels), rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, F64_TOL), (torch.float32, F32_TOL)])
def test_logprobs_from_logits_no_gather_is_full_log_softmax(dtype, tol):
    g = torch.Generator().manual_seed(2)
    logits = (2.0 * torch.randn(2, 5, 13, generator=g)).to(dtype)
    out = core.logprobs_from_logits(logits, None, gather=False)
    assert out.shape == (2, 5, 13)
    ref = np.array([ref_log_softmax_row(row) for row in logits.double().reshape(-1, 13).tolist()]).reshape(2, 5, 13)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=0, atol=tol)


def test_logprobs_from_logits_bf16_is_close():
    g = torch.Generator().manual_seed(3)
    logits32 = 3.0 * torch.randn(4, 6, 17, generator=g)
    labels = torch.randint(0, 17, (4, 6), generator=g)
    logits_bf16 = logits32.to(torch.bfloat16)
    before = logits_bf16.clone()
    out = core.logprobs_from_logits(logits_bf16, labels)
    assert torch.equal(logits_bf16, before), "the caller's bf16 logits must not be modified"
    # Exact arithmetic on the bf16-rounded inputs: only float32 rounding remains.
    np.testing.assert_allclose(out.double().numpy(), ref_logprobs(logits_bf16, labels), rtol=0, atol=F32_TOL)
    # Against the unrounded logits, only the bf16 input rounding (about 2^-8 relative) remains.
    np.testing.assert_allclose(out.double().numpy(), ref_logprobs(logits32, labels), rtol=0, atol=0.1)


@pytest.fixture
def small_chunks(monkeypatch):
    """Make the vocabulary reductions work on chunks of at most 1000 bytes of float32 rows.

    With V = 5..19 that is 13..50 rows, so the shapes below span several chunks with a partial last
    one, which the default 2 MiB budget would need far bigger tensors to exercise.
    """
    monkeypatch.setattr(core_lm_head, "_CACHE_BYTES", {"cpu": 1000})  # logprobs.py's pieces too: one constant


def test_logprobs_from_logits_gather_makes_no_full_log_softmax(monkeypatch, small_chunks):
    seen_rows = []
    real = torch.nn.functional.log_softmax

    def recording(x, *args, **kwargs):
        seen_rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "log_softmax", recording)
    for name in ("log_softmax", "softmax", "logsumexp"):
        monkeypatch.setattr(torch, name, None)  # any other full-vocabulary path would fail loudly
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 19, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 19, (3, 5), generator=g)
    out = core.logprobs_from_logits(logits, labels)
    np.testing.assert_allclose(out.numpy(), ref_logprobs(logits, labels), rtol=0, atol=F64_TOL)
    # 15 rows, at most 1000 // (4 * 19) = 13 per chunk: one full chunk and a partial one.
    assert seen_rows == [13, 2]


@pytest.mark.parametrize("shape", [(2, 3, 7), (3, 200, 7), (601, 5)])
def test_entropy_from_logits(shape, small_chunks):
    # (3, 200, 7) and (601, 5) have more rows than one chunk, with a partial last chunk.
    g = torch.Generator().manual_seed(5)
    logits = 2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
    out = core.entropy_from_logits(logits)
    assert out.shape == shape[:-1]
    np.testing.assert_allclose(out.numpy(), ref_entropy(logits), rtol=0, atol=F64_TOL)


def test_entropy_from_logits_float32_and_limits(small_chunks):
    g = torch.Generator().manual_seed(6)
    logits = 2.0 * torch.randn(300, 8, generator=g)
    out = core.entropy_from_logits(logits)
    np.testing.assert_allclose(out.double().numpy(), ref_entropy(logits), rtol=0, atol=F32_TOL)
    # Uniform logits have the maximum entropy log V; one dominant logit has almost none.
    uniform = core.entropy_from_logits(torch.zeros(2, 8, dtype=torch.float64))
    np.testing.assert_allclose(uniform.numpy(), [math.log(8)] * 2, rtol=0, atol=F64_TOL)
    peaked = torch.tensor([[100.0, 0.0, 0.0]], dtype=torch.float64)
    assert 0.0 <= float(core.entropy_from_logits(peaked)[0]) < 1e-40


@pytest.mark.parametrize("shape", [(2, 4, 9), (2, 150, 6)])
def test_full_kl_from_logits(shape, small_chunks):
    g = torch.Generator().manual_seed(7)
    logits = 2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)
    ref_logits = logits + torch.randn(*shape, generator=g, dtype=torch.float64)
    out = core.full_kl_from_logits(logits, ref_logits)
    assert out.shape == shape[:-1]
    np.testing.assert_allclose(out.numpy(), ref_full_kl(logits, ref_logits), rtol=0, atol=F64_TOL)
    assert (out >= 0).all()
    same = core.full_kl_from_logits(logits, logits + 3.0)  # a constant shift is the same distribution
    np.testing.assert_allclose(same.numpy(), np.zeros(shape[:-1]), rtol=0, atol=F64_TOL)


def test_full_kl_from_logits_float32(small_chunks):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(270, 6, generator=g)
    ref_logits = torch.randn(270, 6, generator=g)
    out = core.full_kl_from_logits(logits, ref_logits)
    np.testing.assert_allclose(out.double().numpy(), ref_full_kl(logits, ref_logits), rtol=0, atol=F32_TOL)


# ----------------------------------------------------------------------------------------------
# Masked statistics, whitening, clipping
# ----------------------------------------------------------------------------------------------


def test_masked_mean_all_elements():
    g = torch.Generator().manual_seed(10)
    values = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = random_mask(4, 9, g)
    values_outside = values + 1e6 * (1 - mask)  # must not leak into the mean
    out = core.masked_mean(values_outside, mask)
    assert out.shape == ()
    assert abs(float(out) - ref_mean(masked_items(values, mask))) < F64_TOL


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_masked_mean_with_axis(axis):
    g = torch.Generator().manual_seed(11)
    values = torch.randn(5, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 8, dtype=torch.float64)
    mask[torch.rand(5, 8, generator=g) < 0.4] = 0.0
    mask[:, 0] = 1.0
    mask[0, :] = 1.0  # every row and column keeps at least one element
    out = core.masked_mean(values, mask, axis=axis)
    v, m = values.numpy(), mask.numpy()
    if axis == 0:
        ref = [ref_mean([v[b, j] for b in range(5) if m[b, j]]) for j in range(8)]
    else:
        ref = [ref_mean([v[i, t] for t in range(8) if m[i, t]]) for i in range(5)]
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var(unbiased):
    g = torch.Generator().manual_seed(12)
    values = 3.0 + 2.0 * torch.randn(4, 10, generator=g, dtype=torch.float64)
    mask = random_mask(4, 10, g)
    out = core.masked_var(values + 1e6 * (1 - mask), mask, unbiased=unbiased)
    assert out.shape == ()
    assert abs(float(out) - ref_var(masked_items(values, mask), unbiased)) < F64_TOL


def test_masked_var_float32():
    g = torch.Generator().manual_seed(13)
    values = torch.randn(3, 12, generator=g)
    mask = random_mask(3, 12, g).float()
    out = core.masked_var(values, mask)
    assert abs(float(out) - ref_var(masked_items(values, mask), True)) < F32_TOL


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_single_element_is_zero(unbiased):
    # One unmasked element: the biased variance is 0 and the unbiased one, undefined, is returned as 0.
    values = torch.tensor([[1.5, -2.0, 7.0], [4.0, 9.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert float(core.masked_var(values, mask, unbiased=unbiased)) == 0.0


def test_masked_var_two_elements():
    values = torch.tensor([[1.0, 100.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    assert abs(float(core.masked_var(values, mask, unbiased=True)) - 4.5) < F64_TOL
    assert abs(float(core.masked_var(values, mask, unbiased=False)) - 2.25) < F64_TOL


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(shift_mean):
    g = torch.Generator().manual_seed(14)
    values = 5.0 + 3.0 * torch.randn(4, 11, generator=g, dtype=torch.float64)
    mask = random_mask(4, 11, g)
    values = values + 100.0 * (1 - mask)  # masked-out elements must not change the statistics
    out = core.masked_whiten(values, mask, shift_mean=shift_mean)
    assert out.shape == values.shape
    items = masked_items(values, mask)
    mean, var = ref_mean(items), ref_var(items, unbiased=True)
    out_items = masked_items(out, mask)
    # The 1e-8 variance epsilon of whitening bounds the agreement to ~1e-8 relative.
    expected_mean = 0.0 if shift_mean else mean
    assert abs(ref_mean(out_items) - expected_mean) < 1e-9
    assert abs(ref_var(out_items, unbiased=True) - 1.0) < 1e-8
    expected = [(x - mean) / math.sqrt(var) + expected_mean for x in items]
    np.testing.assert_allclose(out_items, expected, rtol=1e-8, atol=1e-9)


def test_clip_by_value_tensor_bounds():
    g = torch.Generator().manual_seed(15)
    x = 3.0 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    low = torch.randn(5, 6, generator=g, dtype=torch.float64) - 0.5
    high = low + torch.rand(5, 6, generator=g, dtype=torch.float64) * 2.0
    out = core.clip_by_value(x, low, high)
    ref = [min(max(xi, lo), hi) for xi, lo, hi in zip(*(t.flatten().tolist() for t in (x, low, high)))]
    np.testing.assert_array_equal(out.flatten().numpy(), ref)
    assert (out == low).any() and (out == high).any() and ((out > low) & (out < high)).any()


def test_clip_by_value_scalar_bounds():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 2.5])
    out = core.clip_by_value(x, -1.0, 1.0)
    np.testing.assert_array_equal(out.numpy(), np.array([-1.0, -0.5, 0.0, 0.7, 1.0], dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# KL estimators and KL-shaped rewards
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "penalty, formula",
    [("kl", lambda a, b: a - b), ("abs", lambda a, b: abs(a - b)), ("mse", lambda a, b: 0.5 * (a - b) ** 2)],
)
def test_kl_estimate_elementwise(penalty, formula):
    g = torch.Generator().manual_seed(20)
    lp = torch.randn(3, 7, generator=g, dtype=torch.float64) - 2.0
    ref_lp = torch.randn(3, 7, generator=g, dtype=torch.float64) - 2.0
    out = core.kl_estimate(lp, ref_lp, penalty)
    ref = [formula(a, b) for a, b in zip(lp.flatten().tolist(), ref_lp.flatten().tolist())]
    np.testing.assert_allclose(out.flatten().numpy(), ref, rtol=0, atol=F64_TOL)


def test_kl_estimate_full_uses_full_kl():
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(2, 5, 9, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(2, 5, 9, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    lp = core.logprobs_from_logits(logits, labels)
    ref_lp = core.logprobs_from_logits(ref_logits, labels)
    full = core.full_kl_from_logits(logits, ref_logits)
    out = core.kl_estimate(lp, ref_lp, "full", full_kl=full)
    np.testing.assert_allclose(out.numpy(), ref_full_kl(logits, ref_logits), rtol=0, atol=F64_TOL)
    with pytest.raises(ValueError, match="full_kl"):
        core.kl_estimate(lp, ref_lp, "full")


def test_kl_estimate_unknown_penalty():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_penalty.*'bogus'"):
        core.kl_estimate(lp, lp, "bogus")


def test_last_index():
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 1],
            [1, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
        ]
    )
    expected = []
    for row in mask.tolist():
        ones = [t for t, m in enumerate(row) if m]
        expected.append(ones[-1] if ones else 0)
    assert core.last_index(mask).tolist() == expected == [3, 5, 0, 5, 0, 3]
    assert core.last_index(mask.double()).tolist() == expected
    assert core.last_index(mask.bool()).tolist() == expected


def test_compute_kl_rewards():
    g = torch.Generator().manual_seed(22)
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 0, 0],  # right-padded response after a query
            [1, 1, 1, 1, 1, 1, 1],  # mask ends at the last position
            [0, 1, 1, 0, 0, 1, 0],  # holes (response_masks): score at the last 1
            [0, 0, 0, 0, 0, 0, 0],  # no action: no score, no reward
            [1, 0, 0, 0, 0, 0, 0],  # single action at position 0
        ],
        dtype=torch.float64,
    )
    kl = torch.randn(5, 7, generator=g, dtype=torch.float64)
    scores = torch.tensor([1.5, -2.0, 0.25, 9.0, 3.0], dtype=torch.float64)
    kl_coef = 0.2
    rewards, non_score = core.compute_kl_rewards(scores, kl, mask, kl_coef)
    ref_rewards = np.zeros((5, 7))
    ref_non_score = np.zeros((5, 7))
    for b in range(5):
        ones = [t for t in range(7) if mask[b, t]]
        for t in ones:
            ref_non_score[b, t] = -kl_coef * float(kl[b, t])
            ref_rewards[b, t] = ref_non_score[b, t]
        if ones:
            ref_rewards[b, ones[-1]] += float(scores[b])
    np.testing.assert_allclose(non_score.numpy(), ref_non_score, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(rewards.numpy(), ref_rewards, rtol=0, atol=F64_TOL)
    assert (rewards[3] == 0).all() and (non_score[3] == 0).all()
    assert (rewards[mask == 0] == 0).all() and (non_score[mask == 0] == 0).all()


def test_compute_kl_rewards_mixed_dtypes_and_integer_mask():
    g = torch.Generator().manual_seed(23)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    kl = torch.randn(2, 4, generator=g)
    scores = torch.tensor([2.0, -1.0], dtype=torch.float64)
    rewards, non_score = core.compute_kl_rewards(scores, kl, mask, 0.1)
    assert rewards.dtype == torch.float32 and rewards.shape == (2, 4)
    expected = -0.1 * kl.double().numpy() * mask.numpy()
    expected[0, 2] += 2.0
    expected[1, 3] += -1.0
    np.testing.assert_allclose(rewards.double().numpy(), expected, rtol=0, atol=F32_TOL)


# ----------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 1.0), (1.0, 1.0), (0.7, 0.0), (0.0, 0.5)])
def test_compute_gae_brute_force(gamma, lam):
    g = torch.Generator().manual_seed(30)
    rows, length = 6, 9
    mask = random_mask(rows, length, g, min_ones=1)
    mask[0] = 0.0
    mask[0, 2:] = 1.0  # left padding, mask to the end
    mask[1] = 0.0
    mask[1, :4] = 1.0  # right padding
    mask[2] = 0.0
    mask[2, [1, 2, 5, 6]] = 1.0  # a hole in the middle
    values = torch.randn(rows, length, generator=g, dtype=torch.float64)
    rewards = torch.randn(rows, length, generator=g, dtype=torch.float64)
    advantages, returns = core.compute_gae(values, rewards, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(values, rewards, mask, gamma, lam)
    np.testing.assert_allclose(advantages.numpy(), ref_adv, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(returns.numpy(), ref_ret, rtol=0, atol=F64_TOL)
    masked_values = values.numpy() * mask.numpy()
    np.testing.assert_allclose(returns.numpy(), advantages.numpy() + masked_values, rtol=0, atol=F64_TOL)
    # Positions after the last action see no reward and no value: their advantage is zero.
    assert (advantages[1, 4:] == 0).all()


def test_compute_gae_float32():
    g = torch.Generator().manual_seed(31)
    mask = random_mask(4, 12, g).float()
    values = torch.randn(4, 12, generator=g)
    rewards = torch.randn(4, 12, generator=g)
    advantages, returns = core.compute_gae(values, rewards, mask, 0.99, 0.95)
    ref_adv, ref_ret = ref_gae(values, rewards, mask, 0.99, 0.95)
    np.testing.assert_allclose(advantages.double().numpy(), ref_adv, rtol=0, atol=F32_TOL)
    np.testing.assert_allclose(returns.double().numpy(), ref_ret, rtol=0, atol=F32_TOL)


def test_compute_gae_single_terminal_reward_montecarlo():
    # gamma = lam = 1, zero values: every advantage is the undiscounted reward-to-go.
    rewards = torch.tensor([[0.0, 0.5, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    advantages, returns = core.compute_gae(torch.zeros(1, 4, dtype=torch.float64), rewards, mask, 1.0, 1.0)
    np.testing.assert_allclose(advantages.numpy(), [[1.5, 1.5, 1.0, 2.0]], rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(returns.numpy(), [[1.5, 1.5, 1.0, 2.0]], rtol=0, atol=F64_TOL)


# ----------------------------------------------------------------------------------------------
# PPO losses
# ----------------------------------------------------------------------------------------------


def policy_inputs(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old_lp = -2.0 + torch.randn(5, 10, generator=g, dtype=torch.float64)
    lp = old_lp + 0.4 * torch.randn(5, 10, generator=g, dtype=torch.float64)  # ratios well outside 1 +- 0.2
    adv = torch.randn(5, 10, generator=g, dtype=torch.float64)
    mask = random_mask(5, 10, g)
    return lp.to(dtype), old_lp.to(dtype), adv.to(dtype), mask.to(dtype)


@pytest.mark.parametrize("cliprange", [0.1, 0.2, 0.5])
def test_ppo_policy_loss_and_stats(cliprange):
    lp, old_lp, adv, mask = policy_inputs(40)
    loss, stats = core.ppo_policy_loss(lp, old_lp, adv, mask, cliprange)
    ref = ref_policy_terms(lp, old_lp, adv, mask, cliprange)
    assert 0.0 < ref["clipfrac"] < 1.0, "the inputs must clip some elements and not others"
    assert loss.shape == ()
    assert abs(float(loss) - ref["loss"]) < F64_TOL
    assert set(stats) == {"clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "approxkl", "policykl", "ratio"}
    for key in stats:
        assert not stats[key].requires_grad
    for key in ("clipfrac", "approxkl", "policykl", "ratio"):
        assert abs(float(stats[key]) - ref[key]) < F64_TOL, key
    # The two sides of the clip (tests/test_objectives.py checks each against its definition).
    assert abs(float(stats["clipfrac_low"] + stats["clipfrac_high"]) - ref["clipfrac"]) < F64_TOL
    assert float(stats["dual_clipfrac"]) == 0.0


def test_ppo_policy_loss_float32():
    lp, old_lp, adv, mask = policy_inputs(41, torch.float32)
    loss, stats = core.ppo_policy_loss(lp, old_lp, adv, mask, 0.2)
    ref = ref_policy_terms(lp, old_lp, adv, mask, 0.2)
    assert abs(float(loss) - ref["loss"]) < F32_TOL
    for key in ("clipfrac", "approxkl", "policykl", "ratio"):
        assert abs(float(stats[key]) - ref[key]) < F32_TOL, key


def test_ppo_policy_loss_ignores_masked_elements():
    lp, old_lp, adv, mask = policy_inputs(42)
    noisy_lp = torch.where(mask.bool(), lp, lp + 50.0)
    noisy_adv = torch.where(mask.bool(), adv, adv * 1e3)
    loss, stats = core.ppo_policy_loss(noisy_lp, old_lp, noisy_adv, mask, 0.2)
    ref = ref_policy_terms(lp, old_lp, adv, mask, 0.2)
    assert abs(float(loss) - ref["loss"]) < F64_TOL
    assert abs(float(stats["ratio"]) - ref["ratio"]) < F64_TOL


def test_ppo_policy_loss_gradient():
    lp, old_lp, adv, mask = policy_inputs(43)
    cliprange = 0.2
    lp_core = lp.clone().requires_grad_(True)
    loss, _ = core.ppo_policy_loss(lp_core, old_lp, adv, mask, cliprange)
    loss.backward()
    lp_ref = lp.clone().requires_grad_(True)
    ref_policy_loss_autograd(lp_ref, old_lp, adv, mask, cliprange).backward()
    np.testing.assert_allclose(lp_core.grad.numpy(), lp_ref.grad.numpy(), rtol=0, atol=F64_TOL)
    # Clipped and masked elements get no gradient; the others get -A ratio / N.
    n = float(mask.sum())
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            ratio = math.exp(float(lp[b, t] - old_lp[b, t]))
            a = float(adv[b, t])
            active = mask[b, t] and ((a >= 0 and ratio < 1 + cliprange) or (a < 0 and ratio > 1 - cliprange))
            expected = -a * ratio / n if active else 0.0
            assert abs(float(lp_core.grad[b, t]) - expected) < F64_TOL
    assert (lp_core.grad == 0).any() and (lp_core.grad != 0).any()


def value_inputs(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old_v = torch.randn(5, 10, generator=g, dtype=torch.float64)
    v = old_v + torch.randn(5, 10, generator=g, dtype=torch.float64)  # often beyond the clip band
    returns = old_v + 1.5 * torch.randn(5, 10, generator=g, dtype=torch.float64)
    mask = random_mask(5, 10, g)
    return v.to(dtype), old_v.to(dtype), returns.to(dtype), mask.to(dtype)


@pytest.mark.parametrize("cliprange_value", [0.05, 0.2, 0.5])
def test_ppo_value_loss(cliprange_value):
    v, old_v, returns, mask = value_inputs(50)
    loss, stats = core.ppo_value_loss(v, old_v, returns, mask, cliprange_value)
    ref = ref_value_terms(v, old_v, returns, mask, cliprange_value)
    assert 0.0 < ref["clipfrac"] < 1.0, "the inputs must clip some elements and not others"
    assert loss.shape == ()
    assert abs(float(loss) - ref["loss"]) < F64_TOL
    assert set(stats) == {"clipfrac"}
    assert not stats["clipfrac"].requires_grad
    assert abs(float(stats["clipfrac"]) - ref["clipfrac"]) < F64_TOL


def test_ppo_value_loss_float32_and_gradient():
    v, old_v, returns, mask = value_inputs(51, torch.float32)
    v = v.requires_grad_(True)
    loss, stats = core.ppo_value_loss(v, old_v, returns, mask, 0.2)
    ref = ref_value_terms(v.detach(), old_v, returns, mask, 0.2)
    assert abs(float(loss.detach()) - ref["loss"]) < F32_TOL
    assert abs(float(stats["clipfrac"]) - ref["clipfrac"]) < F32_TOL
    loss.backward()
    # d/dv of 0.5 mean(max(...)): (v - R) / N where the unclipped term wins, 0 where the clipped
    # term wins with v outside the clip band (the clipped prediction is constant there).
    n = float(mask.sum())
    vd, ov, r = v.detach().double(), old_v.double(), returns.double()
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            if not mask[b, t]:
                expected = 0.0
            else:
                v_clip = min(max(float(vd[b, t]), float(ov[b, t]) - 0.2), float(ov[b, t]) + 0.2)
                clipped_wins = (v_clip - float(r[b, t])) ** 2 > (float(vd[b, t]) - float(r[b, t])) ** 2
                expected = 0.0 if clipped_wins else (float(vd[b, t]) - float(r[b, t])) / n
            assert abs(float(v.grad[b, t]) - expected) < F32_TOL


# ----------------------------------------------------------------------------------------------
# Dict helpers, LengthSampler, set_seed
# ----------------------------------------------------------------------------------------------


def test_flatten_dict():
    nested = {"ppo": {"loss": {"policy": 1, "value": 2}, "mean_scores": 3}, "time": 4, 5: {"x": 6}}
    assert core.flatten_dict(nested) == {
        "ppo/loss/policy": 1,
        "ppo/loss/value": 2,
        "ppo/mean_scores": 3,
        "time": 4,
        "5/x": 6,
    }
    assert core.flatten_dict({"a": {"b": 1}}, sep=".") == {"a.b": 1}
    assert core.flatten_dict({}) == {}
    with pytest.raises(ValueError, match="separator '/' may not appear in a key, got key 'a/b'"):
        core.flatten_dict({"x": {"a/b": 1}})


def test_stack_dicts():
    dicts = [
        {"loss": torch.tensor(1.0), "adv": torch.tensor([1.0, 2.0])},
        {"loss": torch.tensor(2.0), "adv": torch.tensor([3.0])},
        {"loss": torch.tensor(4.0), "adv": torch.tensor([4.0, 5.0, 6.0])},
    ]
    stacked = core.stack_dicts(dicts)
    assert set(stacked) == {"loss", "adv"}
    # Classic: one row per dict, 0-d values as one column, ragged rows right-padded with -1.
    assert stacked["loss"].tolist() == [[1.0], [2.0], [4.0]]
    assert stacked["adv"].tolist() == [[1.0, 2.0, -1.0], [3.0, -1.0, -1.0], [4.0, 5.0, 6.0]]
    assert core.WANDB_PADDING == -1
    assert core.stack_dicts([{"x": 0.5}, {"x": 1.5}])["x"].tolist() == [[0.5], [1.5]]


def test_stats_to_np():
    grad_tensor = torch.tensor([1.0, 2.0], requires_grad=True) * 2
    stats = {
        "scalar": torch.tensor(0.25, dtype=torch.float64),
        "vector": grad_tensor,
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "bf16_scalar": torch.tensor(3.0, dtype=torch.bfloat16),
        "numpy0d": np.array(7.0),
        "numpy": np.array([1, 2]),
        "float": 2.5,
        "int": 3,
        "np_float32": np.float32(1.5),
        "text": "hello",
    }
    out = core.stats_to_np(stats)
    assert list(out) == list(stats)
    assert type(out["scalar"]) is float and out["scalar"] == 0.25
    assert isinstance(out["vector"], np.ndarray) and out["vector"].tolist() == [2.0, 4.0]
    assert isinstance(out["bf16"], np.ndarray) and out["bf16"].tolist() == [1.5, -2.0]
    assert type(out["bf16_scalar"]) is float and out["bf16_scalar"] == 3.0
    assert type(out["numpy0d"]) is float and out["numpy0d"] == 7.0
    assert out["numpy"].tolist() == [1, 2]
    assert out["float"] == 2.5 and out["text"] == "hello"
    assert type(out["int"]) is float and out["int"] == 3.0
    assert type(out["np_float32"]) is float and out["np_float32"] == 1.5


def test_length_sampler_range_excludes_max():
    np.random.seed(0)
    sampler = core.LengthSampler(3, 7)
    draws = [sampler() for _ in range(400)]
    assert all(type(d) is int for d in draws)
    assert set(draws) == {3, 4, 5, 6}
    single = core.LengthSampler(5, 6)
    assert {single() for _ in range(20)} == {5}


@pytest.mark.parametrize("low, high", [(4, 4), (5, 2)])
def test_length_sampler_rejects_empty_range(low, high):
    with pytest.raises(ValueError, match=f"min_value={low}, max_value={high}"):
        core.LengthSampler(low, high)


def test_length_sampler_follows_numpy_seed():
    sampler = core.LengthSampler(0, 1000)
    np.random.seed(123)
    first = [sampler() for _ in range(10)]
    np.random.seed(123)
    assert [sampler() for _ in range(10)] == first


def test_set_seed_reproducible_draws():
    def draws():
        return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randint(0, 100, (4,)).tolist()

    core.set_seed(1234)
    first = draws()
    core.set_seed(1234)
    assert draws() == first
    core.set_seed(4321)
    other = draws()
    assert other[0] != first[0] and other[1] != first[1] and other[2] != first[2]


def _reference_logprobs_entropy(logits64, labels):
    """float64 log-softmax by the textbook formula, and entropy -sum p log p, element by element."""
    logp = logits64 - logits64.exp().sum(-1, keepdim=True).log()
    chosen = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows", [5, 40])
def test_logprobs_and_entropy_from_logits_values_and_gradient(dtype, rows, small_chunks):
    # 3 x 40 rows of V = 11 span several chunks of 22 rows, the last one partial.
    from trl_lite.core import logprobs_and_entropy_from_logits

    gen = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(3, rows, 11, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 11, (3, rows), generator=gen)
    weights = torch.randn(3, rows, generator=gen, dtype=torch.float64)
    entropy_weights = torch.randn(3, rows, generator=gen, dtype=torch.float64)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels)
    # The entropy is differentiable (the entropy bonus): its backward runs over the same chunks.
    (logprobs.double() * weights + entropy.double() * entropy_weights).sum().backward()

    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _reference_logprobs_entropy(ref_logits, labels)
    (ref_lp * weights + ref_ent * entropy_weights).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(logprobs.double(), ref_lp.detach(), atol=tol)
    assert torch.allclose(entropy.double(), ref_ent.detach(), atol=tol)
    assert torch.allclose(logits.grad.double(), ref_logits.grad, atol=tol)
    assert logits.grad.dtype == dtype


def test_logprobs_and_entropy_from_bf16_logits(small_chunks):
    # bf16 logits are upcast per chunk: values and entropy carry only float32 rounding of the
    # bf16-rounded inputs; the gradient comes back in bf16 (about 2^-8 relative rounding).
    from trl_lite.core import logprobs_and_entropy_from_logits

    gen = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(2, 30, 13, generator=gen)).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 13, (2, 30), generator=gen)
    weights = torch.randn(2, 30, generator=gen, dtype=torch.float64)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, labels)
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs.double() * weights).sum().backward()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _reference_logprobs_entropy(ref_logits, labels)
    (ref_lp * weights).sum().backward()
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), rtol=0, atol=F32_TOL)
    torch.testing.assert_close(entropy.double(), ref_ent.detach(), rtol=0, atol=F32_TOL)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=2**-7, atol=1e-3)


def _linear_head_inputs(dtype, rows, vocab, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    weights = torch.randn(rows, generator=gen, dtype=torch.float64)
    return hidden, weight, b, labels, weights


def _linear_head_reference(hidden, weight, bias, labels, weights, entropy_weights=None):
    """float64 leaves, the textbook logits h W^T + b, log-probs and entropy, and the gradients of
    ``sum(weights * logprobs + entropy_weights * entropy)``."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    logits = torch.stack([torch.stack([torch.dot(h[n], w[v]) for v in range(len(w))]) for n in range(len(h))])
    if b is not None:
        logits = logits + b
    logprobs, entropy = _reference_logprobs_entropy(logits, labels)
    objective = logprobs * weights + (entropy * entropy_weights if entropy_weights is not None else 0.0)
    objective.sum().backward()
    return logprobs.detach(), entropy.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("buffer_rows", [None, 64])
def test_logprobs_and_entropy_from_hidden_values_and_gradients(dtype, bias, buffer_rows, small_chunks):
    # 40 rows of V = 11: chunks of 22 and 18 rows; the buffer is allocated for 40 or 64 rows.
    hidden, weight, b, labels, weights = _linear_head_inputs(dtype, 40, 11, bias, seed=9)
    entropy_weights = torch.randn(40, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    logprobs, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, buffer_rows)
    # The entropy is differentiable (the entropy bonus): its backward runs over the same chunks.
    (logprobs.double() * weights + entropy.double() * entropy_weights).sum().backward()
    ref_lp, ref_ent, ref_grads = _linear_head_reference(hidden, weight, b, labels, weights, entropy_weights)
    tol = 1e-12 if dtype == torch.float64 else F32_TOL
    torch.testing.assert_close(logprobs.double(), ref_lp, rtol=0, atol=tol)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=0, atol=tol)
    for leaf, ref_grad in zip((hidden, weight, b), ref_grads):
        if leaf is not None:
            assert leaf.grad.dtype == dtype
            torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=0, atol=tol)
    # Without grad the log-probs are the same numbers; with grad the same differentiable ones.
    with torch.no_grad():
        no_grad = core.logprobs_from_hidden(hidden, weight, b, labels, buffer_rows)
    torch.testing.assert_close(no_grad.double(), ref_lp, rtol=0, atol=tol)
    assert core.logprobs_from_hidden(hidden, weight, b, labels).requires_grad


def test_logprobs_and_entropy_from_bf16_hidden(small_chunks):
    # bf16 head: the product in bf16 as the model would compute it, then float32 softmax; gradients
    # come back in bf16 (about 2^-8 relative rounding).
    hidden, weight, b, labels, weights = _linear_head_inputs(torch.bfloat16, 30, 13, True, seed=10)
    logprobs, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels)
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs.double() * weights).sum().backward()
    with torch.no_grad():
        bf16_logits = torch.nn.functional.linear(hidden, weight, b).double()  # rounded as the model rounds
    ref_lp, ref_ent = _reference_logprobs_entropy(bf16_logits, labels)
    torch.testing.assert_close(logprobs.double(), ref_lp, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=0, atol=F32_TOL)
    _, _, ref_grads = _linear_head_reference(hidden, weight, b, labels, weights)
    for leaf, ref_grad in zip((hidden, weight, b), ref_grads):
        assert leaf.grad.dtype == torch.bfloat16
        torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=2**-6, atol=2e-2)


def test_logprobs_and_entropy_from_hidden_under_autocast_match_the_autocast_head():
    # Under autocast the head's products (forward and backward) run in the autocast dtype, as the
    # model's own LM head would under accelerate's mixed precision; the result equals that composition.
    hidden, weight, _, labels, weights = _linear_head_inputs(torch.float32, 24, 300, False, seed=11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = core.logprobs_and_entropy_from_hidden(hidden, weight, None, labels)
    (logprobs.double() * weights).sum().backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16
    composed = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None])[:, 0]
    (composed.double() * weights).sum().backward()
    torch.testing.assert_close(logprobs, composed, rtol=0, atol=1e-6)
    torch.testing.assert_close(fused_grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grads[1], weight.grad, rtol=1e-5, atol=1e-6)
    # ... and differs from the float32 head, so the test sees which precision was used.
    with torch.no_grad():
        fp32 = core.logprobs_from_hidden(hidden, weight, None, labels)
    assert (fp32 - logprobs).abs().max() > 1e-4


def test_logprobs_from_hidden_write_into_a_given_buffer_and_reject_one_that_does_not_fit():
    hidden, weight, _, labels, weights = _linear_head_inputs(torch.float32, 12, 9, False, seed=13)
    out = torch.full((20, 9), float("nan"))
    logprobs, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, None, labels, out=out)
    (logprobs.double() * weights).sum().backward()
    ref_lp, ref_ent, (ref_grad_hidden, ref_grad_weight, _) = _linear_head_reference(hidden, weight, None, labels, weights)
    torch.testing.assert_close(logprobs.double(), ref_lp, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(hidden.grad.double(), ref_grad_hidden, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(weight.grad.double(), ref_grad_weight, rtol=0, atol=F32_TOL)
    assert torch.isfinite(out[:12]).all() and torch.isnan(out[12:]).all()  # only the first N rows are used
    with torch.no_grad():
        torch.testing.assert_close(core.logprobs_from_hidden(hidden, weight, None, labels, out=out).double(), ref_lp,
                                   rtol=0, atol=F32_TOL)
    for bad in (torch.empty(11, 9), torch.empty(12, 8), torch.empty(12, 9, dtype=torch.float64), torch.empty(12 * 9)):
        with pytest.raises(ValueError, match=r"out must be a \(12 or more, 9\) torch.float32 tensor"):
            core.logprobs_from_hidden(hidden, weight, None, labels, out=bad)


def test_lm_head_buffer_has_the_requested_rows():
    hidden, weight, _, _, _ = _linear_head_inputs(torch.float32, 5, 7, False, seed=12)
    with torch.no_grad():
        for buffer_rows, allocated in ((None, 5), (3, 5), (9, 9)):
            logits = core_lm_head._lm_head_logits(hidden, weight, None, buffer_rows)
            assert logits.shape == (5, 7) and logits.untyped_storage().nbytes() == 4 * 7 * allocated
            torch.testing.assert_close(logits, hidden @ weight.T, rtol=0, atol=0)
