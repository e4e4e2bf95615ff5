"""Attention over packed rows that computes each row on its own: sdpa's varlen counterpart.

A packed mini-batch is one sequence ``(1, N_total)`` holding several rows, with position ids
restarting at 0 per row. transformers turns that into a block-diagonal causal mask, and sdpa then
computes attention over the whole ``N_total x N_total`` square and throws away everything off the
diagonal blocks: for four rows of ~170 tokens that is ~7x the attention work the rows need, more
than the padded layout costs. Flash attention's varlen kernels skip those blocks; on CPU, and on
GPUs without flash attention, :func:`packed_sdpa_attention_forward` does the same by running
causal sdpa on each row's slice of the queries, keys and values.

It is registered with transformers under :data:`PACKED_SDPA`, and :func:`attend_per_row` switches
models to it for a block of passes. The rows reach it as the forward keyword :data:`ROW_LENGTHS`
(a :class:`~.varlen_attention.PackedRows`, or a tuple of host ints: no device sync per layer). On
CUDA with 16-bit inputs it attends with one varlen kernel call per layer instead of one sdpa call
per row (:mod:`.varlen_attention`); elsewhere row by row, on CUDA with cuDNN attention excluded.
Without that keyword (a padded pass, or a model whose layers drop unknown keywords) it is plain
sdpa with the mask it is given: for packed rows the block-diagonal one, slower but the same result.

A packed pass also hands its model :func:`rows_mask` as ``attention_mask``: a 4-D placeholder that
transformers' mask utilities pass through untouched and that carries the rows. Without it they detect
packed rows from the position ids and read the result on the host (``find_packed_sequence_indices``
in ``transformers.masking_utils``): one device sync per model call on CUDA, and on any device a wrong
split for rows that share a prompt (a response's positions continue its prompt's, they do not restart).

The mask function registered beside it (:func:`packed_sdpa_mask`) does not build the
block-diagonal ``(1, 1, N, N)`` mask of a packed pass, which the per-row attention never reads
(1 GiB of booleans at N = 32k tokens, and more while it is built): it hands the layers a
:class:`DeferredMask` holding the recipe, built only if an attention runs without the row lengths.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import varlen_attention
from .shared_prefix_attention import SharedRows, shared_sdpa
from .varlen_attention import PackedRows, announce, varlen_unsupported

PACKED_SDPA = "trl_lite_packed_sdpa"
ROW_LENGTHS = "packed_row_lengths"


class DeferredMask:
    """The sdpa mask of one sequence without padding, built on first :meth:`build` (then kept for the
    other layers of the pass): ``(1, 1, q_length, kv_length)`` booleans or None, as :func:`sdpa_mask` gives."""

    def __init__(self, mask_kwargs: dict):
        self._mask_kwargs = mask_kwargs
        self._built = False
        self._mask = None

    def build(self) -> torch.Tensor | None:
        if not self._built:
            self._mask, self._built = sdpa_mask(**self._mask_kwargs), True
        return self._mask


def packed_sdpa_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """transformers' mask function for :data:`PACKED_SDPA`: :func:`sdpa_mask`'s result, deferred
    (:class:`DeferredMask`) for one sequence without a padding mask - the layout of a packed pass."""
    mask_kwargs = dict(kwargs, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                       attention_mask=attention_mask)  # fmt: skip
    if batch_size == 1 and attention_mask is None:
        return DeferredMask(mask_kwargs)
    return sdpa_mask(**mask_kwargs)


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Attention within each packed row when ``kwargs[ROW_LENGTHS]`` is given, else plain sdpa.

    ``query``/``key``/``value``: ``(1, heads, N_total, head_dim)`` for packed rows; the rows'
    lengths sum to ``N_total``. One varlen kernel call where :func:`~.varlen_attention.varlen_unsupported`
    allows it, else causal sdpa on each row's slice. Returns ``((1, N_total, heads, head_dim), None)``
    like sdpa.
    """
    rows = kwargs.pop(ROW_LENGTHS, None)
    if rows is None:
        rows = getattr(attention_mask, _ROWS_ATTRIBUTE, None)
    if isinstance(rows, (tuple, list)):
        rows = PackedRows(tuple(rows), max(rows))
    packed = (
        rows is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2] == rows.total
        and getattr(module, "is_causal", True)
    )
    if not packed:
        if isinstance(attention_mask, DeferredMask):
            attention_mask = attention_mask.build()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    reason = varlen_unsupported(query, rows, module, kwargs)
    announce("per-row" if reason else "varlen", reason, query.device.type)
    if reason is None:
        return varlen_attention.varlen_attention(query, key, value, rows, kwargs.get("scaling")), None
    if isinstance(rows, SharedRows):  # rows sharing prompts (see shared_prefix_attention)
        with without_cudnn(query.device):
            return shared_sdpa(module, query, key, value, rows, lambda n, w: _window_mask(n, w, query.device), **kwargs), None
    kwargs["is_causal"] = True
    window = kwargs.pop("sliding_window", None)
    lengths = list(rows.lengths)
    pieces = zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    with without_cudnn(query.device):
        outputs = [
            sdpa_attention_forward(module, q, k, v, _window_mask(q.shape[2], window, q.device), **kwargs)[0]
            for q, k, v in pieces
        ]
    return torch.cat(outputs, dim=1), None


