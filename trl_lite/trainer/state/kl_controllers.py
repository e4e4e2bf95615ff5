"""KL coefficient controllers (docs/algorithm.md section 7)."""

from __future__ import annotations

import math
import warnings


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), section 2.2.

    ``e = clip(kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current: float, n_steps: int) -> None:
        proportional_error = min(max(float(current) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A KL coefficient that never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """The fixed controller ignores the measured KL."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def update_kl_controller(kl_ctl, kl: float, n_steps: int) -> None:
    """Section 7 after a step: ``kl_ctl.update(kl, n_steps)``, unless ``kl`` (``objective/kl``) is not finite.

    A non-finite KL (a NaN in the rollout pass) would make the coefficient NaN for every later step: it is
    left unchanged, with a warning.
    """
    if math.isfinite(kl):
        kl_ctl.update(kl, n_steps)
    else:
        warnings.warn(f"objective/kl is {kl}; the KL coefficient is left unchanged.", stacklevel=3)
