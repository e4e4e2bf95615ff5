"""The LM head fused with log-probs, entropy and the full KL, chunk by chunk of tokens (docs/memory.md).

The logits ``z = hidden @ W.T + b`` are never held for all N tokens at once: each chunk of C tokens
gets its ``(C, V)`` logits, gives its per-token numbers (log-sum-exp, chosen log-prob, entropy) and is
dropped; the backward recomputes each chunk's logits from the saved head inputs (one more head
product) and forms ``grad_hidden``, ``grad_W`` and ``grad_b`` chunk by chunk. The largest
vocabulary-sized tensor is ``(C, V)``. With a sampling temperature ``T`` every number is that of
``softmax(z / T)`` (docs/algorithm.md section 20); ``T = 1`` runs no division.

Shape names: ``N`` token positions, ``V`` vocabulary, ``H`` hidden size, ``C`` tokens per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The automatic rule (PPOConfig.lm_head_chunk_size=None): one (N, V) float32 buffer up to these bytes -
# faster, no recomputation - and chunks of the second size above them. CPU: a step's w3 buffer (about
# 200 MiB) stays whole; 32 MiB chunks keep the head's products large enough to run at the matrix
# product's speed. CUDA: a GiB is small next to an accelerator's memory; 256 MiB chunks (about 440
# tokens of a 152k vocabulary) keep every product and softmax kernel large.
_ONE_BUFFER_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}
_CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}
_DEFAULT_DEVICE = "cuda"  # other accelerators take the accelerator's numbers


def lm_head_chunk_size(tokens: int, vocab: int, device_type: str, requested: int | None = None) -> int:
    """Tokens per chunk of the fused LM head for passes of up to ``tokens`` positions; 0 = one ``(N, V)`` buffer.

    ``requested`` is ``PPOConfig.lm_head_chunk_size``: 0 or a positive count is returned as given; None
    applies the automatic rule: one buffer while ``tokens * V`` float32 values fit the device's
    one-buffer bytes, else chunks of the device's chunk bytes (at least one token).
    """
    if requested is not None:
        return requested
    row_bytes = 4 * vocab
    if tokens * row_bytes <= _ONE_BUFFER_BYTES.get(device_type, _ONE_BUFFER_BYTES[_DEFAULT_DEVICE]):
        return 0
    return max(1, _CHUNK_BYTES.get(device_type, _CHUNK_BYTES[_DEFAULT_DEVICE]) // row_bytes)


def check_head_options(chunk_size: int = 0, temperature: float = 1.0) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``chunk_size`` (an int >= 0) or ``temperature`` (a finite number > 0)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int >= 0 (0: one buffer), got {chunk_size!r} ({type(chunk_size).__name__}).")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be an int >= 0 (0: one buffer), got {chunk_size}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a finite number > 0, got {temperature!r} ({type(temperature).__name__}).")
    if not (0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")


def head_input(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the dtype the LM head's product runs in: as given under autocast (which casts both
    operands), else the weights' dtype - e.g. float32 hidden states, which accelerate hands back from a
    mixed-precision forward, meeting the bfloat16 head of a checkpoint loaded in bfloat16."""
    if torch.is_autocast_enabled(hidden.device.type) or hidden.dtype == weight.dtype:
        return hidden
    return hidden.to(weight.dtype)


def autocast_state(tensor: torch.Tensor) -> tuple:
    """The autocast state on ``tensor``'s device, for :func:`under_autocast`: a head's backward products run
    under its forward's state, as they would in the model."""
    device_type = tensor.device.type
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


