"""The remaining public helpers of classic ``trl.core``, with classic signatures and results.

Users' scripts, notebooks and tests import these from ``trl.core``; after changing the import to
``trl_lite.core`` they behave the same. Shape names: ``B`` rows, ``L`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Scale ``values`` to unit (unbiased) variance over all elements; also centre them when ``shift_mean``.

    Shape: any -> the same shape.
    """
    mean, var = values.mean(), values.var()
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def top_k_top_p_filtering(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    filter_value: float = -float("inf"),
    min_tokens_to_keep: int = 1,
) -> torch.Tensor:
    """Set the logits outside the ``top_k`` best tokens and outside the nucleus of mass ``top_p`` to ``filter_value``.

    ``top_k=0`` and ``top_p=1.0`` keep every token; at least ``min_tokens_to_keep`` survive per row.
    The filtering is transformers' own (``TopKLogitsWarper``, ``TopPLogitsWarper``), as in generation.
    Shape: ``(B, V)`` -> ``(B, V)``.
    """
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    if top_k > 0:
        logits = TopKLogitsWarper(top_k=top_k, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)(None, logits)
    # As in classic, top_p=1.0 runs the nucleus filter too: it drops tokens whose probability is 0.
    if 0 <= top_p <= 1.0:
        logits = TopPLogitsWarper(top_p=top_p, filter_value=filter_value, min_tokens_to_keep=min_tokens_to_keep)(None, logits)
    return logits


def respond_to_batch(
    model: torch.nn.Module, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sample ``txt_len`` tokens after each query, one full forward per token (no cache), as classic does.

    ``model(input_ids)[0]`` must be the logits (a transformers LM or a value-head wrapper).
    Shape: queries ``(B, Lq)`` of equal length (no padding) -> responses ``(B, txt_len)``.
    """
    input_ids = queries
    for _ in range(txt_len):
        next_logits = model(input_ids)[0][:, -1, :]
        next_logits = top_k_top_p_filtering(next_logits, top_k=top_k, top_p=top_p)
        next_token = torch.multinomial(F.softmax(next_logits, dim=-1), num_samples=1)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids[:, -txt_len:]


def convert_to_scalar(stats: Mapping) -> dict:
    """Turn 0-d and one-element 1-D tensors / arrays into Python numbers (TensorBoard logs only scalars).

    Other values are kept as they are; keys and their order are kept.
    """
    out = {}
    for key, value in stats.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and (value.ndim == 0 or value.shape == (1,)):
            value = value.item()
        out[key] = value
    return out


def add_suffix(input_dict: Mapping, suffix: str) -> dict:
    """``{"a": 1}, "_x"`` -> ``{"a_x": 1}``."""
    return {key + suffix: value for key, value in input_dict.items()}


def pad_to_size(tensor: torch.Tensor, size: int, dim: int = 1, padding: int = 50256) -> torch.Tensor:
    """Right-pad the last dimension with ``padding`` until dimension ``dim`` has ``size`` elements.

    As in classic, ``dim`` only selects which length is compared with ``size``; the padding always
    goes to the last dimension (use ``dim=-1`` or the last index). Shape: ``(..., L)`` -> ``(..., size)``.
    """
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, (0, missing), "constant", padding)


def average_torch_dicts(list_of_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean, key by key, of dicts holding tensors of equal shapes."""
    return {key: torch.stack([d[key] for d in list_of_dicts]).mean(dim=0) for key in list_of_dicts[0]}


def listify_batch(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The rows of ``tensor`` as a list: ``(B, ...)`` -> ``B`` tensors ``(...)``."""
    return list(tensor.unbind(0))


def build_bert_batch_from_txt(text_list: Sequence[str], tokenizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize texts for a BERT-style classifier: right-padded ids (pad id 0) and their attention mask.

    Returns ``input_ids`` ``(B, L)`` (int64) and ``attention_mask`` ``(B, L)`` (float, 1 on real
    tokens), ``L`` the longest encoding, both on ``device``.
    """
    encoded = [tokenizer.encode(text, return_tensors="pt")[0] for text in text_list]
    max_len = max(len(ids) for ids in encoded)
    input_ids = torch.zeros(len(encoded), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(encoded), max_len)
    for row, ids in enumerate(encoded):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1.0
    return input_ids.to(device), attention_mask.to(device)


class PPODecorators:
    """Classic's switch for freeing the accelerator's cached memory after decorated work.

    ``PPODecorators.optimize_device_cache = True`` makes every ``with PPODecorators.empty_device_cache():``
    block (or function decorated with it) collect garbage and empty the accelerator's cache on exit.
    """

    optimize_device_cache = False

    @classmethod
    @contextmanager
    def empty_device_cache(cls):
        yield
        if cls.optimize_device_cache and torch.accelerator.is_available():
            # Collect first so tensors only held by reference cycles return their blocks to the cache.
            gc.collect()
            torch.accelerator.empty_cache()
            gc.collect()


def randn_tensor(
    shape: tuple | list,
    generator: torch.Generator | list[torch.Generator] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
) -> torch.Tensor:
    """Standard normal tensor of ``shape`` on ``device``, drawn from ``generator`` (one per row when a list).

    A CPU generator draws on the CPU and the result is moved to ``device``, so a seeded generator
    gives the same numbers on every device. With a list, row ``i`` comes from ``generator[i]``.
    """
    device = torch.device(device or "cpu")
    layout = layout or torch.strided
    generators = generator if isinstance(generator, list) else None
    if generators is not None and len(generators) != shape[0]:
        raise ValueError(f"randn_tensor got {len(generators)} generators for shape {tuple(shape)}; pass one per row (shape[0]).")
    first = generators[0] if generators else generator
    draw_device = first.device if first is not None else device
    if first is not None and draw_device.type != device.type and draw_device.type != "cpu":
        raise ValueError(f"randn_tensor cannot draw a {device} tensor from a {draw_device.type} generator; use a CPU or {device.type} generator.")
    if generators is not None:
        rows = [torch.randn((1, *shape[1:]), generator=g, device=draw_device, dtype=dtype, layout=layout) for g in generators]
        return torch.cat(rows).to(device)
    return torch.randn(tuple(shape), generator=generator, device=draw_device, dtype=dtype, layout=layout).to(device)
