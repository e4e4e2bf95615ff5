"""Checks of what users hand to ``PPOTrainer``: constructor arguments and ``step()``'s batch.

Every check raises before any state changes, with a message that names the argument (and row),
what was given and what is accepted.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..models import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead
from .ppo_config import PPOConfig

SUPPORTED_MODELS = (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)


def check_constructor_args(config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers):
    if not isinstance(config, PPOConfig):
        raise TypeError(f"config must be a PPOConfig, got {type(config).__name__}.")
    config.validate()  # fields may have been changed after the config was built
    if not isinstance(model, SUPPORTED_MODELS):
        raise TypeError(
            "model must be an AutoModelForCausalLMWithValueHead or AutoModelForSeq2SeqLMWithValueHead "
            f"(wrap a transformers model with .from_pretrained(model)), got {type(model).__name__}."
        )
    if ref_model is not None and not isinstance(ref_model, SUPPORTED_MODELS):
        raise TypeError(f"ref_model must be None or a value-head model like model, got {type(ref_model).__name__}.")
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model is the same object as model; pass None to get a frozen copy.")
    if ref_model is not None and num_shared_layers is not None:
        raise ValueError("num_shared_layers only applies when the trainer creates the reference (ref_model=None).")
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer or None, got {type(tokenizer).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        raise TypeError(f"lr_scheduler must be a torch LR scheduler or None, got {type(lr_scheduler).__name__}.")


def validate_step_inputs(
    queries, responses, scores, response_masks, *, batch_size: int, vocab_size: int | None, is_encoder_decoder: bool
) -> None:
    """Reject a malformed batch with a message naming the argument and row, before any state changes."""
    n = batch_size
    for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of {n} tensors, got {type(value).__name__}.")
        if len(value) != n:
            raise ValueError(
                f"{name} must hold config.batch_size={n} items (per process), got {len(value)}."
            )
    for name, seqs in (("queries", queries), ("responses", responses)):
        for i, seq in enumerate(seqs):
            if not isinstance(seq, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a 1-D torch.LongTensor of token ids, got {type(seq).__name__}.")
            if seq.dim() != 1:
                raise ValueError(f"{name}[{i}] must be 1-D (token ids), got shape {tuple(seq.shape)}.")
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(f"{name}[{i}] must hold integer token ids, got dtype {seq.dtype}.")
            if seq.numel() == 0:
                raise ValueError(f"{name}[{i}] is empty; every query and response needs at least 1 token.")
        if vocab_size is not None:
            lows = torch.stack([s.min() for s in seqs]).cpu()
            highs = torch.stack([s.max() for s in seqs]).cpu()
            bad = ((lows < 0) | (highs >= vocab_size)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise ValueError(
                    f"{name}[{i}] holds token ids outside [0, {vocab_size}) (the model's vocabulary): "
                    f"min {int(lows[i])}, max {int(highs[i])}."
                )
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (torch.Tensor, int, float, np.number, np.ndarray)):
            raise TypeError(f"scores[{i}] must be a number or a 0-d tensor, got {type(score).__name__}.")
        score_t = torch.as_tensor(score)
        if score_t.numel() != 1:
            raise ValueError(f"scores[{i}] must be one number (a 0-d tensor), got shape {tuple(score_t.shape)}.")
        if not torch.isfinite(score_t.float()).all():
            raise ValueError(f"scores[{i}] must be finite, got {score_t.item()}.")
    if response_masks is not None:
        if not isinstance(response_masks, (list, tuple)) or len(response_masks) != n:
            given = len(response_masks) if isinstance(response_masks, (list, tuple)) else type(response_masks).__name__
            raise ValueError(f"response_masks must be a list of {n} tensors (one per response), got {given}.")
        for i, (m, r) in enumerate(zip(response_masks, responses)):
            if not isinstance(m, torch.Tensor):
                raise TypeError(f"response_masks[{i}] must be a tensor of 0/1 like responses[{i}], got {type(m).__name__}.")
            if m.shape != r.shape:
                raise ValueError(
                    f"response_masks[{i}] must have the shape of responses[{i}], {tuple(r.shape)}, got {tuple(m.shape)}."
                )
            if not ((m == 0) | (m == 1)).all():
                raise ValueError(f"response_masks[{i}] must hold only 0 and 1, got values {m.unique().tolist()}.")
    n_actions = count_actions(responses, response_masks, is_encoder_decoder)
    if n_actions < 2:
        raise ValueError(
            f"responses/response_masks: the batch has {n_actions} action token(s) (response tokens with mask 1"
            f"{', excluding the first and last decoder token' if is_encoder_decoder else ''}); "
            "advantage whitening needs at least 2."
        )


def count_actions(responses, response_masks, is_encoder_decoder: bool) -> int:
    """Action tokens of a batch: response tokens with mask 1 (decoder tokens 2.. for encoder-decoders)."""
    if is_encoder_decoder:
        if response_masks is None:
            return sum(max(len(r) - 2, 0) for r in responses)
        return int(sum(m[2:].sum() for m in response_masks if len(m) > 2))
    if response_masks is None:
        return sum(len(r) for r in responses)
    return int(sum(m.sum() for m in response_masks))


def scores_tensor(scores, device) -> torch.Tensor:
    """A list of B scalars (numbers or 0-d tensors) as a float32 ``(B,)`` tensor on ``device``."""
    return torch.stack([torch.as_tensor(s, dtype=torch.float32).to(device).reshape(()) for s in scores])
