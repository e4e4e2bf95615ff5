"""One variable-length attention call per layer over the rows of a packed pass, and which path a pass takes.

A packed pass (one sequence ``(1, N_total)`` of several rows, see :mod:`.packed_attention`) needs
attention that stays inside each row. On CUDA, FlashAttention's varlen kernel does that for the whole
mini-batch in one launch from the rows' cumulative offsets ``cu_seqlens`` (PyTorch ships it as
``torch.nn.attention.varlen.varlen_attn`` from 2.10). Everywhere else - the CPU, float32 inputs, an
older torch, attention dropout, sliding windows, soft-capping - the pass attends row by row with sdpa
(:func:`~.packed_attention.packed_sdpa_attention_forward`); on CUDA with the cuDNN backend excluded,
because cuDNN attention builds a new graph for every new row length (milliseconds of CPU each).

:class:`PackedRows` is what a pass hands its attention layers: the rows' lengths (host ints), and on a
device where the kernel runs, ``cu_seqlens`` moved in one pinned non-blocking copy, built once per pass
and shared by its layers (and by a separate critic's pass over the same rows).

The kernel's keywords changed between torch releases (2.10: ``is_causal``; later: ``window_size=(-1, 0)``
for causal attention and ``enable_gqa`` for grouped key/value heads): :func:`varlen_attention` reads the
signature of the function it is given and asks for causal attention the way that function understands.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def _torch_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class VarlenKernel:
    """A variable-length attention function with the signature of ``varlen_attn``
    (``query, key, value (T, H, D), cu_seq_q, cu_seq_k (n + 1,) int32, max_q, max_k``, keywords), the
    device types it runs on, the input dtypes it takes and the head sizes ``D`` it takes (multiples of
    ``head_dim_multiple`` up to ``max_head_dim``: FlashAttention-2's rule). ``function`` None: no kernel."""

    function: object
    device_types: frozenset
    dtypes: frozenset
    head_dim_multiple: int = 8
    max_head_dim: int = 256


#: The kernel packed passes use. FlashAttention's varlen kernel: CUDA, 16-bit inputs.
KERNEL = VarlenKernel(_torch_varlen_attn(), frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}))


@dataclass(frozen=True, eq=False)
class PackedRows:
    """The rows of one packed pass, as its attention layers need them.

    ``lengths``: each row's token count (host ints, summing to ``N_total``); ``max_length``: the
    longest (a host int, as the kernel takes it); ``cu_seqlens``: ``(n + 1,)`` int32 offsets on the
    device, ``[0, l_0, l_0 + l_1, ...]``, or None where the varlen kernel cannot run on that device
    (the per-row path reads only ``lengths``).
    """

    lengths: tuple
    max_length: int
    cu_seqlens: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def kernel_offsets(self) -> tuple:
        """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k)`` of the varlen call: the same offsets for queries and keys."""
        return self.cu_seqlens, self.cu_seqlens, self.max_length, self.max_length


