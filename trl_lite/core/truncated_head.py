"""The LM head under truncated sampling (docs/algorithm_rollouts.md section 23, docs/truncated_sampling.md): log-probs and entropy of
``pi_T^K``, ``pi_T = softmax(z / T)`` renormalised over each position's fixed kept set ``K``.

Chunk by chunk of tokens as :mod:`.lm_head`'s chunked path (one chunk of every token for ``chunk_size`` 0): each
chunk's ``(C, V)`` logits are made in one reused buffer, the kept logits ``z_K`` gathered ``(C, K)`` and reduced by
a log-sum-exp over them; nothing ``(N, V)`` is kept. The kept logits are saved, so the backward makes no logits:
``d lp / d z_K = onehot - p_K`` and ``d H_K / d z_K = -p_K (log p_K + H_K)`` (divided by ``T``), scattered into one
reused ``(C, V)`` buffer that the two products read (``grad_hidden = grad_z W``, ``grad_W += grad_z^T h``); a
half-precision weight's gradient is summed over the chunks in float32 and cast once.

In the rollout pass (no grad) the sets may be made here (:func:`truncated_head_logprobs` with ``derive``): from
each chunk's logits by the engine's rule (:func:`.kept_sets.kept_ids`), returned padded for the step's
:class:`~.kept_sets.KeptSets`. The untruncated entropy is a statistic beside the truncated one.

Shape names: ``N`` token positions, ``V`` vocabulary, ``H`` hidden size, ``C`` tokens per chunk, ``K`` the longest set.
"""

from __future__ import annotations

import torch

from .kept_sets import Truncation, fill_holes, padded_ids
from .lm_head import _chunk_logits, _logits_dtype, _scratch, _softmax_stats, _work_buffer, autocast_state
from .lm_head import check_head_options, head_input
from .lm_head import under_autocast


def _kept_stats(z, labels, ids, counts):
    """Per row of one chunk: ``z_K`` ``(C, K)`` (-inf past each count), ``lse_K``, the label's ``log pi_T^K`` and
    the entropy of ``pi_T^K``."""
    inside = torch.arange(ids.shape[1], device=ids.device) < counts.reshape(-1, 1)
    # Past a count: a finite floor, whose exponential is exactly 0 (no 0 * inf in a product or a gradient).
    z_kept = z.gather(-1, ids).masked_fill(~inside, torch.finfo(z.dtype).min / 4)
    lse = torch.logsumexp(z_kept, dim=-1)
    logprobs = z.gather(-1, labels).squeeze(-1) - lse
    p = torch.exp(z_kept - lse.unsqueeze(-1))
    entropy = lse - (p * z_kept).sum(-1)
    return z_kept, lse, logprobs, entropy


def _full_entropy(z):
    log_p = torch.log_softmax(z, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


class _TruncatedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ids, counts, chunk_size, temperature):
        hidden = head_input(hidden, weight)
        n, dtype = hidden.shape[0], _logits_dtype(weight)
        step = chunk_size or max(n, 1)
        flat_labels = labels.reshape(-1, 1)
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        z_kept = torch.empty(ids.shape, dtype=dtype, device=hidden.device)
        buffer = _work_buffer(n, step, weight)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z = _chunk_logits(hidden[rows], weight, bias, temperature, buffer)
            z_kept[rows], lse[rows], logprobs[rows], entropy[rows] = _kept_stats(z, flat_labels[rows], ids[rows],
                                                                                 counts[rows])  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, flat_labels, ids, z_kept, lse, entropy)
        ctx.chunk_size, ctx.temperature, ctx.autocast = chunk_size, temperature, autocast_state(hidden)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, ids, z_kept, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        n, temperature = hidden.shape[0], ctx.temperature
        # d/dz_K of lp and H_K, the logits before the division by T: zero past each count (p_K = 0 there).
        log_p = z_kept - lse.unsqueeze(-1)
        p = torch.exp(log_p)
        grad_kept = torch.zeros_like(z_kept)
        if grad_logprobs is not None:
            grad_kept -= p * grad_logprobs.unsqueeze(-1)
        if grad_entropy is not None:
            grad_kept -= p * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        grad_kept /= temperature
        step = ctx.chunk_size or max(n, 1)
        buffer = _work_buffer(n, step, weight)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # A half-precision weight's gradient summed over chunks in float32, cast once (one rounding per chunk).
        grad_weight = torch.zeros(weight.shape, dtype=buffer.dtype, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=buffer.dtype, device=weight.device) if want_bias else None
        for start in range(0, n, step):
            rows = slice(start, start + step)
            grad_z = buffer[: hidden[rows].shape[0]].zero_()
            grad_z.scatter_add_(-1, ids[rows], grad_kept[rows])
            if grad_logprobs is not None:
                grad_z.scatter_add_(-1, labels[rows], (grad_logprobs[rows] / temperature).unsqueeze(-1).to(grad_z.dtype))
            if want_bias:
                grad_bias += grad_z.sum(0)
            grad_w = grad_z.to(weight.dtype)
            with under_autocast(ctx.autocast):
                if want_hidden:
                    grad_hidden[rows] = grad_w @ weight
                if want_weight:
                    if grad_weight.dtype == weight.dtype and not torch.is_autocast_enabled(weight.device.type):
                        grad_weight.addmm_(grad_w.t(), hidden[rows].to(weight.dtype))
                    else:
                        grad_weight += (grad_w.t() @ hidden[rows]).to(grad_weight.dtype)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def truncated_head(hidden, weight, bias, labels, ids, counts, chunk_size: int = 0, temperature: float = 1.0):
    """Log-probability of ``labels`` and entropy (both differentiable) under ``pi_T^K``: ``softmax((hidden @ W.T +
    b) / T)`` renormalised over each position's kept set, ids ``(N, K)`` int64 with ``counts`` ``(N,)`` (each set
    holds its label; columns past a count are ignored). ``chunk_size`` 0: one chunk of all N tokens.
    Shapes: hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)`` -> two ``(N,)`` tensors."""
    check_head_options(chunk_size, temperature)
    return _TruncatedHead.apply(hidden, weight, bias, labels, ids, counts, chunk_size, temperature)


