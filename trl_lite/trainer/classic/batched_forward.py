"""The classic batch helpers over the forward part: ``prepare_model_inputs`` and ``batched_forward_pass``.

Classic TRL's trainer exposes both; ``PPOTrainer`` keeps them (``classic_helpers.py``) and they run on
:class:`~.forward.ForwardPass`'s packed or padded passes, returning the classic ``(B, T)`` layout.
"""

from __future__ import annotations

import torch

from ..layout.rows import Rows, to_compact
from ..step.forward import ForwardPass


def prepare_model_inputs(forward: ForwardPass, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
    """Pad one batch the classic way: query+response (decoder-only) or encoder/decoder inputs.

    Padding follows the tokenizer's padding side. Shapes: ``input_ids``, ``attention_mask``
    ``(B, S)`` (plus ``decoder_input_ids``, ``decoder_attention_mask`` for encoder-decoders).
    """
    rows = forward.make_rows(queries, responses)
    index = list(range(len(rows)))
    inputs, _, _, _, _ = forward.layout.inputs(rows, index, torch.arange(len(rows), device=forward.device))
    inputs.pop("logits_positions", None)
    return inputs

@torch.no_grad()
def batched_forward_pass(forward: ForwardPass, model, queries, responses, model_inputs: dict,
                         return_logits: bool = False, response_masks=None):  # fmt: skip
    """Log-probs, values and action masks of a batch in mini-batches, in the classic ``(B, T)`` layout.

    ``model_inputs`` (from :func:`prepare_model_inputs`) fixes ``T = S - 1``. Returns
    ``(logprobs, logits or None, values, masks)``: ``(B, T)`` each, logits ``(B, T, V)``
    (zero where no response token is predicted).
    """
    rows = forward.make_rows(queries, responses, response_masks)
    ids_key = "decoder_input_ids" if forward.is_encoder_decoder else "input_ids"
    batch, seq_len = model_inputs[ids_key].shape
    length, device = seq_len - 1, forward.device
    columns = torch.arange(rows.action_mask.shape[1], device=device)
    if forward.is_encoder_decoder:
        cols = columns.expand(batch, -1)
    else:
        pad_left = model_inputs["attention_mask"].long().argmax(-1)  # first 1 of each row; 0 under right padding
        cols = (pad_left + rows.query_len - 1).unsqueeze(1) + columns
    valid = cols < length
    cols = cols.clamp(max=length - 1)
    model.eval()

    def passes():
        outs = [torch.zeros(batch, length, device=device) for _ in range(3)]  # log-probs, values, masks
        logits_out = []  # filled at the first pass: (B, T, V)
        # The processes agree on the passes only where every forward is collective (ZeRO-3, sequence parallelism),
        # so the caller runs this on every process anyway; elsewhere a user may call it on some of them.
        for index, idx in forward.minibatches(rows, agree=forward.memory.forwards_synchronise):
            forward.memory.begin_pass(sum(rows.tokens(i) for i in index), len(index))
            with forward.memory.attempt(what="a batched_forward_pass pass"):
                _classic_pass(forward, model, rows, index, idx, valid, cols, outs, logits_out, return_logits)
            if forward.memory.stop_early:
                break
        return outs[0], (logits_out[0] if logits_out else None), outs[1], outs[2]

    # A pass that runs out of memory: every pass again with half the budget (see oom_backoff) - on one
    # process only: a user may call this on some processes, and the agreement would wait for the others.
    return forward.memory.until_done(passes, every_process=False)

def _classic_pass(forward: ForwardPass, model, rows: Rows, index: list[int], idx: torch.Tensor, valid: torch.Tensor,
                  cols: torch.Tensor, outs: list, logits_out: list, return_logits: bool) -> None:  # fmt: skip
    """One pass of :func:`batched_forward_pass` over rows ``index``: writes their log-probs, values and
    mask into ``outs`` (three ``(B, T)``) and, with ``return_logits``, their logits into ``logits_out[0]``."""
    with forward.per_row_attention():
        # The policy's log-probs under truncated sampling are log pi_T^K (docs/algorithm_rollouts.md section 23); a reference's are not.
        policy = forward.unwrapped(model) is forward.models[0][1]
        lp, val, logits, slots, w = forward.logprobs(model, rows, index, idx, return_logits=return_logits,
                                                     truncated=policy)  # fmt: skip
    ok = valid[idx, :w] & rows.action_mask[idx, :w].bool()
    # Only the action entries are written: the clamped compact padding repeats column T - 1,
    # and a scatter with repeated indices may keep the padding's zero over a real action.
    r, c = idx.unsqueeze(1).expand(-1, w)[ok], cols[idx, :w][ok]
    outs[0][r, c], outs[1][r, c], outs[2][r, c] = lp[ok], val[ok], 1.0
    if return_logits:
        if not logits_out:
            logits_out.append(torch.zeros(*outs[0].shape, logits.shape[-1], device=forward.device))
        logits_out[0][r, c] = to_compact(logits.float(), slots, len(index), w)[ok]
