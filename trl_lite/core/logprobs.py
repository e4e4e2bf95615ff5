"""Log-probabilities and entropies of chosen tokens: from logits, or fused with a linear LM head.

Shape names: ``N`` rows (token positions), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import lm_head
from .lm_head import check_head_options, linear_head, linear_head_logprobs, softmax_grad_



def _chunk_rows(logits: torch.Tensor) -> int:
    """How many ``(V,)`` float32 rows of ``logits`` one cache-sized piece of the vocabulary reductions holds: the
    LM head's cache bytes (:data:`.lm_head._CACHE_BYTES`; on CPU about 2 MiB stays in cache, which makes the softmax
    kernels about twice as fast as one pass over a ``(rows, V)`` tensor; accelerators take large pieces). The one
    ``_CHUNK_BYTES`` is the LM head's tokens-per-chunk rule."""
    budget = lm_head._CACHE_BYTES.get(logits.device.type, lm_head._DEFAULT_CACHE_BYTES)
    return max(1, budget // (4 * logits.shape[-1]))


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, gather: bool = True, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``: the chosen (scaled) logit minus the
    log-sum-exp of its row.

    Evaluated a few rows at a time (a fused log-softmax per chunk, then a gather), so no
    full-vocabulary copy is made; half-precision logits are upcast to float32 chunk by chunk.
    With ``gather=False`` the full log-softmax is returned instead.

    Shape: logits ``(..., V)``, labels ``(...)`` -> ``(...)`` (``(..., V)`` without gather).
    """
    check_head_options(temperature=temperature)
    if not gather:
        return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1)
    out = flat.new_empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32))
    step = _chunk_rows(flat)
    for start in range(0, flat.shape[0], step):
        rows = slice(start, start + step)
        # One expression, so the chunk's log-softmax is freed before the next one is allocated.
        out[rows] = F.log_softmax(_scaled(flat[rows].to(out.dtype), temperature), dim=-1).gather(
            -1, flat_labels[rows]
        ).squeeze(-1)
    return out.reshape(labels.shape)


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z / temperature`` as a new tensor; ``z`` itself at temperature 1 (no extra op)."""
    return z if temperature == 1.0 else z / temperature


class _LogProbsAndEntropy(torch.autograd.Function):
    """Log-probs of chosen tokens and the entropy, both differentiable, from one softmax.

    Per chunk of rows: one fused log-softmax written straight into the saved buffer, the chosen
    log-probs gathered from it, then exponentiated in place. That softmax is what the backward
    needs (``d lp / d z = onehot - p``, ``d H / d z = -p (log p + H)``) and gives the entropy
    (``H = logsumexp(z) - sum_v p_v z_v``) for free, so the vocabulary is exponentiated once per
    training forward instead of three times (log-sum-exp, its backward, entropy). The entropy's
    gradient costs one more pass over the softmax, and only when a loss uses the entropy.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        flat = logits.reshape(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1, 1)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        probs = torch.empty(flat.shape, dtype=dtype, device=flat.device)
        logprobs = torch.empty(flat.shape[0], dtype=dtype, device=flat.device)
        entropy = torch.empty_like(logprobs)
        step = _chunk_rows(flat)
        product = torch.empty((min(step, flat.shape[0]), flat.shape[1]), dtype=dtype, device=flat.device)
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            z, p, target = _scaled(flat[rows].to(dtype), temperature), probs[rows], flat_labels[rows]
            torch.log_softmax(z, dim=-1, out=p)
            logprobs[rows] = p.gather(-1, target).squeeze(-1)
            log_sum_exp = z.gather(-1, target).squeeze(-1) - logprobs[rows]
            # sum_v p_v z_v through one reused buffer: no chunk-sized temporary per chunk.
            p_times_z = torch.mul(p.exp_(), z, out=product[: len(p)])
            entropy[rows] = log_sum_exp - p_times_z.sum(-1)
        ctx.save_for_backward(probs, flat_labels, entropy)
        ctx.logits_shape, ctx.logits_dtype, ctx.temperature = logits.shape, logits.dtype, temperature
        ctx.set_materialize_grads(False)
        return logprobs.reshape(labels.shape), entropy.reshape(labels.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        probs, labels, entropy = ctx.saved_tensors
        # The saved softmax is not needed again: its memory becomes the gradient (the LM head's formula).
        grad_logits = softmax_grad_(probs, labels, entropy, grad_logprobs, grad_entropy, ctx.temperature, None)
        return grad_logits.to(ctx.logits_dtype).reshape(ctx.logits_shape), None, None


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy in nats under ``softmax(logits / temperature)``, both
    differentiable, from one softmax.

    Use it where the entropy (a statistic, or the bonus of ``entropy_coef``) is wanted next to
    log-probs that need grad; the entropy's backward runs only when a loss uses it.
    Shape: logits ``(..., V)``, labels ``(...)`` -> two ``(...)`` tensors.
    """
    check_head_options(temperature=temperature)
    return _LogProbsAndEntropy.apply(logits, labels, temperature)


def logprobs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    buffer_rows: int | None = None,
    out: torch.Tensor | None = None,
    chunk_size: int = 0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy (both differentiable) under a linear LM head.

    The same values as :func:`logprobs_and_entropy_from_logits` on ``hidden @ weight.T + bias``
    (upcast to float32) at ``temperature``; gradients reach ``hidden``, ``weight`` and ``bias``.
    ``chunk_size`` 0: one vocabulary-sized buffer instead of two, kept until the backward - allocated
    for at least ``buffer_rows`` rows, or the first N rows of ``out`` (float32, ``(R >= N, V)``), which
    may be reused only after the backward has run. ``chunk_size`` k > 0: no ``(N, V)`` tensor at all,
    ``k`` tokens at a time with the logits recomputed in the backward (:func:`.lm_head.linear_head`).
    Shapes: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)`` -> two ``(N,)`` tensors.
    """
    return linear_head(hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    buffer_rows: int | None = None,
    out: torch.Tensor | None = None,
    chunk_size: int = 0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of ``labels`` under the linear LM head ``hidden @ weight.T + bias`` at ``temperature``.

    :func:`logprobs_from_logits` of the float32 logits, built in one buffer (``buffer_rows`` and
    ``out`` as in :func:`logprobs_and_entropy_from_hidden`) or ``chunk_size`` tokens at a time;
    differentiable when grad is enabled.
    Shapes as in :func:`logprobs_and_entropy_from_hidden`; returns ``(N,)``.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return linear_head(hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out)[0]
    return linear_head_logprobs(hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position, in nats.

    ``H = -sum_v p_v log p_v``, evaluated in row chunks so the softmax copies stay small.
    Shape: ``(..., V)`` -> ``(...)``.
    """
    check_head_options(temperature=temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    step = _chunk_rows(flat)
    for start in range(0, flat.shape[0], step):
        logp = F.log_softmax(_scaled(flat[start : start + step].to(out.dtype), temperature), -1)
        out[start : start + step] = -torch.linalg.vecdot(logp.exp(), logp)
    return out.reshape(logits.shape[:-1])


def full_kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact KL(p || q) between ``p = softmax(logits / temperature)`` and ``q = softmax(ref_logits / temperature)``.

    ``sum_v p(v) (log p(v) - log q(v))``, in row chunks. Shape: ``(..., V)`` twice -> ``(...)``.
    """
    check_head_options(temperature=temperature)
    flat_p = logits.reshape(-1, logits.shape[-1])
    flat_q = ref_logits.reshape(-1, ref_logits.shape[-1])
    out = torch.empty(flat_p.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    step = _chunk_rows(flat_p)
    for start in range(0, flat_p.shape[0], step):
        logp = F.log_softmax(_scaled(flat_p[start : start + step].to(out.dtype), temperature), -1)
        logq = F.log_softmax(_scaled(flat_q[start : start + step].to(out.dtype), temperature), -1)
        out[start : start + step] = torch.linalg.vecdot(logp.exp(), logp - logq)
    return out.reshape(logits.shape[:-1])
