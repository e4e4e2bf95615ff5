"""Masked statistics: mean, variance and whitening over the positions where a mask is 1."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1, over ``axis`` (all elements when None).

    Shape: values and mask broadcastable, e.g. ``(B, L)``; result ``()`` or with ``axis`` removed.
    """
    if axis is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` where ``mask`` is 1 (all axes), Bessel-corrected when ``unbiased``.

    With a single unmasked element the unbiased variance is undefined; it is returned as 0
    (no host sync is spent on checking the count). Shape: ``(B, L)`` twice -> ``()``.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        variance = variance * count / (count - 1).clamp(min=1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Scale ``values`` to unit masked variance; also centre them when ``shift_mean``.

    Statistics come from the unmasked elements only (unbiased variance); masked elements are
    transformed too but carry no meaning. Shape: ``(B, L)`` twice -> ``(B, L)``.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min, tensor_max) -> torch.Tensor:
    """Elementwise clamp of ``x`` to ``[tensor_min, tensor_max]``; bounds may be tensors."""
    return torch.max(torch.min(x, torch.as_tensor(tensor_max, dtype=x.dtype, device=x.device)),
                     torch.as_tensor(tensor_min, dtype=x.dtype, device=x.device))
