"""How the benchmarks measure memory: a process's peak growth (`PeakMemory`) and the live tensor bytes at the
peak of a profiled region (`tensor_peak_mb`). See `benchmarks/README.md` for the definitions."""

import gc
import resource
import sys
from pathlib import Path

import torch


class PeakMemory:
    """Peak memory growth, in MB, from `start()` to `peak_mb()`.

    CUDA: torch's peak allocated bytes. CPU on Linux: the kernel's resident-set high-water mark
    (VmHWM), reset to the current RSS at `start()`; elsewhere ru_maxrss growth (a lower bound).
    """

    def __init__(self, device: str):
        self.device = device
        self.baseline = 0.0
        self.read_peak = None

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated() / 2**20
            self.read_peak = lambda: torch.cuda.max_memory_allocated() / 2**20
        elif self._reset_hwm():
            self.baseline = self._proc_status_mb("VmRSS")
            self.read_peak = lambda: self._proc_status_mb("VmHWM")
        else:
            self.baseline = self._maxrss_mb()
            self.read_peak = self._maxrss_mb

    def peak_mb(self) -> float:
        return self.read_peak() - self.baseline

    @staticmethod
    def _reset_hwm() -> bool:
        """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    @staticmethod
    def _proc_status_mb(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"{field} not found in /proc/self/status")

    @staticmethod
    def _maxrss_mb() -> float:
        # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
        scale = 2**20 if sys.platform == "darwin" else 2**10
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def tensor_peak_mb(prof: torch.profiler.profile) -> float:
    """Highest sum of live CPU tensor bytes during a profiled region, counted from its start, in MB.

    Replays, by address, the allocations and frees that `profile_memory=True` records (a free of a tensor made
    before the region subtracts its size). The profiler records only the threads it follows: a tensor whose
    last reference a collective's worker thread drops (gloo's, under several processes) is freed unrecorded.
    A later allocation at the same address proves that free, so the earlier tensor stops counting there;
    one freed unrecorded whose address is not reused counts to the end (the result is an upper bound).
    """
    allocations, events = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live, total, peak = {}, 0, 0
    for _, ptr, nbytes in sorted(allocations):
        if nbytes > 0:
            total += nbytes - live.get(ptr, 0)
            live[ptr] = nbytes
            peak = max(peak, total)
        else:
            total -= live.pop(ptr, -nbytes)
    return peak / 2**20
