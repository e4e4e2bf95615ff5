"""Keep memory freed between mini-batches inside the process (glibc's malloc, Linux).

glibc serves each allocation above its mmap threshold with fresh pages from the kernel and hands
them back on free. A PPO step allocates vocabulary-sized tensors (logits, softmax, the tied
embedding's gradient, Adam's temporaries) in every mini-batch, so each of them is page-faulted and
zeroed by the kernel again and again: on the w1 benchmark (2-core CPU) that was 0.3-0.6 s of system
time in a 2.7 s step. Raising the mmap threshold to glibc's maximum and not trimming the heap keeps
those pages mapped and reused, the way GPU caching allocators keep device memory. Resident memory
then stays at its peak instead of shrinking between mini-batches.
"""

from __future__ import annotations

import ctypes
import platform
import sys

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc rejects mmap thresholds above DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64-bit systems.
_MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt's int argument takes


def keep_freed_cpu_memory() -> bool:
    """Make glibc keep freed blocks of up to 32 MiB for reuse instead of returning them to the OS.

    Process-wide and lasting. Returns True when applied; False (and nothing changes) on systems
    without glibc (macOS, Windows, musl).
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