def under_autocast(state: tuple):
    """The block that restores an :func:`autocast_state`."""
    device_type, dtype, enabled = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _chunk_logits(hidden, weight, bias, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``(hidden @ weight.T + bias) / temperature`` of one chunk, written into the first C rows of ``out``.

    The product runs as the model's head would (half precision or autocast, then upcast); ``out`` is
    float32 (float64 for float64 weights). Shape: hidden ``(C, H)`` -> ``(C, V)``.
    """
    z = out[: hidden.shape[0]]
    if hidden.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(hidden.device.type):
        if bias is None:
            torch.mm(hidden, weight.t(), out=z)
        else:
            torch.addmm(bias, hidden, weight.t(), out=z)
    else:
        z.copy_(F.linear(hidden, weight, bias))
    return z if temperature == 1.0 else z.div_(temperature)


def _work_buffers(n: int, chunk_size: int, weight: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` reused ``(min(C, N), V)`` buffers in the logits' dtype: no allocation per chunk."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    shape = (min(chunk_size, n), weight.shape[0])
    return [torch.empty(shape, dtype=dtype, device=weight.device) for _ in range(count)]


class _ChunkedLinearLogProbsAndEntropy(torch.autograd.Function):
    """The LM head, log-probs of chosen tokens and entropy (both differentiable), C tokens at a time.

    Forward per chunk: ``z`` (divided by ``T``), ``lse = logsumexp(z)``, ``lp = z_y - lse`` and
    ``H = -sum_v p_v log p_v``; saved: the head's inputs, ``lse`` and ``H`` (``(N,)`` each). Backward per
    chunk: ``log p = z - lse`` recomputed, ``grad_z = ((onehot - p) g_lp - p (log p + H) g_H) / T``, then
    ``grad_hidden = grad_z W``, ``grad_W += grad_z^T hidden`` and ``grad_b += sum_n grad_z`` (float32
    accumulators for half-precision heads).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature):
        hidden = head_input(hidden, weight)  # saved as the product saw it; the engine casts grad_hidden back
        n = hidden.shape[0]
        flat_labels = labels.reshape(-1, 1)
        z_buf, p_buf = _work_buffers(n, chunk_size, weight, 2)
        logprobs = torch.empty(n, dtype=z_buf.dtype, device=hidden.device)
        log_sum_exp, entropy = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(hidden[rows], weight, bias, temperature, z_buf)
            log_sum_exp[rows] = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(log_sum_exp[rows].unsqueeze(-1))  # the logits are not needed again
            logprobs[rows] = log_p.gather(-1, flat_labels[rows]).squeeze(-1)
            # In place, no matrix-product op: the forward may run under autocast, which would cast one to bf16.
            entropy[rows] = -log_p.mul_(torch.exp(log_p, out=p_buf[: len(z)])).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, flat_labels, log_sum_exp, entropy)
        ctx.chunk_size, ctx.temperature, ctx.autocast = chunk_size, temperature, autocast_state(hidden)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, log_sum_exp, entropy = ctx.saved_tensors
        chunk_size, temperature = ctx.chunk_size, ctx.temperature
        n, dtype = hidden.shape[0], log_sum_exp.dtype
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if want_bias else None
        g_lp = torch.zeros(n, dtype=dtype, device=hidden.device) if grad_logprobs is None else grad_logprobs.to(dtype)
        g_h = None if grad_entropy is None else grad_entropy.to(dtype).reshape(-1, 1)
        z_buf, p_buf = _work_buffers(n, chunk_size, weight, 2)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            with under_autocast(ctx.autocast):  # the forward's logits exactly: its log-sum-exp is reused
                log_p = _chunk_logits(hidden[rows], weight, bias, temperature, z_buf)
            log_p.sub_(log_sum_exp[rows].unsqueeze(-1))
            chunk_g_h = None if g_h is None else g_h[rows]
            grad_z = _logits_grad(log_p, p_buf[: len(log_p)], labels[rows], entropy[rows], g_lp[rows], chunk_g_h)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(weight.dtype)
            with under_autocast(ctx.autocast):
                if want_hidden:
                    grad_hidden[rows] = grad_z @ weight
                if want_weight:
                    _accumulate(grad_weight, grad_z.t(), hidden[rows])
            if want_bias:
                grad_bias += grad_z.sum(0, dtype=dtype)
        grad_weight = grad_weight.to(weight.dtype) if want_weight else None
        grad_bias = grad_bias.to(bias.dtype) if want_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits_grad(log_p, p, labels, entropy, g_lp, g_h) -> torch.Tensor:
    """The gradient of one chunk's logits (before the temperature), written over ``p`` ``(C, V)``.

    ``grad_z = (onehot - p) g_lp - p (log p + H) g_H``. Shapes: labels ``(C, 1)``, entropy, g_lp ``(C,)``,
    g_h ``(C, 1)`` or None (the loss does not use the entropy). ``log_p`` ``(C, V)`` is overwritten too.
    """
    torch.exp(log_p, out=p)
    grad = g_lp.unsqueeze(-1)
    if g_h is None:
        return p.mul_(-grad).scatter_add_(-1, labels, grad)
    scale = -(grad + entropy.unsqueeze(-1) * g_h)
    # p log p is 0 where p underflowed to 0, which xlogy gives and p * log p would not at -inf logits.
    p_log_p = torch.xlogy(p, p, out=log_p)
    return p.mul_(scale).addcmul_(p_log_p, g_h, value=-1.0).scatter_add_(-1, labels, grad)


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right``, in place when the product's dtype is the accumulator's."""
    if left.dtype == right.dtype == total.dtype and not torch.is_autocast_enabled(total.device.type):
        total.addmm_(left, right)
    else:
        total += left @ right


def chunked_logprobs_and_entropy(hidden, weight, bias, labels, chunk_size: int, temperature: float = 1.0):
    """Log-probability of ``labels`` and entropy (both differentiable) under ``softmax((hidden @ W.T + b) / T)``,
    ``chunk_size`` tokens at a time (see :class:`_ChunkedLinearLogProbsAndEntropy`).

    Shapes: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)`` -> two ``(N,)`` tensors
    (float32; float64 for float64 weights).
    """
    return _ChunkedLinearLogProbsAndEntropy.apply(hidden, weight, bias, labels, chunk_size, temperature)


@torch.no_grad()
def chunked_logprobs(hidden, weight, bias, labels, chunk_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax((hidden @ W.T + b) / T)`` without grad, ``chunk_size`` tokens at a time.

    Shapes as in :func:`chunked_logprobs_and_entropy`; returns ``(N,)``.
    """
    hidden = head_input(hidden, weight)
    (z_buf,) = _work_buffers(hidden.shape[0], chunk_size, weight, 1)
    out = torch.empty(hidden.shape[0], dtype=z_buf.dtype, device=hidden.device)
    flat_labels = labels.reshape(-1, 1)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        z = _chunk_logits(hidden[rows], weight, bias, temperature, z_buf)
        out[rows] = z.gather(-1, flat_labels[rows]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return out


@torch.no_grad()
def full_kl_from_hidden(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, chunk_size: int,
                        temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Exact ``KL(p || q)`` per token between the policy's head ``p = softmax((hidden @ W.T + b) / T)`` and the
    reference's ``q`` (its own head inputs and head), ``chunk_size`` tokens at a time, without grad.

    ``sum_v p(v) (log p(v) - log q(v))`` (docs/algorithm.md section 4, ``kl_penalty="full"``).
    Shapes: hidden, ref_hidden ``(N, H)`` (or the reference's ``H``), weights ``(V, H)``, biases ``(V,)`` or None
    -> ``(N,)``.
    """
    check_head_options(chunk_size, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int for full_kl_from_hidden, got {chunk_size}.")
    hidden, ref_hidden = head_input(hidden, weight), head_input(ref_hidden, ref_weight)
    n = hidden.shape[0]
    (z_buf,) = _work_buffers(n, chunk_size, weight, 1)
    (q_buf,) = _work_buffers(n, chunk_size, ref_weight, 1)
    out = torch.empty(n, dtype=z_buf.dtype, device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        log_p = torch.log_softmax(_chunk_logits(hidden[rows], weight, bias, temperature, z_buf), dim=-1)
        log_q = _chunk_logits(ref_hidden[rows], ref_weight, ref_bias, temperature, q_buf)
        log_q = log_q.sub_(torch.logsumexp(log_q, dim=-1, keepdim=True)).neg_().add_(log_p)  # log p - log q
        out[rows] = log_q.mul_(log_p.exp_()).sum(-1)  # not vecdot: autocast would run it in half precision
    return out
