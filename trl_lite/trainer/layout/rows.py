"""The rows of one ``step()``: the compact per-token layout, the action mask, and mini-batch model inputs.

Per-token tensors inside ``step()`` use a compact layout (docs/algorithm.md, notation): ``(B, L)``
where column ``k`` of row ``b`` is the prediction of response token ``k`` (decoder-only models) or
of decoder token ``k + 1`` (encoder-decoder models, ``shift = 1``). It holds exactly the action
positions of docs/algorithm.md section 3 and nothing of the query. Logits are computed only at the
slots of that layout that hold a response token (N of them per mini-batch, see :func:`token_slots`).
Every length the layout needs is read on the host, from the response tensors' sizes: building a
mini-batch costs no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence


def to_device(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A host list as a tensor on ``device`` without a blocking copy (pinned and non-blocking on CUDA)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def action_mask(response_lengths: list[int], response_masks: torch.Tensor | None, shift: int, device="cpu") -> torch.Tensor:
    """The compact action mask ``(B, L)`` float: the one place that says which tokens are actions.

    Decoder-only (``shift = 0``): column ``k`` is response token ``k``, an action when ``k < len`` and
    its ``response_masks`` entry is 1. Encoder-decoder (``shift = 1``): column ``k`` predicts decoder
    token ``k + 1``; decoder token 0 is the start token and the prediction of token 1 (column 0) is
    not an action either, as in the classic trainer, so the actions are decoder tokens ``2 .. len - 1``.
    ``response_lengths``: B host ints; ``response_masks (B, L_max)`` right-padded 0/1 on ``device``, or None
    (all ones).
    """
    longest = max(response_lengths)
    if response_masks is None:
        response_masks = torch.ones(len(response_lengths), longest, device=device)
    width = max(longest - shift, 1)
    k = torch.arange(width, device=device)
    in_range = (k >= shift) & (k < to_device([n - shift for n in response_lengths], device).unsqueeze(1))
    token_mask = torch.nn.functional.pad(response_masks[:, shift:], (0, width + shift - response_masks.shape[1]))
    return in_range.float() * token_mask[:, :width]


def padded_masks(response_masks: list[torch.Tensor] | None, device) -> torch.Tensor | None:
    """``step()``'s per-row 0/1 masks, right-padded to ``(B, L_max)`` float on ``device`` (None stays None)."""
    if response_masks is None:
        return None
    return pad_sequence([m.to(device=device, dtype=torch.float32) for m in response_masks], batch_first=True)


def actions_per_row(responses: list[torch.Tensor], response_masks: list[torch.Tensor] | None, shift: int) -> tuple:
    """Per row its action tokens (see :func:`action_mask`: response tokens ``2 * shift ..`` with mask 1), host ints.

    Without masks from the host lengths alone; with masks one read per device they are on (none for host masks).
    """
    if response_masks is None:
        return tuple(max(len(r) - 2 * shift, 0) for r in responses)
    by_device = {}
    for i, mask in enumerate(response_masks):
        by_device.setdefault(mask.device, []).append(i)
    counts = [0] * len(response_masks)
    for rows in by_device.values():
        sums = torch.stack([response_masks[i][2 * shift :].sum() for i in rows]).tolist()
        for i, n in zip(rows, sums):
            counts[i] = int(n)
    return tuple(counts)


