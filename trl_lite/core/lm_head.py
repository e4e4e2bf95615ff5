"""The LM head fused with log-probs, entropy and the full KL: one path for every pass (docs/memory.md).

A pass gives the head's inputs ``h`` and gets per-token numbers - the chosen log-prob, the entropy -
without the model's ``(N, V)`` logits: :func:`linear_head` (with grad) and :func:`linear_head_logprobs`
(without) compute ``z = (h W^T + b) / T`` either in one ``(N, V)`` float32 buffer (``chunk_size`` 0: it
becomes the softmax in place and then the logits' gradient, nothing recomputed) or ``C`` tokens at a time
(``chunk_size`` C: each chunk's ``(C, V)`` logits give their numbers and are dropped; the backward
recomputes them from the saved head inputs and each token's log-sum-exp, over slices of the vocabulary of as
many logits when the pass has fewer tokens than the vocabulary, else chunk by chunk). Either way the vocabulary
work (log-softmax, exponential, entropy, gradient) runs over cache-sized pieces of rows, and one gradient formula
(:func:`softmax_grad_`) serves every path, the logits' one of :mod:`.logprobs` included. ``dW`` is formed in the
weight's own gradient, slice by slice or chunk after chunk in place: no weight-sized temporary (a half-precision
weight's running sums, ``grad_hidden`` over slices and ``dW`` over chunks, are float32: issue 59 item 2). With a sampling
temperature ``T`` every number is that of ``softmax(z / T)`` (docs/algorithm.md section 20); ``T = 1`` runs no
division.

Shape names: ``N`` token positions, ``V`` vocabulary, ``H`` hidden size, ``C`` tokens per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The automatic rule (PPOConfig.lm_head_chunk_size=None): one (N, V) float32 buffer up to these bytes -
# no recomputation - and chunks of the second size above them. CPU: a step's w3 buffer (about 200 MiB)
# stays whole; 64 MiB chunks (110 tokens of a 152k vocabulary) keep the Python loop short and the head's
# products large. CUDA: a GiB is small next to an accelerator's memory; 256 MiB chunks (about 440 tokens
# of a 152k vocabulary) keep every product and softmax kernel large.
_ONE_BUFFER_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}
_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}
# The vocabulary work runs over pieces of rows of these bytes: on the CPU about 2 MiB stays in cache, which
# makes the softmax kernels about twice as fast as one pass over a (C, V) block; accelerators take large pieces
# (few kernel launches), which bound the scratch of one buffer's log-softmax.
_CACHE_BYTES = {"cpu": 2 << 20}
# The CPU's head product runs over blocks of this many vocabulary columns (each (H, 1024) piece of W^T stays in
# cache while every token meets it): about 20% faster than one product at 110 tokens of a 152k vocabulary.
_PRODUCT_COLUMNS = {"cpu": 1024}
_SLICE_BYTES = {"cpu": 16 << 20}  # see vocab_slice_width
_DEFAULT_CACHE_BYTES = 256 << 20
_DEFAULT_DEVICE = "cuda"  # other accelerators take the accelerator's numbers


def lm_head_chunk_size(tokens: int, vocab: int, device_type: str, requested: int | None = None,
                       backed_off: bool = False, weight_dtype: torch.dtype = torch.float32) -> int:  # fmt: skip
    """Tokens per chunk of the fused LM head for passes of up to ``tokens`` positions; 0 = one ``(N, V)`` buffer.

    ``requested`` is ``PPOConfig.lm_head_chunk_size``: 0 or a positive count is returned as given. None applies
    the automatic rule, which counts the bytes each path adds to the pass besides the ``(V, H)`` weight gradient
    (both paths form it in place, :func:`linear_head`): one buffer adds ``tokens x V`` float32 logits, plus the
    same count in the weight's dtype for its gradient cast when the weight is not float32; it is taken while
    that fits the device's one-buffer bytes - and never after an out-of-memory back-off (``backed_off``): a pass
    that ran out of memory takes chunks, however few tokens the back-off leaves. Else chunks of the device's
    chunk bytes (at least one token).
    """
    if requested is not None:
        return requested
    row_bytes = 4 * vocab
    cast = 0 if weight_dtype in (torch.float32, torch.float64) else torch.empty((), dtype=weight_dtype).element_size()
    one_buffer = tokens * vocab * (4 + cast)
    if not backed_off and one_buffer <= _ONE_BUFFER_BYTES.get(device_type, _ONE_BUFFER_BYTES[_DEFAULT_DEVICE]):
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


def cache_rows(rows: torch.Tensor) -> int:
    """How many ``(V,)`` rows of ``rows`` ``(R, V)`` one cache-sized piece of the vocabulary work holds."""
    budget = _CACHE_BYTES.get(rows.device.type, _DEFAULT_CACHE_BYTES)
    return max(1, budget // (rows.element_size() * rows.shape[-1]))


def _logits_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


def _lm_head_logits(hidden, weight, bias, buffer_rows: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The one buffer: logits ``hidden @ weight.T + bias`` in float32 (float64 for float64 inputs), ``(N, V)``.

    The result is the first N rows of ``out`` when given, else a view of a fresh
    ``(max(N, buffer_rows), V)`` allocation. Callers that give every call of a step the same
    ``buffer_rows`` make all these allocations the same size, so the memory one mini-batch frees
    fits the next; reusing one ``out`` allocates nothing at all.
    """
    dtype, n, vocab = _logits_dtype(weight), hidden.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((max(n, buffer_rows or 0), vocab), dtype=dtype, device=hidden.device)
    elif out.dim() != 2 or out.shape[0] < n or (out.shape[1], out.dtype, out.device) != (vocab, dtype, hidden.device):
        raise ValueError(
            f"out must be a ({n} or more, {vocab}) {dtype} tensor on {hidden.device} for these logits, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return _chunk_logits(head_input(hidden, weight), weight, bias, 1.0, out)


def _chunk_logits(hidden, weight, bias, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``(hidden @ weight.T + bias) / temperature`` of one chunk, written into the first C rows of ``out``.

    The product runs as the model's head would (half precision or autocast, then upcast); ``out`` is
    float32 (float64 for float64 weights). Shape: hidden ``(C, H)`` -> ``(C, V)``.
    """
    z = out[: hidden.shape[0]]
    if hidden.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(hidden.device.type):
        step = _PRODUCT_COLUMNS.get(hidden.device.type) or weight.shape[0]
        for start in range(0, weight.shape[0], step):
            cols = slice(start, start + step)
            if bias is None:
                torch.mm(hidden, weight[cols].t(), out=z[:, cols])
            else:
                torch.addmm(bias[cols], hidden, weight[cols].t(), out=z[:, cols])
    else:
        z.copy_(F.linear(hidden, weight, bias))
    return z if temperature == 1.0 else z.div_(temperature)


def _work_buffer(n: int, chunk_size: int, weight: torch.Tensor) -> torch.Tensor:
    """One reused ``(min(C, N), V)`` buffer in the logits' dtype: no allocation per chunk."""
    return torch.empty((min(chunk_size, n), weight.shape[0]), dtype=_logits_dtype(weight), device=weight.device)


def _scratch(block: torch.Tensor) -> torch.Tensor:
    """One cache-sized ``(S, V)`` buffer for the vocabulary work over ``block`` ``(R, V)``."""
    # At least one row: a slice of a cut pass can hold no token, and a loop's step must not be 0.
    return block.new_empty((max(1, min(cache_rows(block), block.shape[0])), block.shape[1]))


def _softmax_stats(z, labels, logprobs, entropy, log_sum_exp, scratch) -> None:
    """Per token of ``z`` ``(R, V)``: the chosen log-prob into ``logprobs`` ``(R,)``, and when not None the entropy
    and the log-sum-exp; with the entropy, ``z`` becomes the softmax in place (the one buffer's saved tensor).

    Cache-sized pieces: one fused log-softmax into ``scratch``, the gather, then ``p = exp(log p)`` over ``z``
    and ``H = -sum_v p_v log p_v``.
    """
    step = scratch.shape[0]
    for start in range(0, z.shape[0], step):
        rows = slice(start, start + step)
        piece, target = z[rows], labels[rows]
        log_p = torch.log_softmax(piece, dim=-1, out=scratch[: piece.shape[0]])
        logprobs[rows] = log_p.gather(-1, target).squeeze(-1)
        if log_sum_exp is not None:
            log_sum_exp[rows] = piece.gather(-1, target).squeeze(-1) - logprobs[rows]
        if entropy is not None:
            entropy[rows] = -log_p.mul_(torch.exp(log_p, out=piece)).sum(-1)


def softmax_grad_(probs, labels, entropy, grad_logprobs, grad_entropy, temperature: float, scratch,
                  log_sum_exp: torch.Tensor | None = None, vocab_start: int | None = None) -> torch.Tensor:  # fmt: skip
    """The gradient of the logits ``z`` (before the division by ``T``), written over the softmax ``probs`` ``(R, V)``.

    ``grad_z = ((onehot - p) g_lp - p (log p + H) g_H) / T``, i.e. ``(-p (g_lp + H g_H) - xlogy(p, p) g_H
    + onehot g_lp) / T``. Shapes: labels ``(R, 1)``, entropy ``(R,)``; either incoming gradient ``(R,)`` may be
    None (its output was not used by the loss). With ``log_sum_exp`` ``(R,)``, ``probs`` holds the logits ``z / T``
    and becomes ``p = exp(z / T - lse)`` in the same pass. With ``vocab_start``, ``probs`` ``(R, W)`` holds the
    vocabulary's columns ``vocab_start .. vocab_start + W`` only (``lse`` and ``H`` are the whole vocabulary's):
    a label outside them adds no one-hot term. Cache-sized pieces of ``scratch`` ``(S, W)`` (None: one is made for
    this call): each piece is read from memory once.
    """
    rows = probs.shape[0]
    g_lp = torch.zeros(rows, dtype=probs.dtype, device=probs.device) if grad_logprobs is None else grad_logprobs
    grad = g_lp.reshape(-1, 1).to(probs.dtype) / temperature
    g_h = None if grad_entropy is None else grad_entropy.reshape(-1, 1).to(probs.dtype) / temperature
    scale = -grad if g_h is None else -(grad + entropy.reshape(-1, 1) * g_h)
    scratch = _scratch(probs) if scratch is None else scratch
    step = scratch.shape[0]
    for start in range(0, rows, step):
        rows_here = slice(start, start + step)
        piece = probs[rows_here]
        if log_sum_exp is None:
            # p log p is 0 where p underflowed to 0, which xlogy gives and p * log p would not at -inf logits.
            p_log_p = None if g_h is None else torch.xlogy(piece, piece, out=scratch[: piece.shape[0]])
        else:
            # From the logits, log p = z - lse is at hand (finite): no logarithm per entry, one exponential.
            log_p = torch.sub(piece, log_sum_exp[rows_here].unsqueeze(-1), out=scratch[: piece.shape[0]])
            torch.exp(log_p, out=piece)
            p_log_p = None if g_h is None else log_p.mul_(piece)
        if g_h is None:
            piece.mul_(scale[rows_here])
            continue
        piece.mul_(scale[rows_here]).addcmul_(p_log_p, g_h[rows_here], value=-1.0)
    if vocab_start is None:
        return probs.scatter_add_(-1, labels, grad)
    local, width = labels - vocab_start, probs.shape[1]
    hit = (local >= 0) & (local < width)
    return probs.scatter_add_(-1, local.clamp_(0, width - 1), grad * hit)


def _head_pass(hidden, weight, bias, labels, chunk_size: int, temperature: float, buffer_rows=None, out=None,
               with_entropy: bool = True):  # fmt: skip
    """The forward of the head, one buffer (``chunk_size`` 0) or chunks: log-probs ``(N,)``, entropy ``(N,)`` (None
    without ``with_entropy``), and what a backward needs - the softmax ``(N, V)`` of one buffer, else the
    log-sum-exp ``(N,)``. ``hidden`` as :func:`head_input` gives it, labels ``(N, 1)``."""
    n, dtype = hidden.shape[0], _logits_dtype(weight)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    entropy = torch.empty_like(logprobs) if with_entropy else None
    if not chunk_size:
        z = _lm_head_logits(hidden, weight, bias, buffer_rows, out)
        z = z if temperature == 1.0 else z.div_(temperature)
        _softmax_stats(z, labels, logprobs, entropy, None, _scratch(z))
        return logprobs, entropy, z
    log_sum_exp = torch.empty_like(logprobs) if with_entropy else None
    buffer = _work_buffer(n, chunk_size, weight)
    scratch = _scratch(buffer)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        z = _chunk_logits(hidden[rows], weight, bias, temperature, buffer)
        _softmax_stats(z, labels[rows], logprobs[rows], None if entropy is None else entropy[rows],
                       None if log_sum_exp is None else log_sum_exp[rows], scratch)  # fmt: skip
    return logprobs, entropy, log_sum_exp


class _LinearHead(torch.autograd.Function):
    """The LM head, log-probs of chosen tokens and entropy (both differentiable): the one Function of every pass.

    Forward (:func:`_head_pass`): ``z`` (divided by ``T``), ``lp = log_softmax(z)_y`` and ``H = -sum_v p_v log p_v``;
    saved: the head's inputs, ``H`` and either the softmax ``(N, V)`` (one buffer) or ``lse`` ``(N,)`` (chunks,
    whose backward recomputes ``p = exp(z - lse)``). Backward: :func:`softmax_grad_` in place, then
    ``grad_hidden = grad_z W``, ``grad_W = grad_z^T hidden`` and ``grad_b = sum_n grad_z``, in one buffer (one
    chunk of N), over slices of the vocabulary (:func:`_backward_by_vocabulary`, chunks with N < V) or over chunks
    of tokens (:func:`_backward_by_tokens`, ``grad_W`` summed into the weight's gradient itself, its dtype, in
    place: no ``(V, H)`` temporary, :func:`_add_weight_grad`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out):
        hidden = head_input(hidden, weight)  # saved as the product saw it; the engine casts grad_hidden back
        flat_labels = labels.reshape(-1, 1)
        logprobs, entropy, saved = _head_pass(hidden, weight, bias, flat_labels, chunk_size, temperature, buffer_rows, out)
        ctx.save_for_backward(hidden, weight, bias, flat_labels, saved, entropy)
        ctx.chunk_size, ctx.temperature, ctx.autocast = chunk_size, temperature, autocast_state(hidden)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, saved, entropy = ctx.saved_tensors
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        sliced = ctx.chunk_size and by_vocabulary(hidden.shape[0], weight.shape[0])
        run = _backward_by_vocabulary if sliced else _backward_by_tokens
        grads = run(hidden, weight, bias, labels, saved, entropy, grad_logprobs, grad_entropy, ctx.chunk_size,
                    ctx.temperature, ctx.autocast, want)  # fmt: skip
        return *grads, None, None, None, None, None


def by_vocabulary(tokens: int, vocab: int) -> bool:
    """Whether a chunked backward slices the vocabulary rather than the tokens: the one its chunks sum over, the
    ``(N, H)`` gradient of the head's inputs or the ``(V, H)`` weight gradient, is the smaller.

    Each slice or chunk reads and writes that sum; the other is written once, slice by slice. Slices of the
    vocabulary also keep the head's products large (every token at once against a cache-sized piece of W).
    """
    return tokens < vocab


def vocab_slice_width(tokens: int, vocab: int, chunk_size: int, device_type: str = "cpu") -> int:
    """Vocabulary columns per slice of all ``tokens`` rows: at most the logits of a chunk of ``chunk_size``
    tokens, so the memory bound is the chunk's bytes either way - and on the CPU at most 16 MiB of float32
    logits (at least 256 columns), which the slice's four passes (product, gradient, two products) find in cache."""
    width = chunk_size * vocab // max(tokens, 1)
    if device_type in _SLICE_BYTES:
        width = min(width, max(256, _SLICE_BYTES[device_type] // (4 * max(tokens, 1))))
    return max(1, min(vocab, width))


def _backward_by_tokens(hidden, weight, bias, labels, saved, entropy, grad_logprobs, grad_entropy, chunk_size,
                        temperature, autocast, want):  # fmt: skip
    """The one buffer's backward (``chunk_size`` 0: one chunk of N) or ``chunk_size`` tokens at a time, each
    chunk's logits recomputed and made ``p`` by its saved log-sum-exp; see :class:`_LinearHead`."""
    (want_hidden, want_weight, want_bias), n = want, hidden.shape[0]
    step = chunk_size or max(n, 1)
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = None
    grad_bias = torch.zeros(weight.shape[0], dtype=saved.dtype, device=weight.device) if want_bias else None
    # Chunks reuse one work buffer and one cache-sized scratch; one buffer's scratch is freed before its products.
    buffer = _work_buffer(n, step, weight) if chunk_size else None
    scratch = _scratch(buffer) if chunk_size else None
    for start in range(0, n, step):
        rows = slice(start, start + step)
        if chunk_size:
            with under_autocast(autocast):  # the forward's logits exactly: its log-sum-exp is reused
                probs = _chunk_logits(hidden[rows], weight, bias, temperature, buffer)
        else:
            probs = saved  # the saved softmax is not needed again: its memory becomes the gradient
        grad_z = softmax_grad_(
            probs, labels[rows], entropy[rows], None if grad_logprobs is None else grad_logprobs[rows],
            None if grad_entropy is None else grad_entropy[rows], temperature, scratch,
            saved[rows] if chunk_size else None,
        )  # fmt: skip
        if want_bias:
            grad_bias += grad_z.sum(0)
        grad_z = grad_z.to(weight.dtype)
        if want_hidden:
            with under_autocast(autocast):
                grad_hidden[rows] = grad_z @ weight
        if want_weight and step >= n:  # one product, in the model's precision: it is the gradient itself
            with under_autocast(autocast):
                grad_weight = grad_z.t() @ hidden
        elif want_weight:
            grad_weight = _add_weight_grad(grad_weight, grad_z, hidden[rows], weight)
    grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)  # a float32 sum cast once
    return grad_hidden, grad_weight, grad_bias.to(bias.dtype) if want_bias else None


def _backward_by_vocabulary(hidden, weight, bias, labels, log_sum_exp, entropy, grad_logprobs, grad_entropy,
                            chunk_size, temperature, autocast, want):  # fmt: skip
    """The chunked backward over slices of the vocabulary (:func:`by_vocabulary`): per slice ``W_s`` of
    :func:`vocab_slice_width` columns, ``z_s = (hidden W_s^T + b_s) / T`` for every token, ``p_s = exp(z_s - lse)``
    from the saved whole-vocabulary log-sum-exp, :func:`softmax_grad_`, then ``grad_W_s = grad_z_s^T hidden`` and
    ``grad_b_s`` written once and ``grad_hidden += grad_z_s W_s`` summed in an ``(N, H)`` buffer of the weight's dtype.

    The products run as the model's (its dtype, or under the forward's autocast); slices reuse one work buffer.
    """
    (want_hidden, want_weight, want_bias), (n, vocab) = want, (hidden.shape[0], weight.shape[0])
    width, dtype = vocab_slice_width(n, vocab, chunk_size, weight.device.type), log_sum_exp.dtype
    buffer = torch.empty(n * width, dtype=dtype, device=weight.device)
    budget = _CACHE_BYTES.get(weight.device.type, _DEFAULT_CACHE_BYTES) // buffer.element_size()
    scratch = buffer.new_empty(max(width, min(budget, n * width)))
    # The products run in the weight's dtype. Under autocast a float32 weight's operands are first rounded to its
    # dtype, as the model's product rounds them. grad_hidden is summed over the slices in float32 whatever the
    # weight's dtype: a half-precision running sum adds a rounding per slice (hundreds on a GPU), a float32 one
    # about the one rounding of each slice's product (issue 59 item 2).
    half = autocast[1] if autocast[2] and weight.dtype == dtype else None
    hidden_w = hidden.to(weight.dtype) if half is None else hidden.to(half).to(dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if want_hidden else None
    grad_weight = torch.empty_like(weight) if want_weight else None
    grad_bias = torch.empty(vocab, dtype=dtype, device=weight.device) if want_bias else None
    for start in range(0, vocab, width):
        cols = slice(start, start + width)
        w_slice = weight[cols]
        z = buffer[: n * w_slice.shape[0]].view(n, w_slice.shape[0])
        with under_autocast(autocast):
            _chunk_logits(hidden, w_slice, None if bias is None else bias[cols], temperature, z)
        rows = max(1, min(n, scratch.numel() // w_slice.shape[0]))
        grad_z = softmax_grad_(z, labels, entropy, grad_logprobs, grad_entropy, temperature,
                               scratch[: rows * w_slice.shape[0]].view(rows, -1), log_sum_exp, start)  # fmt: skip
        if want_bias:
            grad_bias[cols] = grad_z.sum(0)
        if half is not None:
            grad_z.copy_(grad_z.to(half))
            w_slice = w_slice.to(half).to(dtype)
        grad_z = grad_z.to(weight.dtype)
        with torch.autocast(weight.device.type, enabled=False):
            if want_weight:
                torch.mm(grad_z.t(), hidden_w, out=grad_weight[cols])
            if want_hidden and w_slice.dtype == dtype:
                grad_hidden.addmm_(grad_z, w_slice)
            elif want_hidden:
                grad_hidden += torch.mm(grad_z, w_slice)  # the half-precision product, summed in float32
    grad_hidden = grad_hidden.to(hidden.dtype) if want_hidden else None
    return grad_hidden, grad_weight, grad_bias.to(bias.dtype) if want_bias else None


def _add_weight_grad(total: torch.Tensor | None, grad_z: torch.Tensor, hidden: torch.Tensor, weight) -> torch.Tensor:
    """``total + grad_z^T hidden`` ``(V, H)``, in place after the first chunk: in the weight's dtype for a float32
    weight, in float32 for a half-precision one (the caller casts the sum once).

    Outside autocast: under mixed precision the float32 weight's gradient is summed in float32 by one float32
    product per chunk rather than made in bfloat16 and upcast. A bfloat16 (float16) weight's chunk products run in
    its dtype and are summed in a float32 ``(V, H)`` total: a half-precision running sum would add one rounding per
    chunk (hundreds of chunks on a GPU; issue 59 item 2); this costs one float32 weight-sized buffer per backward.
    """
    grad_z, hidden = grad_z.to(weight.dtype), hidden.to(weight.dtype)
    wide = weight.dtype in (torch.float32, torch.float64)
    with torch.autocast(weight.device.type, enabled=False):
        if total is None:
            # The first chunk's product is the gradient itself (float32 weights), or the float32 sum's start.
            product = torch.mm(grad_z.t(), hidden)
            return product if wide else product.float()
        return total.addmm_(grad_z.t(), hidden) if wide else total.add_(torch.mm(grad_z.t(), hidden))


def linear_head(hidden, weight, bias, labels, chunk_size: int = 0, temperature: float = 1.0,
                buffer_rows: int | None = None, out: torch.Tensor | None = None):  # fmt: skip
    """Log-probability of ``labels`` and entropy (both differentiable) under ``softmax((hidden @ W.T + b) / T)``.

    ``chunk_size`` 0: one ``(N, V)`` buffer, kept until the backward - allocated for at least ``buffer_rows``
    rows, or the first N rows of ``out`` (float32, ``(R >= N, V)``), which may be reused only after the
    backward has run. ``chunk_size`` C > 0: C tokens at a time (``buffer_rows`` and ``out`` unused).
    Shapes: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)`` -> two ``(N,)`` tensors
    (float32; float64 for float64 weights).
    """
    check_head_options(chunk_size, temperature)
    return _LinearHead.apply(hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out)


@torch.no_grad()
def linear_head_logprobs(hidden, weight, bias, labels, chunk_size: int = 0, temperature: float = 1.0,
                         buffer_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Log-probability of ``labels`` under ``softmax((hidden @ W.T + b) / T)`` without grad or entropy, in one
    buffer or chunks as :func:`linear_head`. Returns ``(N,)``."""
    check_head_options(chunk_size, temperature)
    hidden = head_input(hidden, weight)
    labels = labels.reshape(-1, 1)
    return _head_pass(hidden, weight, bias, labels, chunk_size, temperature, buffer_rows, out, with_entropy=False)[0]


def call_head(head: torch.nn.Module, head_pass, hidden: torch.Tensor):
    """``head_pass(hidden)`` run as ``head``'s forward, through the module's call: DeepSpeed ZeRO-3's hooks on it
    gather its partitioned weight for the pass, release it after, and gather it again for the backward (from the
    outputs' gradients) - as for the model's own ``head(hidden)``, whose ``(N, V)`` logits the pass replaces.

    ``hidden``: ``(N, H)``; returns what ``head_pass`` returns.
    """
    own = head.__dict__.get("forward")  # an instance forward set before (accelerate's hooks): put back after
    head.forward = head_pass
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


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
    z_buf, q_buf = _work_buffer(n, chunk_size, weight), _work_buffer(n, chunk_size, ref_weight)
    scratch = _scratch(z_buf)
    out = torch.empty(n, dtype=z_buf.dtype, device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        z = _chunk_logits(hidden[rows], weight, bias, temperature, z_buf)
        log_q = _chunk_logits(ref_hidden[rows], ref_weight, ref_bias, temperature, q_buf)
        for piece_start in range(0, z.shape[0], scratch.shape[0]):
            piece = slice(piece_start, piece_start + scratch.shape[0])
            log_p = torch.log_softmax(z[piece], dim=-1, out=scratch[: z[piece].shape[0]])
            q_piece = log_q[piece]
            q_piece.sub_(torch.logsumexp(q_piece, dim=-1, keepdim=True)).neg_().add_(log_p)  # log p - log q
            # Not vecdot: autocast would run it in half precision.
            out[start + piece_start : start + piece_start + q_piece.shape[0]] = q_piece.mul_(log_p.exp_()).sum(-1)
    return out
