"""Small helpers of the classic API: statistics dicts, the length sampler and seeding."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np
import torch


def flatten_dict(nested: Mapping, sep: str = "/", prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, sep, name))
        else:
            flat[name] = value
    return flat


def stack_dicts(stats_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of dicts with the same keys into one dict of stacked tensors.

    0-d values become a ``(N,)`` tensor; 1-D values of different lengths are concatenated.
    """
    keys = stats_dicts[0].keys()
    stacked = {}
    for key in keys:
        items = [torch.as_tensor(d[key]) for d in stats_dicts]
        stacked[key] = torch.stack(items) if items[0].dim() == 0 else torch.cat([t.flatten() for t in items])
    return stacked


def stats_to_np(stats: Mapping) -> dict:
    """Detach statistics to numpy / Python floats (0-d values become floats), keeping the keys."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype in (torch.bfloat16, torch.float16):
                value = value.float()
            value = value.numpy()
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = float(value)
        out[key] = value
    return out


class LengthSampler:
    """Draws an integer uniformly from ``[min_value, max_value)`` (the upper bound is excluded, as in the classic API)."""

    def __init__(self, min_value: int, max_value: int):
        if not max_value > min_value:
            raise ValueError(f"LengthSampler needs max_value > min_value, got min_value={min_value}, max_value={max_value}.")
        self.values = list(range(min_value, max_value))

    def __call__(self) -> int:
        return int(np.random.choice(self.values))


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