def _window_mask(length: int, window: int | None, device) -> torch.Tensor | None:
    """The boolean ``(length, length)`` mask of causal attention within a sliding ``window`` (query ``i`` reads
    keys ``i - window < j <= i``, transformers' sliding-window layers), or None where plain causal attention
    is the same (no window, or a row no longer than it)."""
    if window is None or length <= window:
        return None
    positions = torch.arange(length, device=device)
    offsets = positions.unsqueeze(1) - positions.unsqueeze(0)  # query minus key position
    return (offsets >= 0) & (offsets < window)


def without_cudnn(device):
    """On CUDA, sdpa without its cuDNN backend (which compiles a graph for every new input shape: row lengths,
    mini-batch widths); elsewhere nothing changes. Every pass of the trainer runs inside it."""
    if torch.device(device).type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


_ROWS_ATTRIBUTE = "_trl_lite_packed_rows"


def rows_mask(rows: PackedRows, device) -> torch.Tensor:
    """The ``attention_mask`` a packed pass on ``device`` hands a model switched by :func:`attend_per_row`.

    A ``(1, 1, N_total, N_total)`` uint8 tensor of zero strides (one byte of memory, never read) carrying
    ``rows``, on every device. transformers returns a 4-D mask as it is, so it skips its packed-sequence
    detection from the position ids (on CUDA a host read of a device value per model call; and a detection
    that would cut the responses of a shared prompt, whose positions do not restart, off that prompt), and
    :func:`packed_sdpa_attention_forward` reads the rows from it even if a layer drops :data:`ROW_LENGTHS`.
    uint8 is no mask dtype sdpa accepts: an attention that does not read the rows fails on it, an error
    instead of a silent fallback.
    """
    mask = torch.zeros((), dtype=torch.uint8, device=device).expand(1, 1, rows.total, rows.total)
    setattr(mask, _ROWS_ATTRIBUTE, rows)
    return mask


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def takes_row_lengths(transformers_model) -> bool:
    """Whether :func:`attend_per_row` can speed up ``transformers_model``: it runs sdpa and its
    base model's forward passes extra keywords on (to its attention layers, in transformers' models)."""
    if getattr(transformers_model.config, "_attn_implementation", None) != "sdpa":
        return False
    backbone = getattr(transformers_model, getattr(transformers_model, "base_model_prefix", ""), transformers_model)
    return all(
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(m.forward).parameters.values())
        for m in {transformers_model, backbone}
    )


@contextmanager
def attend_per_row(transformers_models, implementation: str = PACKED_SDPA):
    """Switch ``transformers_models`` (sdpa models, see :func:`takes_row_lengths`) to :data:`PACKED_SDPA`
    (or another registered ``implementation`` built on it) for the block: their forward passes given
    :data:`ROW_LENGTHS` then attend within each row only.

    Hold it over the backward passes too when gradient checkpointing recomputes the layers, so the
    recomputation runs the same attention as the forward pass did.
    """
    configs = [model.config for model in transformers_models]
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = implementation
    try:
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation
