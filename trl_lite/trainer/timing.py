"""Wall-clock time of the phases of a user's PPO loop, reported in the statistics of the next ``step()``."""

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
