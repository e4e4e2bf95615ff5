"""The chunked LM head's backward over slices of the vocabulary (``core.lm_head``, docs/memory.md), taken when a
pass has fewer tokens than the vocabulary, and the CPU's head product in blocks of vocabulary columns.

Gradients of hidden, W and b against float64 autograd on a plain ``log_softmax(z / T)``, for slices and token
chunks that do and do not divide the vocabulary and the tokens; bf16 weights and autocast; the memory bound (no
tensor above a chunk's logits) and the weight gradient written once, not summed chunk after chunk.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trl_lite.core.lm_head as lm_head_module
from trl_lite import core


def _leaves(dtype, rows, vocab, hidden_size=5, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    # Labels in the first and the last slice too: the one-hot term at both ends of the vocabulary.
    labels[0], labels[-1] = 0, vocab - 1
    return hidden, weight, b, labels


def _reference_grads(hidden, weight, b, labels, temperature, a, c):
    """Float64 autograd of ``sum(a * lp + c * H)`` under the textbook ``log_softmax((h W^T + b) / T)``."""
    leaves = [t.detach().double().requires_grad_(True) for t in (hidden, weight, b) if t is not None]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if b is not None else 0.0)
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    lp, entropy = log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    total = sum((w * x).sum() for w, x in ((a, lp), (c, entropy)) if w is not None)
    return lp.detach(), entropy.detach(), torch.autograd.grad(total, leaves)


def _head_grads(hidden, weight, b, labels, chunk, temperature, a, c):
    lp, entropy = core.logprobs_and_entropy_from_hidden(
        hidden, weight, b, labels, chunk_size=chunk, temperature=temperature
    )
    total = sum((w.to(x.dtype) * x).sum() for w, x in ((a, lp), (c, entropy)) if w is not None)
    return lp, entropy, torch.autograd.grad(total, [t for t in (hidden, weight, b) if t is not None])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
# (tokens, chunk): slices of 15 (dividing 60, token chunks dividing 12), 4, 18, 23 and 60 columns (one slice).
@pytest.mark.parametrize("rows, chunk", [(12, 3), (13, 1), (13, 4), (13, 5), (13, 13)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("bias", [False, True])
def test_vocabulary_sliced_backward_matches_float64_autograd(dtype, rows, chunk, temperature, bias):
    vocab = 60
    hidden, weight, b, labels = _leaves(dtype, rows, vocab, bias=bias, seed=rows + chunk)
    assert core.lm_head.by_vocabulary(rows, vocab)
    assert core.lm_head.vocab_slice_width(rows, vocab, chunk) == {3: 15, 1: 4, 4: 18, 5: 23, 13: 60}[chunk]
    g = torch.Generator().manual_seed(3)
    a, c = (torch.randn(rows, generator=g, dtype=torch.float64) for _ in range(2))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # The loss may use both outputs, only the log-probs, or only the entropy.
    for coefs in ((a, c), (a, None), (None, c)):
        lp, entropy, got = _head_grads(hidden, weight, b, labels, chunk, temperature, *coefs)
        ref_lp, ref_entropy, want = _reference_grads(hidden, weight, b, labels, temperature, *coefs)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=tol)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=tol)
        for x, y in zip(got, want):
            assert x.dtype == dtype
            torch.testing.assert_close(x.double(), y, rtol=tol, atol=tol)


def test_cpu_head_product_in_column_blocks_is_exact():
    # 2,500 columns: two full 1,024-column blocks of the product and a partial one, with and without a bias.
    vocab = 2500
    assert lm_head_module._PRODUCT_COLUMNS["cpu"] < vocab
    for bias, chunk in ((True, 0), (False, 0), (True, 4), (False, 7)):
        hidden, weight, b, labels = _leaves(torch.float64, 9, vocab, bias=bias, seed=20 + chunk)
        a = torch.linspace(-1, 1, 9, dtype=torch.float64)
        lp, entropy, got = _head_grads(hidden, weight, b, labels, chunk, 0.8, a, a.flip(0))
        ref_lp, ref_entropy, want = _reference_grads(hidden, weight, b, labels, 0.8, a, a.flip(0))
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-12)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_bf16_weights_and_autocast_in_vocabulary_slices():
    # bf16 weights: products in bf16 (the model's), gradients back in bf16; 4 slices of 15 columns.
    hidden, weight, b, labels = _leaves(torch.bfloat16, 12, 60, seed=30)
    a = torch.linspace(-1, 1, 12, dtype=torch.float64)
    _, _, got = _head_grads(hidden, weight, b, labels, 3, 0.7, a, 0.3 * a)
    _, _, want = _reference_grads(hidden, weight, b, labels, 0.7, a, 0.3 * a)
    for x, y in zip(got, want):
        assert x.dtype == torch.bfloat16
        # bf16 inputs of each product and grad_hidden summed in bf16 over 4 slices: a few bf16 roundings.
        torch.testing.assert_close(x.double(), y, rtol=2**-5, atol=5e-2)
    # Under autocast a float32 head's products run in bf16 in both paths: the slices round the same operands as
    # the one buffer's product and sum in float32, so they agree up to one bf16 rounding of its result.
    hidden, weight, _, labels = _leaves(torch.float32, 24, 300, bias=False, seed=31)
    results = []
    for chunk in (0, 5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, None, labels, chunk_size=chunk)
        results.append(torch.autograd.grad(lp.sum() + 0.1 * entropy.sum(), (hidden, weight)))
    assert core.lm_head.by_vocabulary(24, 300)
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=2**-7, atol=1e-3)


class _Outputs(TorchDispatchMode):
    """Records the size of every tensor an op returns but the aliases autograd makes of a leaf's gradient."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and func is not torch.ops.aten.detach.default:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_slices_keep_the_chunk_bound_and_write_the_weight_gradient_once(dtype):
    # 16 tokens, a vocabulary of 400 in slices of 4 x 400 / 16 = 100 columns: no tensor above a chunk's logits, and
    # no op returns the whole (V, H) weight gradient but its one allocation - the token chunks summed into it once
    # per chunk (4 times here), each a read and a write of all of it.
    rows, vocab, hidden_size, chunk = 16, 400, 8, 4
    hidden, weight, b, labels = _leaves(dtype, rows, vocab, hidden_size, seed=40)
    lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, chunk_size=chunk)
    with _Outputs() as mode:
        (lp.sum() + 0.5 * entropy.sum()).backward()
    assert max(mode.sizes) <= max(chunk * vocab, vocab * hidden_size)
    assert sum(size == vocab * hidden_size for size in mode.sizes) == 1
    assert weight.grad.dtype == dtype and weight.grad.shape == (vocab, hidden_size)


def test_the_backward_slices_whichever_running_sum_is_smaller_within_the_chunk_bound():
    # Fewer tokens than words: slices of the vocabulary (the (N, H) grad_hidden summed); else token chunks (dW).
    assert core.lm_head.by_vocabulary(12, 60) and core.lm_head.by_vocabulary(1600, 151_936)
    assert not core.lm_head.by_vocabulary(23, 17) and not core.lm_head.by_vocabulary(60, 60)
    vocab, width = 151_936, core.lm_head.vocab_slice_width
    # CPU: 16 MiB of float32 logits (2,621 columns of 1,600 tokens), below the chunk's 110 x V logits.
    assert width(1600, vocab, 110, "cpu") == (16 << 20) // (4 * 1600) == 2621
    # CUDA: as many logits as a chunk (441 tokens), no cache cap.
    assert width(1600, vocab, 441, "cuda") == 441 * vocab // 1600
    # Many tokens: the chunk's bytes bound the slice, even below the CPU's 256-column floor; never 0 columns.
    assert width(100_000, vocab, 110, "cpu") == 110 * vocab // 100_000 == 167
    assert width(10**9, vocab, 1, "cpu") == 1
    assert width(5, 60, 64, "cpu") == 60  # a chunk larger than the pass: one slice
