"""The chunked LM head's running sums with half-precision weights (issue 59 item 2): grad_hidden summed over 256
vocabulary slices and dW over 256 token chunks, against float64 autograd, within 1.5x of the one-buffer path's
error (which forms each gradient in one product) - for bfloat16 and float16."""

import pytest
import torch

from trl_lite.core.lm_head import by_vocabulary, linear_head, vocab_slice_width


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def errors(n, vocab, size, chunk, dtype, seed=0):
    """(grad_hidden, grad_weight) errors of the head at ``chunk`` against float64 autograd."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, size, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, size, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    lp, entropy = linear_head(hidden, weight, None, labels, chunk)
    (lp * g_lp + entropy * g_h).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    log_p = torch.log_softmax(h64 @ w64.t(), -1)
    lp64, ent64 = log_p[torch.arange(n), labels], -(log_p.exp() * log_p).sum(-1)
    (lp64 * g_lp.double() + ent64 * g_h.double()).sum().backward()
    return relative_error(hidden.grad, h64.grad), relative_error(weight.grad, w64.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_hidden_over_256_vocabulary_slices_is_summed_in_float32(dtype):
    n, vocab, size, chunk = 256, 2048, 64, 1
    assert by_vocabulary(n, vocab) and -(-vocab // vocab_slice_width(n, vocab, chunk)) == 256
    sliced, one = errors(n, vocab, size, chunk, dtype)[0], errors(n, vocab, size, 0, dtype)[0]
    assert sliced <= 1.5 * one, (sliced, one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dw_over_256_token_chunks_is_summed_in_float32(dtype):
    n, vocab, size, chunk = 512, 256, 64, 2
    assert not by_vocabulary(n, vocab) and n // chunk == 256
    chunked, one = errors(n, vocab, size, chunk, dtype)[1], errors(n, vocab, size, 0, dtype)[1]
    assert chunked <= 1.5 * one, (chunked, one)
