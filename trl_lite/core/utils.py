"""Small helpers of the classic API: statistics dicts, the length sampler and seeding."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

# The value classic pads ragged statistics with (``stack_dicts``), so trackers can tell it apart.
WANDB_PADDING = -1


def flatten_dict(nested: Mapping, sep: str = "/", prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``.

    A key that contains ``sep`` would make two different nestings flatten to the same name, so it
    is rejected with ``ValueError`` (as in classic).
    """
    flat = {}
    for key, value in nested.items():
        if sep in str(key):
            raise ValueError(f"flatten_dict: the separator {sep!r} may not appear in a key, got key {key!r}.")
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, sep, name))
        else:
            flat[name] = value
    return flat


def stack_dicts(stats_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of dicts with the same keys into one dict of ``(N, M)`` tensors, as classic does.

    Each of the ``N`` values is flattened to 1-D (a 0-d value becomes one element); shorter rows are
    right-padded with ``WANDB_PADDING`` (-1) to the longest length ``M``.
    """
    stacked = {}
    for key in stats_dicts[0]:
        rows = [torch.as_tensor(d[key]).flatten() for d in stats_dicts]
        stacked[key] = pad_sequence(rows, batch_first=True, padding_value=WANDB_PADDING)
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
        # Numbers become floats as in classic; 0-d arrays too (classic kept those as arrays), so a
        # step's scalar statistics are plain floats for every logger.
        if (isinstance(value, np.ndarray) and value.ndim == 0) or (np.isscalar(value) and isinstance(value, (int, float, np.number))):
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
