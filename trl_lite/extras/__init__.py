"""Classic add-ons around the PPO loop: best-of-n sampling, DAPO's dynamic sampling."""

from .best_of_n_sampler import BestOfNSampler
from .dynamic_sampling import DynamicSampler, SampledBatch

__all__ = ["BestOfNSampler", "DynamicSampler", "SampledBatch"]
