"""glibc's malloc settings for training on the CPU (Linux), set by the trainer itself.

glibc serves each allocation above its mmap threshold with fresh pages from the kernel and hands
them back on free. A PPO step allocates vocabulary-sized tensors (logits, softmax, the tied
embedding's gradient, Adam's temporaries) in every mini-batch, so each of them is page-faulted and
zeroed by the kernel again and again: on the w1 benchmark (2-core CPU) that was 0.3-0.6 s of system
time in a 2.7 s step. Raising the mmap threshold to glibc's maximum and not trimming the heap keeps
those pages mapped and reused, the way GPU caching allocators keep device memory. Resident memory
then stays at its peak instead of shrinking between mini-batches.

Every block below the threshold comes from one heap, which fragments: blocks kept for the backward
sit between freed temporaries, and the heap's free blocks stay resident. That surplus follows the
order of the allocations, not the number of tokens, so it does not shrink with a sequence-parallel
process's share of the tokens. A process of a sequence-parallel group therefore gets a lower
threshold (:data:`SEQUENCE_PARALLEL_MMAP_THRESHOLD`: its largest activations are mapped on their own
and returned when freed, the smaller blocks are still kept) and one malloc arena, which gloo's
worker threads then share with the main thread instead of holding arenas of their own
(docs/sequence_parallel.md, "Resident memory").

A pass without grad frees each activation within its layer, so its blocks are transient: from the heap the next
layer reuses them, while a block mapped on its own is faulted in and zeroed by the kernel at every allocation. In
the run's first rollout the heap has not yet grown to hold them, so under the group's threshold every one of them
was mapped (on the benchmark 136-141 maps of 12 MB per process, 415-456k page faults: the first step took 14-18%
more CPU time than under 32 MiB); :func:`transient_blocks_in_heap` puts the rollout's passes back under 32 MiB.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from contextlib import contextmanager

from ...parallel import sequence_parallel_size

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc rejects mmap thresholds above DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64-bit systems.
_MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt's int argument takes
# A sequence-parallel process's threshold and arenas (measured: docs/sequence_parallel.md, "Resident memory").
SEQUENCE_PARALLEL_MMAP_THRESHOLD = 8 << 20
SEQUENCE_PARALLEL_ARENAS = 1
# The mmap threshold set_cpu_malloc lowered this process to (a process of a sequence-parallel group), else None:
# malloc's settings are process-wide and glibc has no getter, so what was set is remembered here.
_lowered_threshold: int | None = None


def _started_with(variable: str, tunable: str) -> bool:
    """Whether the process was started with glibc's own setting (its environment variable or tunable; glibc reads
    them once, at start): the trainer then leaves that setting alone."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return variable in os.environ or any(part.startswith(tunable + "=") for part in tunables.replace(":", " ").split())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mallopt():
    """glibc's ``mallopt``, or None on systems without glibc (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_cpu_memory(mmap_threshold: int = _MMAP_THRESHOLD_MAX, arena_max: int | None = None) -> bool:
    """Make glibc keep freed blocks of up to ``mmap_threshold`` bytes (at most 32 MiB) for reuse instead of
    returning them to the OS, and never trim its heap; with ``arena_max``, let at most that many malloc arenas
    serve the process's threads.

    Process-wide and lasting. Returns True when applied; False (and nothing changes) on systems
    without glibc (macOS, Windows, musl).
    """
    if not _is_int(mmap_threshold) or not 0 < mmap_threshold <= _MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be an int in [1, {_MMAP_THRESHOLD_MAX}] bytes, got {mmap_threshold!r}.")
    if arena_max is not None and (not _is_int(arena_max) or arena_max < 1):
        raise ValueError(f"arena_max must be None or a positive int, got {arena_max!r}.")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    global _lowered_threshold
    _lowered_threshold = None  # a setting of the caller's own: passes without grad leave it alone
    applied = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if applied and arena_max is not None:
        applied = bool(mallopt(_M_ARENA_MAX, arena_max))
    return applied


def set_cpu_malloc(config, accelerator) -> bool:
    """The trainer's malloc settings for ``accelerator``'s process under ``config.keep_freed_cpu_memory``: none
    off the CPU, when switched off, or when the process was started with an mmap threshold of its own
    (``MALLOC_MMAP_THRESHOLD_`` or the tunable ``glibc.malloc.mmap_threshold``). A process of a sequence-parallel
    group keeps blocks up to :data:`SEQUENCE_PARALLEL_MMAP_THRESHOLD` and has :data:`SEQUENCE_PARALLEL_ARENAS`
    arena (unless started with ``MALLOC_ARENA_MAX`` / ``glibc.malloc.arena_max``); any other keeps blocks up to
    32 MiB. Returns whether a setting was applied. A group's lowered threshold is lifted during passes without grad
    (:func:`transient_blocks_in_heap`)."""
    if not config.keep_freed_cpu_memory or accelerator.device.type != "cpu":
        return False
    if _started_with("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"):
        return False
    if sequence_parallel_size(accelerator) > 1:
        arenas = None if _started_with("MALLOC_ARENA_MAX", "glibc.malloc.arena_max") else SEQUENCE_PARALLEL_ARENAS
        applied = keep_freed_cpu_memory(SEQUENCE_PARALLEL_MMAP_THRESHOLD, arenas)
        global _lowered_threshold
        _lowered_threshold = SEQUENCE_PARALLEL_MMAP_THRESHOLD if applied else None
        return applied
    return keep_freed_cpu_memory()


@contextmanager
def transient_blocks_in_heap():
    """Within it, blocks up to 32 MiB come from the heap (the one-process setting) in a process whose threshold
    :func:`set_cpu_malloc` lowered; restored on leaving. For passes without grad (the rollout): their activations
    are freed within the layer, so the heap reuses the same blocks instead of the kernel faulting in and zeroing
    fresh pages for each. Does nothing in any other process (one process, switched off, started with its own
    threshold, without glibc)."""
    lowered = _lowered_threshold
    mallopt = None if lowered is None else _mallopt()
    if mallopt is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, lowered)
