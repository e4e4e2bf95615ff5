"""Classic add-ons around the PPO loop: best-of-n sampling."""

from .best_of_n_sampler import BestOfNSampler

__all__ = ["BestOfNSampler"]
