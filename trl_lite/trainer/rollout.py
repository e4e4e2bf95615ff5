"""The rollout forward: a batch's rows in the compact layout, mini-batch model inputs, and the
log-prob/value passes of the policy and the reference (PPO_SPEC section 3).

Per-token tensors inside ``step()`` use a compact layout: ``(B, L)`` where position ``k`` of
row ``b`` is the prediction of response token ``k`` (decoder-only models) or of decoder token
``k + 1`` (encoder-decoder models). It holds exactly the action positions of PPO_SPEC section 3
and nothing of the query. Logits are computed only at the slots of that layout that hold a
response token (N of them per mini-batch, see ``_token_slots``), and scattered back into it.
:meth:`RolloutMixin.batched_forward_pass` returns the spec's ``(B, T)`` layout for users.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..core import (
    full_kl_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from ..models import PreTrainedModelWrapper
from ..models.packed_attention import ROW_LENGTHS, attend_per_row, takes_row_lengths


@dataclass
class Rows:
    """The rows of one ``step()`` call, on the device, in a form every pass can slice.

    ``sequences``: per row, query+response (decoder-only) - a list of 1-D tensors;
    ``queries``/``responses``: lists of 1-D tensors; ``query_len``/``response_len``: ``(B,)``;
    ``action_mask``: ``(B, L)`` float, the compact action mask; ``buffer_rows``: the most token
    slots any mini-batch of these rows can have (the LM-head buffers of the step are sized to it);
    ``reuse_logits_buffer``: whether the fused LM head writes into the trainer's one buffer (``step()`` on CPU).
    """

    queries: list
    responses: list
    sequences: list | None
    query_len: torch.Tensor
    response_len: torch.Tensor
    action_mask: torch.Tensor
    buffer_rows: int
    reuse_logits_buffer: bool = False

    def __len__(self):
        return len(self.queries)


class RolloutMixin:
    """The trainer's forward passes over rows: :class:`PPOTrainer` mixes it in.

    Uses the trainer's ``config``, ``accelerator``, ``current_device``, ``model``, ``ref_model``, ``critic``,
    ``is_encoder_decoder`` and the tokenizer-derived ``_pad_id``/``_padding_side``/``_pass_position_ids``.
    """

    def _make_rows(self, queries, responses, response_masks) -> Rows:
        """Move one batch to the device and build its compact action mask ``(B, L)``."""
        device = self.current_device
        queries = [q.to(device=device, dtype=torch.long) for q in queries]
        responses = [r.to(device=device, dtype=torch.long) for r in responses]
        query_len = torch.tensor([len(q) for q in queries], device=device)
        response_len = torch.tensor([len(r) for r in responses], device=device)
        if response_masks is not None:
            padded_masks = pad_sequence([m.to(device=device, dtype=torch.float32) for m in response_masks], batch_first=True)
        else:
            padded_masks = torch.ones(len(responses), int(response_len.max()), device=device)
        if self.is_encoder_decoder:
            # Decoder position t predicts decoder token t + 1; the decoder start token (t = 0's input)
            # and the prediction of the first response token are not actions, as in the classic trainer.
            width = max(int(response_len.max()) - 1, 1)
            k = torch.arange(width, device=device)
            in_range = (k >= 1) & (k < (response_len - 1).unsqueeze(1))
            token_mask = torch.nn.functional.pad(padded_masks[:, 1:], (0, width + 1 - padded_masks.shape[1]))
            action_mask = in_range.float() * token_mask[:, :width]
            sequences = None
        else:
            k = torch.arange(int(response_len.max()), device=device)
            action_mask = (k < response_len.unsqueeze(1)).float() * padded_masks
            sequences = [torch.cat((q, r)) for q, r in zip(queries, responses)]
        # Every mini-batch's LM-head buffer gets this many rows, so the memory freed by one mini-batch
        # fits the next exactly (see core.logprobs._lm_head_logits).
        counts = sorted((self._slot_count(r) for r in responses), reverse=True)
        buffer_rows = sum(counts[: self.config.mini_batch_size])
        return Rows(queries, responses, sequences, query_len, response_len, action_mask, buffer_rows)

    def _slot_count(self, response: torch.Tensor) -> int:
        """How many slots of a row predict one of its response tokens (all but the first for encoder-decoders)."""
        return max(len(response) - (1 if self.is_encoder_decoder else 0), 0)

    def _width(self, rows: Rows, idx: torch.Tensor) -> int:
        """Compact length ``L_mb`` of rows ``idx``: their longest response (minus one for encoder-decoders).

        Read from the host-side lengths of the response tensors, as :meth:`_token_slots` does.
        """
        longest = max(len(rows.responses[i]) for i in idx.tolist())
        return max(longest - 1, 1) if self.is_encoder_decoder else longest

    def _minibatch_inputs(
        self, rows: Rows, idx: torch.Tensor, packed: bool = False
    ) -> tuple[dict, torch.Tensor, tuple, torch.Tensor, int]:
        """Model inputs of rows ``idx``: padded to their own longest row, or with ``packed`` (decoder-only
        models only) concatenated into one row without padding (see :meth:`_packed_inputs`).

        Returns the model kwargs, ``positions (b, L_mb)`` of the compact slots along dimension 1 of
        the model's per-token outputs (``(b, S)`` padded, ``(1, N_total)`` packed: read them with
        :func:`at_positions`), the slots that hold a response token as a pair ``(row, k)`` of length
        N (see :meth:`_token_slots`), their ``targets (N,)`` (the predicted token ids) and ``L_mb``.
        The model is asked for logits at those N slots only.
        """
        if packed:
            return self._packed_inputs(rows, idx)
        index = idx.tolist()
        device = self.current_device
        if self.is_encoder_decoder:
            enc = pad_sequence([rows.queries[i] for i in index], batch_first=True, padding_value=self._pad_id)
            dec = pad_sequence([rows.responses[i] for i in index], batch_first=True, padding_value=self._pad_id)
            if dec.shape[1] < 2:
                dec = torch.nn.functional.pad(dec, (0, 2 - dec.shape[1]), value=self._pad_id)
            q_len, r_len = rows.query_len[idx], rows.response_len[idx]
            enc_mask = (torch.arange(enc.shape[1], device=device) < q_len.unsqueeze(1)).long()
            dec_mask = (torch.arange(dec.shape[1], device=device) < r_len.unsqueeze(1)).long()
            width = dec.shape[1] - 1
            positions = torch.arange(width, device=device).expand(len(index), width)
            slots = self._token_slots(rows, index, width)
            inputs = {
                "input_ids": enc,
                "attention_mask": enc_mask,
                "decoder_input_ids": dec,
                "decoder_attention_mask": dec_mask,
                "logits_positions": slots,
            }
            return inputs, positions, slots, dec[slots[0], slots[1] + 1], width

        lengths = rows.query_len[idx] + rows.response_len[idx]
        side = self._padding_side
        input_ids = pad_sequence(
            [rows.sequences[i] for i in index], batch_first=True, padding_value=self._pad_id, padding_side=side
        )
        seq_len = input_ids.shape[1]
        arange = torch.arange(seq_len, device=device)
        pad_left = seq_len - lengths if side == "left" else torch.zeros_like(lengths)
        attention_mask = ((arange >= pad_left.unsqueeze(1)) & (arange < (pad_left + lengths).unsqueeze(1))).long()
        width = self._width(rows, idx)
        start = pad_left + rows.query_len[idx] - 1
        # Positions past a row's response are padding of the compact layout; clamp them into range.
        positions = (start.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=seq_len - 2)
        slots = self._token_slots(rows, index, width)
        token_positions = positions[slots]
        targets = input_ids[slots[0], token_positions + 1]
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "logits_positions": (slots[0], token_positions),
        }
        if self._pass_position_ids:
            # Explicit positions make the result independent of the padding side.
            inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return inputs, positions, slots, targets, width

    def _packed_inputs(self, rows: Rows, idx: torch.Tensor) -> tuple[dict, torch.Tensor, tuple, torch.Tensor, int]:
        """:meth:`_minibatch_inputs` of rows ``idx`` packed: ``input_ids`` and ``position_ids`` ``(1, N_total)``.

        The rows' query+response sequences are concatenated with no padding; each row's position ids
        start again at 0. With no ``attention_mask``, transformers reads the row boundaries from the
        restarting position ids (``masking_utils.find_packed_sequence_indices``) and builds attention
        that never crosses rows: a block-diagonal causal mask for sdpa/eager/flex, varlen kernels for
        flash attention. So every token sees exactly what it sees in the padded layout, at the same
        position, and no padding token is computed. Built from host-side lengths: no device sync.
        """
        index, device = idx.tolist(), self.current_device
        lengths = [len(rows.sequences[i]) for i in index]
        total = sum(lengths)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        lengths_t = torch.tensor(lengths, device=device)
        starts_t = torch.tensor(starts, device=device)
        input_ids = torch.cat([rows.sequences[i] for i in index]).unsqueeze(0)
        row_start = torch.repeat_interleave(starts_t, lengths_t, output_size=total)
        position_ids = (torch.arange(total, device=device) - row_start).unsqueeze(0)
        width = self._width(rows, idx)
        start = starts_t + rows.query_len[idx] - 1
        # Slots past a row's response are padding of the compact layout (masked): any index in range does.
        positions = (start.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=total - 1)
        slots = self._token_slots(rows, index, width)
        token_positions = positions[slots]
        targets = input_ids[0, token_positions + 1]
        inputs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "logits_positions": (torch.zeros_like(token_positions), token_positions),
        }
        return inputs, positions, slots, targets, width

    def _packs(self, model) -> bool:
        """Whether the passes of ``model`` take packed rows: packing is on and ``model`` is one the trainer checked."""
        return self._pack and any(model is known for known, _ in self._unwrapped)

    def _find_row_attention_models(self, modules) -> None:
        """Note which of ``modules`` (prepared policy, reference, critic) get per-row attention in packed passes.

        Those :func:`~trl_lite.models.packed_attention.takes_row_lengths` accepts (sdpa models);
        the others attend through transformers' block-diagonal mask, to the same result.
        """
        self._row_attention_models = {}
        for module in (m for m in modules if m is not None and self._pack):
            inner = next((inner for known, inner in self._unwrapped if module is known), None)
            inner = self.accelerator.unwrap_model(module) if inner is None else inner
            if takes_row_lengths(inner.transformers_model):
                self._row_attention_models[id(module)] = inner.transformers_model

    def _per_row_attention(self):
        """The block in which packed passes attend within each row (forward and backward passes)."""
        return attend_per_row(self._row_attention_models.values())

    def _token_slots(self, rows: Rows, index: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compact slots ``(row, k)`` of rows ``index`` that predict a response token, each ``(N,)``.

        Slot k of a row predicts its response token k (k + 1 for encoder-decoders); slots past the
        row's response are the padding of the compact layout and are left out, so the LM head and
        the softmax run on N = sum of the rows' token counts instead of b * L_mb positions. Built
        from host-side lengths: no device sync.
        """
        counts = [min(self._slot_count(rows.responses[i]), width) for i in index]
        total, device = sum(counts), self.current_device
        counts_t = torch.tensor(counts, device=device)
        row = torch.repeat_interleave(torch.arange(len(index), device=device), counts_t, output_size=total)
        k = torch.arange(total, device=device) - (counts_t.cumsum(0) - counts_t)[row]
        return row, k

    def _forward_rows(
        self, model, rows: Rows, idx: torch.Tensor, return_logits: bool = False, return_values: bool = True, critic=None
    ):
        """Log-probs and values at the action positions of rows ``idx``.

        Shapes: logprobs, values ``(b, L_mb)`` (log-probs 0 past each response; values None without
        ``return_values``, when the value head does not run); with ``return_logits`` also the logits
        ``(N, V)`` at the token ``slots`` (else None for both). The values come from ``critic`` when
        given (see :meth:`_head_rows`).
        """
        head = None if return_logits else self._linear_head(model)
        outputs, targets, values, slots, width = self._head_rows(
            model, rows, idx, lm_head_inputs=head is not None, return_values=return_values, critic=critic
        )
        if head is None:
            logprobs = logprobs_from_logits(outputs, targets)
        else:
            out = self._logits_out(rows, head)
            logprobs = logprobs_from_hidden(outputs, head.weight, head.bias, targets, rows.buffer_rows, out)
        logprobs = _to_compact(logprobs, slots, len(idx), width)
        return logprobs, values, (outputs if return_logits else None), (slots if return_logits else None), width

    def _head_rows(
        self, model, rows: Rows, idx: torch.Tensor, lm_head_inputs: bool = False, return_values: bool = True, critic=None
    ):
        """The LM head's logits ``(N, V)`` at the token slots of rows ``idx`` - or, with ``lm_head_inputs``,
        its inputs ``(N, H)`` - their target ids ``(N,)`` and the values ``(b, L_mb)`` (None without ``return_values``).

        With a separate ``critic`` (PPO_SPEC section 9) the values are its outputs on the same
        mini-batch inputs, read at the same positions; the policy's value head does not run.
        """
        packed = self._packs(model)
        inputs, positions, slots, targets, width = self._minibatch_inputs(rows, idx, packed=packed)
        critic_inputs = {key: value for key, value in inputs.items() if key != "logits_positions"}
        if lm_head_inputs:
            inputs["return_lm_head_inputs"] = True
        if packed:
            lengths = tuple(len(rows.sequences[i]) for i in idx.tolist())
            for module, module_inputs in ((model, inputs), (critic, critic_inputs)):
                if id(module) in self._row_attention_models:
                    module_inputs[ROW_LENGTHS] = lengths
        outputs, _, values = model(**inputs, return_values=return_values and critic is None)
        if critic is not None:
            values = critic(**critic_inputs)
        if values is not None:
            values = (values[:, :-1] if self.is_encoder_decoder else at_positions(values, positions)).float()
        return outputs, targets, values, slots, width

    def _linear_head(self, model) -> torch.nn.Linear | None:
        """The model's LM head when the trainer may fuse it with the log-softmax, else None.

        Fused (``core.logprobs_and_entropy_from_hidden``), the head's logits become the softmax in
        place, in a buffer of ``Rows.buffer_rows`` rows: one vocabulary-sized tensor per mini-batch
        instead of two, of the same size in every mini-batch of a step.
        """
        unwrapped = next((inner for known, inner in self._unwrapped if model is known), None)
        if unwrapped is None:
            unwrapped = self.accelerator.unwrap_model(model)
        # Asked every pass: the head may be replaced (resize_token_embeddings) after the trainer is made.
        return unwrapped.linear_lm_head()

    def _logits_out(self, rows: Rows, head: torch.nn.Linear) -> torch.Tensor | None:
        """The ``(R, V)`` buffer the fused LM head of this pass writes its logits into, or None (a fresh one).

        Only when ``rows.reuse_logits_buffer`` (CPU with ``keep_freed_cpu_memory``): one buffer, made
        at the first fused pass, grown when a step needs more rows and kept between steps, so no
        vocabulary-sized block is freed and allocated again per mini-batch. glibc splits freed blocks
        for later small allocations, and a block that no longer fits in what is left grows the heap
        (the resident peak of w1 varied by tens of MB between runs). Each pass of ``step()`` is done with
        the buffer before the next begins (a training pass after its backward). Elsewhere each pass
        allocates its own: GPU caching allocators reuse blocks of one size well.
        """
        if not rows.reuse_logits_buffer:
            return None
        buffer = _fitting(self._logits_buffer, head)
        if buffer is None or buffer.shape[0] < rows.buffer_rows:
            self._logits_buffer = None  # freed before its successor is allocated
            dtype = torch.promote_types(head.weight.dtype, torch.float32)
            shape = (rows.buffer_rows, head.weight.shape[0])
            self._logits_buffer = buffer = torch.empty(shape, dtype=dtype, device=head.weight.device)
        return buffer

    @contextmanager
    def _reference(self):
        """Yield the module that computes reference log-probs: the ref model, or the policy without its adapter."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self._unwrapped_model.pretrained_model.disable_adapter():
                yield self.model

    @torch.no_grad()
    def _rollout_forward(self, rows: Rows):
        """Policy and reference passes without grad, in mini-batches (PPO_SPEC section 3).

        Returns logprobs, ref_logprobs, values ``(B, L)`` and, for ``kl_penalty="full"``, the exact
        per-token KL ``(B, L)`` (else None). Full-KL logits live one mini-batch at a time. The
        reference's value head never runs, nor the policy's when ``_uses_value_head`` is False
        (values are then zeros).
        """
        full = self.config.kl_penalty == "full"
        batch, width = len(rows), rows.action_mask.shape[1]
        out = torch.zeros(4 if full else 3, batch, width, device=self.current_device)
        self.model.eval()
        if self.critic is not None:
            self.critic.eval()
        with self._per_row_attention():
            for idx in torch.arange(batch, device=self.current_device).split(self.config.mini_batch_size):
                logprobs, values, logits, slots, w = self._forward_rows(
                    self.model, rows, idx, return_logits=full, return_values=self._uses_value_head, critic=self.critic
                )
                with self._reference() as ref:
                    ref_logprobs, _, ref_logits, _, _ = self._forward_rows(ref, rows, idx, return_logits=full, return_values=False)
                out[0, idx, :w], out[1, idx, :w] = logprobs, ref_logprobs
                if values is not None:
                    out[2, idx, :w] = values
                if full:
                    out[3, idx, :w] = _to_compact(full_kl_from_logits(logits, ref_logits), slots, len(idx), w)
        mask = rows.action_mask
        return out[0] * mask, out[1] * mask, out[2] * mask, (out[3] * mask if full else None)

    def prepare_model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> dict:
        """Pad one batch the classic way: query+response (decoder-only) or encoder/decoder inputs.

        Padding follows the tokenizer's padding side. Shapes: ``input_ids``, ``attention_mask``
        ``(B, S)`` (plus ``decoder_input_ids``, ``decoder_attention_mask`` for encoder-decoders).
        """
        rows = self._make_rows(queries, responses, None)
        inputs, _, _, _, _ = self._minibatch_inputs(rows, torch.arange(len(rows), device=self.current_device))
        inputs.pop("logits_positions", None)
        return inputs

    @torch.no_grad()
    def batched_forward_pass(
        self,
        model: PreTrainedModelWrapper,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        model_inputs: dict,
        return_logits: bool = False,
        response_masks: list[torch.Tensor] | None = None,
    ):
        """Log-probs, values and action masks of a batch in mini-batches, in the spec's ``(B, T)`` layout.

        ``model_inputs`` (from :meth:`prepare_model_inputs`) fixes ``T = S - 1``. Returns
        ``(logprobs, logits or None, values, masks)``: ``(B, T)`` each, logits ``(B, T, V)``
        (zero where no response token is predicted).
        """
        rows = self._make_rows(queries, responses, response_masks)
        ids_key = "decoder_input_ids" if self.is_encoder_decoder else "input_ids"
        batch, seq_len = model_inputs[ids_key].shape
        length = seq_len - 1
        if self.is_encoder_decoder:
            cols = torch.arange(rows.action_mask.shape[1], device=self.current_device).expand(batch, -1)
        else:
            attention = model_inputs["attention_mask"]
            pad_left = attention.long().argmax(-1)  # first 1 of each row; 0 under right padding
            start = pad_left + rows.query_len - 1
            cols = start.unsqueeze(1) + torch.arange(rows.action_mask.shape[1], device=self.current_device)
        valid = cols < length
        cols = cols.clamp(max=length - 1)
        logprobs = torch.zeros(batch, length, device=self.current_device)
        values = torch.zeros_like(logprobs)
        masks = torch.zeros_like(logprobs)
        logits_out = None
        model.eval()
        for idx in torch.arange(batch, device=self.current_device).split(self.config.mini_batch_size):
            with self._per_row_attention():
                lp, val, logits, slots, w = self._forward_rows(model, rows, idx, return_logits=return_logits)
            ok = valid[idx, :w] & rows.action_mask[idx, :w].bool()
            # Only the action entries are written: the clamped compact padding repeats column T - 1,
            # and a scatter with repeated indices may keep the padding's zero over a real action.
            r, c = idx.unsqueeze(1).expand(-1, w)[ok], cols[idx, :w][ok]
            logprobs[r, c], values[r, c], masks[r, c] = lp[ok], val[ok], 1.0
            if return_logits:
                if logits_out is None:
                    logits_out = torch.zeros(batch, length, logits.shape[-1], device=self.current_device)
                logits_out[r, c] = _to_compact(logits.float(), slots, len(idx), w)[ok]
        return logprobs, logits_out, values, masks


def at_positions(per_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Entries of a model's per-token output ``(b, S)`` - or ``(1, N_total)`` for packed rows - at the
    compact ``positions (b, L_mb)`` of :meth:`RolloutMixin._minibatch_inputs`: ``(b, L_mb)``.

    Differentiable; a packed output's one row is shared by the b rows of ``positions``.
    """
    return per_token.expand(positions.shape[0], -1).gather(1, positions)


