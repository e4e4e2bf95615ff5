"""Running mean and standard deviation of scores over every process (docs/algorithm.md section 2)."""

from __future__ import annotations

import torch
from accelerate import Accelerator


class RunningMoments:
    """Mean and unbiased std of every value seen so far, merged across processes.

    Batches are merged with the parallel-variance formula (Chan et al.), in float64, so the result
    equals the statistics of the concatenation of all batches of all processes.
    """

    def __init__(self, accelerator: Accelerator | None = None, eps: float = 1e-8):
        self.accelerator = accelerator
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        """Population variance of everything seen (0 before any value)."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation of everything seen (1 until two values were seen)."""
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Add ``xs`` (any shape) of this process, and of all others under several processes.

        Returns the mean and unbiased std of this update's values (all processes). One read of the device
        (and one reduction with several processes): the count, the sum and the sum of squares of the values
        about the running mean ``K`` (a host number) travel together; the batch's mean is then
        ``K + S1 / n`` and its sum of squared deviations ``S2 - S1^2 / n``, in float64.
        """
        xs = xs.detach().to(torch.float64).flatten()
        centred = xs - self.mean  # about the running mean: S1 stays small, so S2 - S1^2 / n keeps its digits
        local = torch.stack([centred.sum(), centred.square().sum(), xs.new_full((), float(xs.numel()))])
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local, reduction="sum")
        s1, s2, batch_count = local.tolist()
        batch_mean = self.mean + s1 / batch_count
        batch_m2 = max(s2 - s1 * s1 / batch_count, 0.0)

        total = self.count + batch_count
        delta = batch_mean - self.mean
        self.m2 = self.m2 + batch_m2 + delta * delta * self.count * batch_count / total
        self.mean = self.mean + delta * batch_count / total
        self.count = int(total)
        batch_std = (batch_m2 / (batch_count - 1)) ** 0.5 if batch_count > 1 else 0.0
        return batch_mean, batch_std

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