def packed_rows(lengths, device) -> PackedRows:
    """:class:`PackedRows` of rows of ``lengths`` tokens for a pass on ``device``.

    The offsets are summed on the host and moved in one copy (pinned and non-blocking on CUDA, so the
    host does not wait), only where :data:`KERNEL` runs on ``device``.
    """
    lengths = tuple(int(n) for n in lengths)
    if any(n < 1 for n in lengths) or not lengths:
        raise ValueError(f"lengths must be one or more positive row lengths, got {lengths}.")
    device = torch.device(device)
    cu_seqlens = None
    if KERNEL.function is not None and device.type in KERNEL.device_types:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        host = torch.tensor(offsets, dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        cu_seqlens = host.to(device, non_blocking=device.type == "cuda")
    return PackedRows(lengths, max(lengths), cu_seqlens)


@functools.lru_cache(maxsize=8)
def _keywords(function) -> frozenset:
    """The keyword parameters ``function`` takes (read once per function); none when its signature
    cannot be read (then :func:`varlen_unsupported` finds no way to ask for causal attention)."""
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


def varlen_unsupported(query: torch.Tensor, rows: PackedRows, module, kwargs: dict) -> str | None:
    """Why the packed pass whose layer got ``query (1, H, N, D)`` cannot attend with :data:`KERNEL`,
    or None when it can. ``kwargs``: the attention keywords the layer passes (dropout, sliding window)."""
    kernel = KERNEL
    if kernel.function is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (it came with torch 2.10)"
    if query.device.type not in kernel.device_types:
        return f"the varlen kernel does not run on {query.device.type}"
    dtype = attention_dtype(query)
    if dtype not in kernel.dtypes:
        allowed = "/".join(sorted(str(d).removeprefix("torch.") for d in kernel.dtypes))
        return (
            f"the attention inputs are {str(dtype).removeprefix('torch.')} and the varlen kernel takes {allowed} "
            "(train under AMP or with 16-bit weights)"
        )
    head_dim = query.shape[-1]
    if head_dim % kernel.head_dim_multiple or head_dim > kernel.max_head_dim:
        return (
            f"the head dimension is {head_dim} and the varlen kernel takes multiples of {kernel.head_dim_multiple} "
            f"up to {kernel.max_head_dim}"
        )
    if rows.cu_seqlens is None or rows.cu_seqlens.device != query.device:
        return "the pass built no offsets on the attention's device"
    if kwargs.get("dropout", 0.0) and getattr(module, "training", False):
        return "the attention applies dropout, which the varlen kernel does not"
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        return "the attention uses a sliding window or soft-capping"
    keywords = _keywords(kernel.function)
    if "window_size" not in keywords and "is_causal" not in keywords:
        return "this torch's varlen_attn takes neither window_size nor is_causal (no causal attention)"
    return None


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's where it is on for the query's device (it casts
    sdpa's inputs so; rotary position embeddings in float32 may have promoted the query back), else
    the query's own."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def varlen_attention(query, key, value, rows: PackedRows, scaling: float | None) -> torch.Tensor:
    """Causal attention within each row of ``rows`` in one :data:`KERNEL` call.

    ``query (1, Hq, N, D)``, ``key``/``value`` ``(1, Hkv, N, D)`` with ``Hq`` a multiple of ``Hkv``
    (query head ``h`` reads key/value head ``h // (Hq / Hkv)``, as transformers' ``repeat_kv``);
    ``scaling``: the softmax scale (None: ``1 / sqrt(D)``). Computed in :func:`attention_dtype`.
    Returns ``(1, N, Hq, D)``, the layout of transformers' sdpa attention output.
    """
    function, keywords = KERNEL.function, _keywords(KERNEL.function)
    dtype = attention_dtype(query)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (N, H, D)
    options = {}
    if "window_size" in keywords:
        options["window_size"] = (-1, 0)  # causal: every key to the left, none to the right
    else:
        options["is_causal"] = True
    if scaling is not None:
        if "scale" in keywords:
            options["scale"] = scaling
        else:
            q = q * (scaling * math.sqrt(q.shape[-1]))  # the kernel's own scale is 1 / sqrt(D)
    args = rows.kernel_offsets()
    key_index = getattr(rows, "key_index", None)
    if key_index is not None:  # shared prompts: each key row is its prompt's keys then its own (SharedRows)
        k, v = k[key_index], v[key_index]
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in keywords:
        options["enable_gqa"] = True
    elif groups > 1:
        if _GROUPED_KV.get(function, True):
            out = _unrepeated(function, q, k, v, args, options)
            if out is not None:
                return out.unsqueeze(0)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return function(q, k, v, *args, **options).unsqueeze(0)


# Per kernel function: whether it takes Hkv < Hq key/value heads unrepeated (absent: not tried yet).
_GROUPED_KV: dict = {}


def _unrepeated(function, q, k, v, args, options) -> torch.Tensor | None:
    """``function``'s output ``(N, Hq, D)`` for key/value heads not repeated, or None where it refuses them.

    FlashAttention-2 reads Hkv heads for Hq (Hkv dividing Hq) natively and torch 2.11's wrapper checks no head
    counts (it has no ``enable_gqa``): unrepeated, the K/V of the call and those kept for the backward are
    Hq / Hkv times smaller. A kernel that refuses raises before it launches; it then gets repeated heads
    (said once, and remembered for the run).
    """
    try:
        out = function(q, k, v, *args, **options)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        _GROUPED_KV[function] = False
        logger.info("the varlen kernel refuses unrepeated grouped key/value heads (%s): they are repeated.", error)
        return None
    _GROUPED_KV[function] = True
    return out


_ANNOUNCED: set = set()


def announce(path: str, reason: str | None, device_type: str) -> None:
    """Say once per process which attention path packed passes take (and why not the varlen one).

    ``path``: ``"varlen"`` or ``"per-row"``. A pass on a kernel device (CUDA) that cannot use the
    kernel is a warning (row by row is several times slower there); elsewhere the per-row path is the
    design and only logged.
    """
    key = (path, reason, device_type)
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if path == "varlen":
        logger.info("packed passes attend with one varlen_attn call per layer (cu_seqlens built once per pass).")
    elif device_type in KERNEL.device_types:
        logger.warning("packed passes attend row by row with sdpa (cuDNN attention excluded): %s.", reason)
    else:
        logger.info("packed passes attend row by row with sdpa: %s.", reason)
