"""Time of the phases of a user's PPO loop (reported in the statistics of the next ``step()``) and of the
phases of ``step()`` itself (``time/ppo/*``), counted where the work runs: on CUDA the GPU's own time."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase, summed until :meth:`pop` hands them over (as ``time/<name>``).

    On CUDA the device is synchronised at both ends of a phase, so queued kernels count in the phase
    that launched them.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pending: dict[str, float] = {}
        # A producer thread (trl_lite.rollouts) times its phases while step() pops them on the trainer's.
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a phase name must be a non-empty string such as 'rollout/reward', got {name!r}")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            key, seconds = f"time/{name}", time.perf_counter() - start
            with self._lock:
                self._pending[key] = self._pending.get(key, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """The phases timed since the last call, and start afresh."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class StepClock:
    """Marks of the phases of one ``step()``: a phase is ``(start, end)`` marks, its seconds :meth:`seconds`.

    On CUDA a mark is a CUDA event recorded in stream order (no host sync): a phase counts the GPU work it
    queued, not the host's launching, which runs ahead. The seconds are read once, at the end of the step
    (:meth:`seconds` waits on the last mark: by then the statistics' copy back has waited for the queued
    kernels, so that wait finds the device idle). Elsewhere a mark is the host clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, spans: dict) -> dict[str, float]:
        """``{name: seconds}`` of ``spans`` (``{name: (start, end)}`` marks of this clock)."""
        if not self.cuda:
            return {name: end - start for name, (start, end) in spans.items()}
        for _, end in spans.values():
            end.synchronize()  # complete already but for the step's last marks, recorded on an idle device
        return {name: start.elapsed_time(end) / 1000.0 for name, (start, end) in spans.items()}
