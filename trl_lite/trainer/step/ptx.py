"""The PTX loss (docs/algorithm.md section 10): the policy's language-modelling loss on pretraining sequences."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from ..layout.rows import to_device
from .forward import ForwardPass


def ptx_loss(forward: ForwardPass, model, seqs: list[torch.Tensor], denominator: float | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` (the policy) over every token (but the first) of ``seqs``
    (1-D token tensors on the device), 0-d and differentiable; with ``denominator`` (the predicted PTX
    tokens of the backward batch, docs/algorithm.md section 18) the sum divided by it instead: this pass's share.

    Right-padded with explicit position ids; the LM head runs only at the N predicting positions. At temperature 1
    whatever ``PPOConfig.temperature`` is: language modelling of the data, not the sampling policy (section 20).
    """
    device, layout = forward.device, forward.layout
    input_ids = pad_sequence(seqs, batch_first=True, padding_value=layout.pad_id)
    counts_host = [len(s) - 1 for s in seqs]
    lengths = to_device([len(s) for s in seqs], device)
    attention_mask = (torch.arange(input_ids.shape[1], device=device) < lengths.unsqueeze(1)).long()
    counts, total = lengths - 1, sum(counts_host)
    row = torch.repeat_interleave(torch.arange(len(seqs), device=device), counts, output_size=total)
    position = torch.arange(total, device=device) - (counts.cumsum(0) - counts)[row]
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_positions": (row, position)}
    if layout.pass_position_ids:
        inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[row, position + 1]
    head = forward.linear_head(model)
    outputs, _, _ = model(**inputs, return_lm_head_inputs=head is not None, return_values=False)
    # Not the forward part's shared logits buffer: it holds the PPO pass's softmax until the backward.
    logprobs, _ = forward.apply_head(head, outputs, targets, total, temperature=1.0)
    return -logprobs.mean() if denominator is None else -logprobs.sum() / denominator
