"""Running mean and standard deviation of scores over every process (docs/algorithm.md section 2)."""

from __future__ import annotations

import torch
from accelerate import Accelerator


class RunningMoments:
    """Mean and unbiased std of every value seen so far, merged across processes.

    Batches are merged with the parallel-variance formula (Chan et al.), in float64, so the result
    equals the statistics of the concatenation of all batches of all processes. The trainer merges on the
    device (:meth:`update_on_device`: nothing read back); ``count``, ``mean``, ``m2`` (and ``var``, ``std``)
    read the merged state to the host when asked for (one read, then host numbers until the next merge).
    """

    def __init__(self, accelerator: Accelerator | None = None, eps: float = 1e-8):
        self.accelerator = accelerator
        self.eps = eps
        self._host = (0, 0.0, 0.0)  # count, mean, sum of squared deviations from the mean
        self._device = None  # (3,) float64 state newer than _host, or None

    @property
    def count(self) -> int:
        return self._settled()[0]

    @property
    def mean(self) -> float:
        return self._settled()[1]

    @property
    def m2(self) -> float:
        """Sum of squared deviations from the mean of everything seen."""
        return self._settled()[2]

    @property
    def var(self) -> float:
        """Population variance of everything seen (0 before any value)."""
        count, _, m2 = self._settled()
        return m2 / count if count else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation of everything seen (1 until two values were seen)."""
        count, _, m2 = self._settled()
        return (m2 / (count - 1)) ** 0.5 if count > 1 else 1.0

    def _settled(self) -> tuple:
        if self._device is not None:
            count, mean, m2 = self._device.tolist()
            self._host, self._device = (int(count), mean, m2), None
        return self._host

    @torch.no_grad()
    def update_on_device(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``xs`` (any shape) of this process, and of all others under several processes, without a read.

        Returns the running mean and unbiased std after the update (0-d float64 on ``xs``'s device; the std
        is 1 until two values were seen).
        """
        _, mean, std = self._merge(xs)
        return mean, std

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Add ``xs`` (any shape) of this process, and of all others under several processes.

        Returns the mean and unbiased std of this update's values (all processes), as host numbers: one read.
        """
        before_mean = self._settled()[1]
        batch, _, _ = self._merge(xs)
        batch_count, s1, s2, *state = torch.cat([batch, self._device]).tolist()
        self._host, self._device = (int(state[0]), state[1], state[2]), None
        batch_m2 = max(s2 - s1 * s1 / batch_count, 0.0)
        batch_std = (batch_m2 / (batch_count - 1)) ** 0.5 if batch_count > 1 else 0.0
        return before_mean + s1 / batch_count, batch_std

    def _merge(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge ``xs`` into the device state: the batch's ``(n, S1, S2)`` (all processes) and the new running
        mean and std, all on the device.

        The batch's count, sum and sum of squares about the running mean ``K`` travel in one tensor (one
        reduction over processes); its mean is ``K + S1 / n`` and its squared deviations ``S2 - S1^2 / n``.
        """
        xs = xs.detach().to(torch.float64).flatten()
        if self._device is None:  # host numbers as fills on the device: no copy
            self._device = torch.stack([xs.new_full((), float(v)) for v in self._host])
        count, mean, m2 = self._device.unbind()
        centred = xs - mean  # about the running mean: S1 stays small, so S2 - S1^2 / n keeps its digits
        batch = torch.stack([xs.new_full((), float(xs.numel())), centred.sum(), centred.square().sum()])
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            batch = self.accelerator.reduce(batch, reduction="sum")
        batch_count, s1, s2 = batch.unbind()
        delta = s1 / batch_count  # the batch's mean minus the running mean
        total = count + batch_count
        m2 = m2 + (s2 - s1 * s1 / batch_count).clamp(min=0.0) + delta * delta * count * batch_count / total
        mean = mean + delta * batch_count / total
        self._device = torch.stack([total, mean, m2])
        std = torch.where(total > 1, (m2 / (total - 1).clamp(min=1.0)).sqrt(), torch.ones_like(m2))
        return batch, mean, std

    def state_dict(self) -> dict:
        count, mean, m2 = self._settled()
        return {"count": count, "mean": mean, "m2": m2}

    def load_state_dict(self, state: dict) -> None:
        self._host, self._device = (int(state["count"]), float(state["mean"]), float(state["m2"])), None
