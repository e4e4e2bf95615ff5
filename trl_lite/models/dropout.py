"""Switching dropout off in the models a run trains and scores (``PPOConfig.disable_dropout``).

With dropout on, the training forwards of a step see other sub-networks than the passes without grad that
gave ``lp_old`` (the ratio of a fresh mini-batch is not 1), and on CUDA attention dropout keeps packed
passes off the varlen kernel, which has none. transformers' attention layers take their dropout either
from an ``nn.Dropout`` module (GPT-2's ``attn_dropout``) or from a float attribute ``attention_dropout``
(Qwen2, Llama) that they pass to the attention function in train mode: both are set to 0.
"""

from __future__ import annotations

import torch


def _dropouts(models):
    """``(module, attribute, rate)`` of every dropout of ``models`` (modules or None), each module once: every
    ``torch.nn`` dropout module (the value head's too, ``p``) and the float ``attention_dropout`` of attention layers."""
    seen = set()
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                yield module, "p", module.p
            rate = getattr(module, "attention_dropout", None)
            if isinstance(rate, float):
                yield module, "attention_dropout", rate


def disable_dropout_in_model(*models) -> int:
    """Set the probability of every dropout of ``models`` (modules or None) to 0, in place.

    Covers every ``torch.nn`` dropout module (the value head's too) and the float ``attention_dropout``
    attributes of attention layers. Returns how many modules had a non-zero dropout.
    """
    changed = 0
    for module, attribute, rate in list(_dropouts(models)):
        changed += rate != 0
        setattr(module, attribute, 0.0)
    return changed


def has_dropout(*models) -> bool:
    """Whether any dropout of ``models`` (modules or None) is above 0: in train mode they draw random masks."""
    return any(rate != 0 for _, _, rate in _dropouts(models))