def concat_by_device(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` flattened and concatenated, one 1-D tensor per device they are on (in first-seen order)."""
    by_device = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor.reshape(-1))
    return [torch.cat(parts) for parts in by_device.values()]


@dataclass(frozen=True)
class Rows:
    """The rows of one ``step()`` call, on the device, in a form every pass can slice.

    ``queries``/``responses``: lists of 1-D tensors; ``sequences``: per row query+response (decoder-only,
    else None); ``query_len``/``response_len``: ``(B,)`` on the device; ``action_mask``: ``(B, L)``
    float; ``shift``: 1 for encoder-decoders (column k predicts decoder token k + 1), else 0;
    ``buffer_rows``: the most token slots any mini-batch (or pass under a token budget) of these rows
    can have (the LM-head buffers of the step are sized to it); ``prompt_ids``: per row the first row with
    its query tokens when packed passes share prompts (:mod:`.prefix_sharing`), else None; ``kept``: under
    truncated sampling the kept sets of the ``(B, L)`` positions (docs/algorithm_rollouts.md section 23), else None.
    """

    queries: list
    responses: list
    sequences: list | None
    query_len: torch.Tensor
    response_len: torch.Tensor
    action_mask: torch.Tensor
    shift: int
    buffer_rows: int
    prompt_ids: tuple | None = None
    kept: object = None  # truncated sampling: the positions' kept sets (trl_lite.core.kept_sets.KeptSets), else None

    def __len__(self) -> int:
        return len(self.queries)

    def slot_count(self, i: int) -> int:
        """How many compact columns of row ``i`` predict one of its response tokens."""
        return max(len(self.responses[i]) - self.shift, 0)

    def tokens(self, i: int) -> int:
        """Prompt + response tokens of row ``i``: its cost under a token budget (docs/algorithm.md section 18)."""
        return len(self.queries[i]) + len(self.responses[i])

    def width(self, index: list[int]) -> int:
        """Compact length ``L_mb`` of rows ``index``: their longest response (minus ``shift``), at least 1."""
        return max(max(len(self.responses[i]) for i in index) - self.shift, 1)


def make_rows(queries, responses, response_masks, *, device, is_encoder_decoder: bool, mini_batch_size: int,
              max_tokens: int | None = None) -> Rows:  # fmt: skip
    """Move one batch to ``device`` and build its compact action mask ``(B, L)``.

    ``max_tokens``: the token budget of a pass (None: passes of ``mini_batch_size`` rows), which bounds
    ``buffer_rows``.
    """
    queries = [q.to(device=device, dtype=torch.long) for q in queries]
    responses = [r.to(device=device, dtype=torch.long) for r in responses]
    response_lengths = [len(r) for r in responses]
    query_len = to_device([len(q) for q in queries], device)
    response_len = to_device(response_lengths, device)
    shift = 1 if is_encoder_decoder else 0
    mask = action_mask(response_lengths, padded_masks(response_masks, device), shift, device)
    sequences = None if is_encoder_decoder else [torch.cat((q, r)) for q, r in zip(queries, responses)]
    # Every mini-batch's LM-head buffer gets this many rows, so the memory freed by one mini-batch
    # fits the next exactly (see core.lm_head._lm_head_logits).
    counts = sorted((max(len(r) - shift, 0) for r in responses), reverse=True)
    buffer_rows = sum(counts[:mini_batch_size])
    if max_tokens is not None:
        # A pass of several rows holds at most max_tokens tokens, so as many slots; a longer row is alone.
        buffer_rows = max(min(max_tokens, sum(counts)), counts[0])
    return Rows(queries, responses, sequences, query_len, response_len, mask, shift, buffer_rows)


def token_slots(rows: Rows, index: list[int], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact slots ``(row, k)`` of rows ``index`` that predict a response token, each ``(N,)``.

    Slots past a row's response are the padding of the compact layout and are left out, so the LM
    head and the softmax run on N = sum of the rows' token counts instead of ``b * L_mb`` positions.
    """
    counts = [min(rows.slot_count(i), width) for i in index]
    total = sum(counts)
    counts_t = to_device(counts, device)
    row = torch.repeat_interleave(torch.arange(len(index), device=device), counts_t, output_size=total)
    k = torch.arange(total, device=device) - (counts_t.cumsum(0) - counts_t)[row]
    return row, k


def pad_token_id(tokenizer, model_config) -> int:
    """The pad id of :class:`InputLayout`: the tokenizer's or the model's pad id, else its EOS id, else 0."""
    for source in (tokenizer, model_config):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    for source in (tokenizer, model_config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return 0


@dataclass(frozen=True)
class InputLayout:
    """How a mini-batch's rows are laid out for one model call.

    ``pad_id``: the padding token; ``padding_side``: ``"left"``/``"right"``; ``pass_position_ids``:
    whether the model takes explicit ``position_ids``.
    """

    pad_id: int
    padding_side: str
    pass_position_ids: bool

    def inputs(self, rows: Rows, index: list[int], idx: torch.Tensor, packed: bool = False):
        """Model inputs of rows ``index`` (``idx``: the same on the device): padded to their own longest
        row, or with ``packed`` (decoder-only models) concatenated into one row (see :meth:`packed`).

        Returns the model kwargs, ``positions (b, L_mb)`` of the compact slots along dimension 1 of
        the model's per-token outputs (``(b, S)`` padded, ``(1, N_total)`` packed: read them with
        :func:`at_positions`), the token ``slots`` (see :func:`token_slots`), their ``targets (N,)``
        and ``L_mb``. The model is asked for logits at those N slots only.
        """
        if packed:
            return self.packed(rows, index)
        device = rows.action_mask.device
        width = rows.width(index)
        slots = token_slots(rows, index, width, device)
        if rows.shift:
            enc = pad_sequence([rows.queries[i] for i in index], batch_first=True, padding_value=self.pad_id)
            dec = pad_sequence([rows.responses[i] for i in index], batch_first=True, padding_value=self.pad_id)
            if dec.shape[1] < 2:
                dec = torch.nn.functional.pad(dec, (0, 2 - dec.shape[1]), value=self.pad_id)
            q_len, r_len = rows.query_len[idx], rows.response_len[idx]
            inputs = {
                "input_ids": enc,
                "attention_mask": (torch.arange(enc.shape[1], device=device) < q_len.unsqueeze(1)).long(),
                "decoder_input_ids": dec,
                "decoder_attention_mask": (torch.arange(dec.shape[1], device=device) < r_len.unsqueeze(1)).long(),
                "logits_positions": slots,
            }
            positions = torch.arange(width, device=device).expand(len(index), width)
            return inputs, positions, slots, dec[slots[0], slots[1] + 1], width

        lengths = rows.query_len[idx] + rows.response_len[idx]
        input_ids = pad_sequence(
            [rows.sequences[i] for i in index], batch_first=True, padding_value=self.pad_id, padding_side=self.padding_side
        )
        seq_len = input_ids.shape[1]
        arange = torch.arange(seq_len, device=device)
        pad_left = seq_len - lengths if self.padding_side == "left" else torch.zeros_like(lengths)
        attention_mask = ((arange >= pad_left.unsqueeze(1)) & (arange < (pad_left + lengths).unsqueeze(1))).long()
        start = pad_left + rows.query_len[idx] - 1
        # Positions past a row's response are padding of the compact layout; clamp them into range.
        positions = (start.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=seq_len - 2)
        token_positions = positions[slots]
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "logits_positions": (slots[0], token_positions),
        }
        if self.pass_position_ids:
            # Explicit positions make the result independent of the padding side.
            inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return inputs, positions, slots, input_ids[slots[0], token_positions + 1], width

    def packed(self, rows: Rows, index: list[int]):
        """:meth:`inputs` of rows ``index`` packed: ``input_ids`` and ``position_ids`` ``(1, N_total)``.

        The rows' query+response sequences are concatenated with no padding; each row's position ids
        start again at 0. With no ``attention_mask``, transformers reads the row boundaries from the
        restarting position ids and attention never crosses rows (a block-diagonal causal mask, varlen
        kernels for flash attention, or the per-row attention of :mod:`trl_lite.models.packed_attention`),
        so every token sees what it sees in the padded layout, at the same position, and no padding
        token is computed.
        """
        device = rows.action_mask.device
        lengths = [len(rows.sequences[i]) for i in index]
        total = sum(lengths)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        query_lens = [len(rows.queries[i]) for i in index]
        lengths_t = to_device(lengths, device)
        # Slot k of row j sits at position start_j + query_len_j - 1 + k, all from host-side numbers.
        first_t = to_device([s + q - 1 for s, q in zip(starts, query_lens)], device)
        input_ids = torch.cat([rows.sequences[i] for i in index]).unsqueeze(0)
        row_start = torch.repeat_interleave(to_device(starts, device), lengths_t, output_size=total)
        position_ids = (torch.arange(total, device=device) - row_start).unsqueeze(0)
        width = rows.width(index)
        # Slots past a row's response are padding of the compact layout (masked): any index in range does.
        positions = (first_t.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=total - 1)
        slots = token_slots(rows, index, width, device)
        token_positions = positions[slots]
        inputs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "logits_positions": (torch.zeros_like(token_positions), token_positions),
        }
        return inputs, positions, slots, input_ids[0, token_positions + 1], width


def at_positions(per_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Entries of a model's per-token output ``(b, S)`` - or ``(1, N_total)`` for packed rows - at the
    compact ``positions (b, L_mb)`` of :meth:`InputLayout.inputs`: ``(b, L_mb)``.

    Differentiable; a packed output's one row is shared by the b rows of ``positions``.
    """
    return per_token.expand(positions.shape[0], -1).gather(1, positions)


def to_compact(values: torch.Tensor, slots: tuple, rows: int, width: int) -> torch.Tensor:
    """Per-slot ``values (N, ...)`` placed at ``slots = (row, k)`` of a zero ``(rows, width, ...)`` tensor.

    Differentiable with respect to ``values``.
    """
    return values.new_zeros((rows, width, *values.shape[1:])).index_put(slots, values)
