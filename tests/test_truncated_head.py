"""Truncated sampling's kept sets and the truncated LM head (PPO_SPEC section 23) against float64 brute force: the
kept set by a full sort and written-out rules, and log pi_T^K, its entropy and every gradient by explicit
renormalisation of a float64 softmax - for top-k, top-p, min-p and their combinations, ties at the boundary,
T != 1, one buffer and chunks, float32 and bfloat16 weights."""

import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from trl_lite.core.kept_sets import KeptSets, Truncation, kept_ids, kept_mask
from trl_lite.core.truncated_head import truncated_head, truncated_head_logprobs

CUTS = [
    Truncation(top_k=5),
    Truncation(top_p=0.8),
    Truncation(min_p=0.1),
    Truncation(top_k=20, top_p=0.8),
    Truncation(top_k=8, top_p=0.9, min_p=0.05),
]


def brute_kept(scores: torch.Tensor, cut: Truncation) -> torch.Tensor:
    """(R, V) bool, float64, one row at a time with Python sorts: top-k (ties with the k-th kept), then top-p over
    the top-k-renormalised mass (smallest most-probable prefix, by transformers' ascending-cumsum rule), then min-p
    relative to the most probable token; at least one token."""
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for r, row in enumerate(scores.double()):
        keep = torch.ones(len(row), dtype=torch.bool)
        if cut.top_k:
            kth = sorted(row.tolist(), reverse=True)[min(cut.top_k, len(row)) - 1]
            keep &= row >= kth
        if cut.top_p < 1.0:
            p = torch.softmax(row.masked_fill(~keep, -math.inf), -1)
            order = sorted(range(len(row)), key=lambda v: float(p[v]))  # ascending
            mass, drop = 0.0, []
            for v in order:
                mass += float(p[v])
                drop.append(mass <= 1 - cut.top_p)
            drop[-1] = False
            for v, d in zip(order, drop):
                if d:
                    keep[v] = False
        if cut.min_p > 0.0:
            p = torch.softmax(row.masked_fill(~keep, -math.inf), -1)
            small = p < cut.min_p * p.max()
            small[int(p.argmax())] = False
            keep &= ~small
        out[r] = keep
    return out


def transformers_kept(scores: torch.Tensor, cut: Truncation) -> torch.Tensor:
    s = scores.clone()
    if cut.top_k:
        s = TopKLogitsWarper(cut.top_k)(None, s)
    if cut.top_p < 1.0:
        s = TopPLogitsWarper(cut.top_p)(None, s)
    if cut.min_p > 0.0:
        s = MinPLogitsWarper(cut.min_p)(None, s)
    return s > -math.inf


@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_kept_sets_are_the_samplers_rule(cut):
    torch.manual_seed(0)
    scores = torch.randn(16, 50, dtype=torch.float64) * 2
    scores[0, :6] = 9.0  # ties at the top-k boundary: all kept, as transformers keeps them
    scores[1] = 0.0  # a flat row
    mask, brute = kept_mask(scores, cut), brute_kept(scores, cut)
    # Which of tied tokens a top-p cut drops is the sort's choice (transformers' too): the count is the rule's.
    tied = 2 if cut.top_p < 1.0 else 0  # rows 0 and 1 hold ties
    assert torch.equal(mask[tied:], brute[tied:]) and torch.equal(mask.sum(-1), brute.sum(-1))
    warpers = transformers_kept(scores, cut)
    assert torch.equal(mask[tied:], warpers[tied:]) and torch.equal(mask.sum(-1), warpers.sum(-1))
    if cut.top_k == 5:
        assert int(mask[0].sum()) == 6
    labels = torch.randint(0, 50, (16,))
    ids, counts = kept_ids(scores, labels, cut)
    for r in range(16):
        got = set(ids[r, : counts[r]].tolist())
        assert got == set(mask[r].nonzero().flatten().tolist()) | {int(labels[r])}


def test_the_vllm_order_cuts_min_p_first():
    scores = torch.tensor([[4.0, 3.0, 2.9, 2.8, 0.0, -1.0]])
    transformers_order, vllm_order = Truncation(top_k=3, min_p=0.5), Truncation(top_k=3, min_p=0.5, order="vllm")
    assert torch.equal(kept_mask(scores, transformers_order), brute_kept(scores, transformers_order))
    # min-p on the full distribution first, then top-k: the same here, a set of tokens within half of the top's.
    p = torch.softmax(scores[0].double(), -1)
    assert kept_mask(scores, vllm_order)[0].tolist() == ((p >= 0.5 * p.max()) & (scores[0] >= 2.9)).tolist()


def test_a_capped_set_keeps_the_most_probable_tokens_and_the_label():
    scores = torch.zeros(2, 300)
    scores[:, :10] = 1.0
    ids, counts = kept_ids(scores, torch.tensor([299, 3]), Truncation(top_p=0.99, max_kept=20))
    assert counts.tolist() == [21, 21]
    assert set(range(10)) <= set(ids[0].tolist()) and 299 in ids[0].tolist()


def brute_head(hidden, weight, bias, labels, keep, temperature):
    z = (hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())) / temperature
    z_k = z.masked_fill(~keep, -1e30)  # finite: exp underflows to exactly 0, and no 0 * inf in the gradients
    log_p = torch.log_softmax(z_k, -1)
    lp = log_p.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("cut", CUTS, ids=str)