@torch.no_grad()
def truncated_head_logprobs(hidden, weight, bias, labels, chunk_size: int = 0, temperature: float = 1.0,
                            ids=None, counts=None, derive: Truncation | None = None, full_entropy: bool = False):  # fmt: skip
    """Without grad: ``log pi_T^K`` of ``labels`` ``(N,)`` over the given sets (``ids``, ``counts``) and, with
    ``derive``, over sets made here from each chunk's ``z / T`` by its rule where none is given (all when ``ids`` is
    None; a count 0 elsewhere: :func:`.kept_sets.fill_holes`). Returns ``(logprobs, entropy_K, entropy or None, ids,
    counts)``: the untruncated entropy with ``full_entropy``; the sets used (padded)."""
    check_head_options(chunk_size, temperature)
    if ids is None and derive is None:
        raise ValueError("truncated_head_logprobs takes the kept sets (ids and counts), a rule to derive them (derive), "
                         "or both.")  # fmt: skip
    hidden = head_input(hidden, weight)
    n, dtype = hidden.shape[0], _logits_dtype(weight)
    step = chunk_size or max(n, 1)
    flat_labels = labels.reshape(-1, 1)
    logprobs, entropy = torch.empty(n, dtype=dtype, device=hidden.device), torch.empty(n, dtype=dtype, device=hidden.device)
    full = torch.empty_like(entropy) if full_entropy else None
    buffer = _work_buffer(n, step, weight)
    scratch = _scratch(buffer) if full_entropy else None
    made = []
    for start in range(0, n, step):
        rows = slice(start, start + step)
        z = _chunk_logits(hidden[rows], weight, bias, temperature, buffer)
        chunk_ids, chunk_counts = (None, None) if ids is None else (ids[rows], counts[rows])
        if derive is not None:
            chunk_ids, chunk_counts = fill_holes(z, flat_labels[rows].reshape(-1), chunk_ids, chunk_counts, derive)
            made.append((chunk_ids, chunk_counts))
        _, _, logprobs[rows], entropy[rows] = _kept_stats(z, flat_labels[rows], chunk_ids, chunk_counts)
        if full is not None:  # last: in cache-sized pieces, turning z into the softmax in place
            _softmax_stats(z, flat_labels[rows], torch.empty_like(full[rows]), full[rows], None, scratch)
    if derive is not None:
        width = max((i.shape[1] for i, _ in made), default=1)
        ids = torch.cat([padded_ids(i, width) for i, _ in made]) if made else (
            torch.zeros((0, 1), dtype=torch.int64, device=hidden.device))  # fmt: skip
        counts = torch.cat([c for _, c in made]) if made else torch.zeros(0, dtype=torch.int64, device=hidden.device)
    return logprobs, entropy, full, ids, counts


def truncated_from_logits(logits, labels, temperature: float = 1.0, ids=None, counts=None,
                          derive: Truncation | None = None, full_entropy: bool = False):  # fmt: skip
    """:func:`truncated_head_logprobs` from a model's own logits ``(N, V)`` (a head the trainer does not apply),
    differentiable when they are: ``(logprobs, entropy_K, entropy or None, ids, counts)``."""
    check_head_options(temperature=temperature)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z if temperature == 1.0 else z / temperature
    flat_labels = labels.reshape(-1, 1)
    if derive is not None:
        ids, counts = fill_holes(z.detach(), labels.reshape(-1), ids, counts, derive)
    _, _, logprobs, entropy = _kept_stats(z, flat_labels, ids, counts)
    full = _full_entropy(z.detach()) if full_entropy else None
    return logprobs, entropy, full, ids, counts