def packing_unsupported(wrapper: PreTrainedModelWrapper) -> str | None:
    """Why ``wrapper`` cannot take packed rows (:meth:`RolloutMixin._packed_inputs`), or None when it can.

    Packing needs a decoder-only transformers model that takes ``position_ids`` and builds its
    attention mask with ``transformers.masking_utils`` (which detects packed rows from them), under an
    attention implementation that utility knows; prompt-learning adapters prepend tokens to each row.
    """
    if wrapper.is_encoder_decoder:
        return "it is an encoder-decoder"
    if wrapper.is_peft_model and wrapper.pretrained_model.active_peft_config.is_prompt_learning:
        return "its prompt-learning adapter prepends virtual tokens to every row"
    model = wrapper.transformers_model
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no position_ids"
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
    if not hasattr(sys.modules.get(type(backbone).__module__), "create_causal_mask"):
        return f"{type(backbone).__name__} does not build its attention mask with transformers.masking_utils"
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"its attention implementation {implementation!r} is not one masking_utils builds packed masks for"
    return None


def _fitting(buffer: torch.Tensor | None, head: torch.nn.Linear) -> torch.Tensor | None:
    """``buffer`` if it can hold the logits of ``head`` (vocabulary and dtype), else None."""
    if buffer is None or buffer.shape[1] != head.weight.shape[0]:
        return None
    return buffer if buffer.dtype == torch.promote_types(head.weight.dtype, torch.float32) else None


def _to_compact(values: torch.Tensor, slots: tuple, rows: int, width: int) -> torch.Tensor:
    """Per-slot ``values (N, ...)`` placed at ``slots = (row, k)`` of a zero ``(rows, width, ...)`` tensor.

    Differentiable with respect to ``values``.
    """
    return values.new_zeros((rows, width, *values.shape[1:])).index_put(slots, values)