@pytest.mark.parametrize("chunk_size", [0, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_truncated_head_is_the_renormalised_softmax_with_its_gradients(cut, chunk_size, temperature):
    torch.manual_seed(1)
    n, vocab, size = 11, 40, 8
    hidden = torch.randn(n, size, requires_grad=True)
    weight = (torch.randn(vocab, size) * 0.8).requires_grad_()
    bias = (torch.randn(vocab) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    with torch.no_grad():
        z = (hidden @ weight.t() + bias) / temperature
        keep = kept_mask(z, cut)
        keep[torch.arange(n), labels] = True  # the sampled token is always in its set
    ids, counts = kept_ids(z, labels, cut)
    lp, entropy = truncated_head(hidden, weight, bias, labels, ids, counts, chunk_size, temperature)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    lp64, ent64 = brute_head(h64, w64, b64, labels, keep, temperature)
    assert torch.allclose(lp.double(), lp64, atol=1e-5) and torch.allclose(entropy.double(), ent64, atol=1e-5)
    g_lp, g_h = torch.randn(n), torch.randn(n)
    (lp * g_lp + entropy * g_h).sum().backward()
    (lp64 * g_lp.double() + ent64 * g_h.double()).sum().backward()
    for got, want in ((hidden, h64), (weight, w64), (bias, b64)):
        assert torch.allclose(got.grad.double(), want.grad, atol=1e-5), (got.grad - want.grad).abs().max()
    # Without grad, over the given sets or sets derived here: the same numbers, and the untruncated entropy beside.
    given = truncated_head_logprobs(hidden, weight, bias, labels, chunk_size, temperature, ids=ids, counts=counts,
                                    full_entropy=True)  # fmt: skip
    derived = truncated_head_logprobs(hidden, weight, bias, labels, chunk_size, temperature, derive=cut)
    full = -(torch.log_softmax(z.double(), -1).exp() * torch.log_softmax(z.double(), -1)).sum(-1)
    assert torch.allclose(given[0].double(), lp64, atol=1e-5) and torch.allclose(given[2].double(), full, atol=1e-5)
    assert torch.allclose(derived[0].double(), lp64, atol=1e-5)
    for r in range(n):
        assert set(derived[3][r, : derived[4][r]].tolist()) == set(keep[r].nonzero().flatten().tolist())


def test_a_policy_that_moved_is_scored_over_the_replayed_set_not_its_own():
    torch.manual_seed(2)
    hidden, weight, labels = torch.randn(6, 8), torch.randn(30, 8), torch.randint(0, 30, (6,))
    cut = Truncation(top_k=4)
    ids, counts = kept_ids(hidden @ weight.t(), labels, cut)
    moved = weight + 0.5 * torch.randn_like(weight)
    lp, _ = truncated_head(hidden, moved, None, labels, ids, counts, 2)
    z = (hidden @ moved.t()).double()
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.allclose(lp.double(), torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)[range(6), labels], atol=1e-6)
    own = kept_mask(z, cut) | torch.zeros_like(keep).scatter_(1, labels[:, None], True)
    assert not torch.equal(own, keep)  # the moved policy's own sets differ: they are not used


def test_kept_sets_travel_as_csr_and_come_back_per_slot():
    torch.manual_seed(3)
    scores = torch.randn(5, 40)
    labels = torch.randint(0, 40, (5,))
    ids, counts = kept_ids(scores, labels, Truncation(top_p=0.7))
    rows, positions = torch.tensor([0, 0, 2, 3, 3]), torch.tensor([1, 4, 0, 2, 3])
    kept = KeptSets.from_passes(4, 6, [(rows * 6 + positions, ids, counts)], "cpu")
    assert kept.ids.dtype == torch.int32 and kept.ids.numel() == int(counts.sum())
    back, back_counts = kept.for_slots(rows[[3, 0]], positions[[3, 0]])
    assert back_counts.tolist() == counts[[3, 0]].tolist()
    for j, i in enumerate((3, 0)):
        assert back[j, : counts[i]].tolist() == ids[i, : counts[i]].tolist()
    some = kept.select_rows(torch.tensor([3, 0]))
    again, again_counts = some.for_slots(torch.tensor([0, 1]), torch.tensor([2, 1]))
    assert again_counts.tolist() == counts[[3, 0]].tolist() and again[0, : counts[3]].tolist() == ids[3, : counts[3]].tolist()


def test_bf16_weights_sum_the_weight_gradient_in_float32():
    torch.manual_seed(4)
    n, vocab, size = 256, 64, 16
    hidden = torch.randn(n, size, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, size, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    ids, counts = kept_ids((hidden @ weight.t()).float(), labels, Truncation(top_k=10))
    errors = {}
    for chunk in (0, 1):  # one buffer, and 256 chunks of one token
        weight.grad = None
        lp, _ = truncated_head(hidden, weight, None, labels, ids, counts, chunk)
        lp.sum().backward()
        w64 = weight.detach().double().requires_grad_()
        keep = torch.zeros(n, vocab, dtype=torch.bool).scatter_(1, ids, True)
        brute_head(hidden.detach().double(), w64, None, labels, keep, 1.0)[0].sum().backward()
        errors[chunk] = float((weight.grad.double() - w64.grad).abs().max() / w64.grad.abs().max())
    assert errors[1] <= 1.5 * errors[0] + 1e-3, errors
