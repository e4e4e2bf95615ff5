"""Log-probabilities and entropies of chosen tokens: from logits, or fused with a linear LM head.

Shape names: ``N`` rows (token positions), ``V`` vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lm_head import (
    autocast_state,
    check_head_options,
    chunked_logprobs,
    chunked_logprobs_and_entropy,
    head_input,
    under_autocast,
)

# Vocabulary-sized work runs a few rows at a time. On CPU a chunk of about 2 MiB stays in cache,
# which makes the softmax kernels about twice as fast as one pass over a (rows, V) tensor, and the
# transient float32 copies stay small; accelerators get large chunks (few kernel launches).
_CHUNK_BYTES = {"cpu": 2 << 20}
_DEFAULT_CHUNK_BYTES = 256 << 20


def _chunk_rows(logits: torch.Tensor) -> int:
    """How many ``(V,)`` rows of ``logits`` one chunk of the vocabulary reductions holds."""
    budget = _CHUNK_BYTES.get(logits.device.type, _DEFAULT_CHUNK_BYTES)
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
        # The saved softmax is not needed again: its memory becomes the gradient.
        grad_logits = _softmax_to_grad(probs, labels, entropy, grad_logprobs, grad_entropy, ctx.temperature)
        return grad_logits.to(ctx.logits_dtype).reshape(ctx.logits_shape), None, None


def _softmax_to_grad(probs, labels, entropy, grad_logprobs, grad_entropy, temperature: float) -> torch.Tensor:
    """The logits' gradient, written over the softmax ``probs`` ``(N, V)`` in place.

    ``grad_z = ((onehot - p) g_lp - p (log p + H) g_H) / T``, i.e. ``(-p (g_lp + H g_H) - xlogy(p, p) g_H
    + onehot g_lp) / T``; either incoming gradient may be None (its output was not used by the loss).
    """
    grad_logits = _softmax_grad(probs, labels, entropy, grad_logprobs, grad_entropy)
    return grad_logits if temperature == 1.0 else grad_logits.div_(temperature)


def _softmax_grad(probs, labels, entropy, grad_logprobs, grad_entropy) -> torch.Tensor:
    """:func:`_softmax_to_grad` at temperature 1."""
    n = probs.shape[0]
    if grad_logprobs is None:
        grad_logprobs = torch.zeros(n, dtype=probs.dtype, device=probs.device)
    grad = grad_logprobs.reshape(-1, 1).to(probs.dtype)
    if grad_entropy is None:
        return probs.mul_(-grad).scatter_add_(-1, labels, grad)
    grad_h = grad_entropy.reshape(-1, 1).to(probs.dtype)
    scale = -(grad + entropy.reshape(-1, 1) * grad_h)
    step = _chunk_rows(probs)
    p_log_p = torch.empty((min(step, n), probs.shape[1]), dtype=probs.dtype, device=probs.device)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        p = probs[rows]
        # p log p is 0 where p underflowed to 0, which xlogy gives and p * log(p) would not.
        chunk = torch.xlogy(p, p, out=p_log_p[: len(p)])
        p.mul_(scale[rows]).addcmul_(chunk, grad_h[rows], value=-1.0)
    return probs.scatter_add_(-1, labels, grad)


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


def _lm_head_logits(hidden, weight, bias, buffer_rows: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``hidden @ weight.T + bias`` in float32 (float64 for float64 inputs), ``(N, V)``.

    The result is the first N rows of ``out`` when given, else a view of a fresh
    ``(max(N, buffer_rows), V)`` allocation. Callers that give every call of a step the same
    ``buffer_rows`` make all these allocations the same size, so the memory one mini-batch frees
    fits the next; reusing one ``out`` allocates nothing at all.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    n, vocab = hidden.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((max(n, buffer_rows or 0), vocab), dtype=dtype, device=hidden.device)
    elif out.dim() != 2 or out.shape[0] < n or (out.shape[1], out.dtype, out.device) != (vocab, dtype, hidden.device):
        raise ValueError(
            f"out must be a ({n} or more, {vocab}) {dtype} tensor on {hidden.device} for these logits, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    logits = out[:n]
    hidden = head_input(hidden, weight)
    if hidden.dtype == weight.dtype == dtype and not torch.is_autocast_enabled(hidden.device.type):
        if bias is None:
            return torch.mm(hidden, weight.t(), out=logits)
        return torch.addmm(bias, hidden, weight.t(), out=logits)
    # Half precision or autocast: the product in the dtype the model's LM head would use, then upcast.
    return logits.copy_(F.linear(hidden, weight, bias))


class _LinearLogProbsAndEntropy(torch.autograd.Function):
    """The LM head, log-probs of chosen tokens and entropy (both differentiable) in one buffer.

    Forward: the logits go into one ``(N, V)`` buffer, which becomes the softmax chunk by chunk
    (a cache-sized log-softmax, the chosen log-probs and entropy taken from it, then its
    exponential written back). That buffer is all the backward keeps besides the head's inputs:
    ``grad_z = (onehot - p) g_lp - p (log p + H) g_H`` is formed in place, then
    ``grad_hidden = grad_z W``, ``grad_W = grad_z^T hidden`` and ``grad_b = sum_n grad_z``.
    Composing the LM head with :class:`_LogProbsAndEntropy` instead keeps the logits and the
    softmax, two ``(N, V)`` tensors.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, buffer_rows, out, temperature):
        # Saved as the product saw it; the engine casts grad_hidden back to the input's dtype.
        hidden = head_input(hidden, weight)
        probs = _scaled_in_place(_lm_head_logits(hidden, weight, bias, buffer_rows, out), temperature)
        dtype, n = probs.dtype, probs.shape[0]
        flat_labels = labels.reshape(-1, 1)
        logprobs = torch.empty(n, dtype=dtype, device=probs.device)
        entropy = torch.empty_like(logprobs)
        step = _chunk_rows(probs)
        log_p = torch.empty((min(step, n), probs.shape[1]), dtype=dtype, device=probs.device)  # reused per chunk
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z, chunk_log_p = probs[rows], log_p[: len(probs[rows])]
            torch.log_softmax(z, dim=-1, out=chunk_log_p)
            logprobs[rows] = chunk_log_p.gather(-1, flat_labels[rows]).squeeze(-1)
            p = torch.exp(chunk_log_p, out=z)  # the logits of this chunk are not needed again
            entropy[rows] = -chunk_log_p.mul_(p).sum(-1)  # the log-probs are not needed again either
        ctx.save_for_backward(hidden, weight, bias, probs, flat_labels, entropy)
        ctx.temperature, ctx.autocast = temperature, autocast_state(hidden)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, probs, labels, entropy = ctx.saved_tensors
        # The saved softmax is not needed again: its memory becomes the logits' gradient, which
        # goes back through the upcast (to the model's dtype) and the linear map.
        grad_logits = _softmax_to_grad(probs, labels, entropy, grad_logprobs, grad_entropy, ctx.temperature)
        grad_logits = grad_logits.to(weight.dtype)
        with under_autocast(ctx.autocast):
            grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
            grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _scaled_in_place(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z`` divided by ``temperature`` in place; untouched at temperature 1."""
    return z if temperature == 1.0 else z.div_(temperature)


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
    ``k`` tokens at a time with the logits recomputed in the backward (:mod:`.lm_head`; ``buffer_rows``
    and ``out`` unused).
    Shapes: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)`` -> two ``(N,)`` tensors.
    """
    check_head_options(chunk_size, temperature)
    if chunk_size:
        return chunked_logprobs_and_entropy(hidden, weight, bias, labels, chunk_size, temperature)
    return _LinearLogProbsAndEntropy.apply(hidden, weight, bias, labels, buffer_rows, out, temperature)


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
        return logprobs_and_entropy_from_hidden(hidden, weight, bias, labels, buffer_rows, out, chunk_size, temperature)[0]
    check_head_options(chunk_size, temperature)
    if chunk_size:
        return chunked_logprobs(hidden, weight, bias, labels, chunk_size, temperature)
    return logprobs_from_logits(_lm_head_logits(hidden, weight, bias, buffer_rows, out), labels, temperature=temperature)


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
