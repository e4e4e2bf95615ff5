"""Attention of a packed pass whose rows share prompts: each prompt once, each response reading it.

A group of rows with the same query tokens (a GRPO/RLOO group, equal queries in a GAE batch) is laid
out as one segment ``prompt + response_1 + ... + response_g`` of the packed sequence. The prompt attends
causally to itself; response ``j`` attends to the prompt's keys and values and to its own causal past:
the mask ``[ones(R_j, P) | tril(R_j, R_j)]``, with position ids continuing from ``P``. Every response
token then sees exactly what it sees in its own row ``prompt + response_j``, so its log-prob and value are
those of the unshared pass, and the gradients flowing into the prompt's activations add up over the
group's responses - what the repeated prompts add up to (docs/prefix_sharing.md).

A row of its own (no other row with its query) is a segment with no responses: its whole sequence is the
"prompt", attended causally, as in a plain packed pass.

On the CPU (and where the varlen kernel cannot run) each segment is computed with sdpa calls: causal on
the prompt, and per response an explicit boolean mask over ``prompt + response`` keys. Where the varlen
kernel runs, one call per layer takes separate query and key offsets: query row ``j`` is the response,
key row ``j`` the prompt's keys followed by the response's (gathered by :attr:`SharedRows.key_index`);
FlashAttention aligns a causal mask of a query row shorter than its key row bottom-right, which is the
mask above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import varlen_attention


@dataclass(frozen=True, eq=False)
class SharedRows:
    """The segments of one packed pass with shared prompts, as its attention layers need them.

    ``groups``: per segment in stream order ``(P, (R_1, ..., R_g))`` host ints: the prompt's tokens and
    each response's (``g = 0`` for a row of its own, whose whole sequence is ``P``). On a device where the
    varlen kernel runs, also the kernel's inputs (else None): ``cu_seqlens`` ``(n + 1,)`` int32 query
    offsets over the kernel's rows (each prompt, then each response), ``cu_seqlens_k`` the key offsets
    (a prompt's row holds its own keys, a response's row ``P + R_j`` keys), ``key_index (sum of key
    rows,)`` the stream positions each key row reads; ``max_length``/``max_key_length`` the longest query
    and key rows.
    """

    groups: tuple
    max_length: int
    max_key_length: int
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    key_index: torch.Tensor | None = None

    @property
    def total(self) -> int:
        """Tokens of the packed stream: each prompt once plus every response."""
        return sum(p + sum(responses) for p, responses in self.groups)

    @property
    def lengths(self) -> tuple:
        """Query rows of the kernel: each prompt, then each of its responses (host ints)."""
        return tuple(n for p, responses in self.groups for n in (p, *responses))

    def kernel_offsets(self) -> tuple:
        """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k)`` of the varlen call."""
        return self.cu_seqlens, self.cu_seqlens_k, self.max_length, self.max_key_length


def shared_rows(groups, device) -> SharedRows:
    """:class:`SharedRows` of ``groups`` (``(P, (R_1, ..., R_g))`` per segment) for a pass on ``device``.

    The kernel's offsets and key index are built on the host and moved in one copy each, only where
    :data:`~.varlen_attention.KERNEL` runs on ``device``.
    """
    groups = tuple((int(p), tuple(int(r) for r in responses)) for p, responses in groups)
    if not groups or any(p < 1 or any(r < 1 for r in responses) for p, responses in groups):
        raise ValueError(f"groups must be one or more (prompt length, response lengths) of positive lengths, got {groups}.")
    q_rows = [n for p, responses in groups for n in (p, *responses)]
    k_rows = [n for p, responses in groups for n in (p, *(p + r for r in responses))]
    device = torch.device(device)
    kernel = varlen_attention.KERNEL  # read per call: tests swap in a stand-in
    if kernel.function is None or device.type not in kernel.device_types:
        return SharedRows(groups, max(q_rows), max(k_rows))
    index, start = [], 0
    for p, responses in groups:
        index.append(torch.arange(start, start + p))
        offset = start + p
        for r in responses:
            index += [torch.arange(start, start + p), torch.arange(offset, offset + r)]
            offset += r
        start = offset
    cu_q = torch.tensor([0, *q_rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *k_rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    moved = [t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
             for t in (cu_q, cu_k, torch.cat(index))]  # fmt: skip
    return SharedRows(groups, max(q_rows), max(k_rows), *moved)


def response_mask(prompt: int, length: int, window: int | None, device) -> torch.Tensor:
    """The boolean ``(1, 1, R, P + R)`` mask of a response of ``length`` tokens over ``prompt + response`` keys:
    ``[ones(R, P) | tril(R, R)]``, narrowed to a sliding ``window`` when one is given (query at position
    ``P + i`` reads keys at positions ``P + i - window < j <= P + i``, as transformers' sliding layers)."""
    query_pos = prompt + torch.arange(length, device=device)
    key_pos = torch.arange(prompt + length, device=device)
    offsets = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)
    mask = offsets >= 0
    if window is not None:
        mask &= offsets < window
    return mask[None, None]


def shared_sdpa(module, query, key, value, rows: SharedRows, causal_mask, **kwargs) -> torch.Tensor:
    """Attention of the segments of ``rows`` with sdpa: ``query``/``key``/``value`` ``(1, heads, N_total, D)``;
    ``causal_mask(length)``: the mask of a prompt's causal attention (None for plain causal). Returns
    ``(1, N_total, heads, D)``."""
    kwargs.pop("is_causal", None)
    window = kwargs.pop("sliding_window", None)
    outputs, start = [], 0
    for prompt, responses in rows.groups:
        span = slice(start, start + prompt)
        q, k, v = query[:, :, span], key[:, :, span], value[:, :, span]
        outputs.append(sdpa_attention_forward(module, q, k, v, causal_mask(prompt, window), is_causal=True, **kwargs)[0])
        offset = start + prompt
        for length in responses:
            own = slice(offset, offset + length)
            k_r = torch.cat((k, key[:, :, own]), dim=2)
            v_r = torch.cat((v, value[:, :, own]), dim=2)
            mask = response_mask(prompt, length, window, query.device)
            outputs.append(sdpa_attention_forward(module, query[:, :, own], k_r, v_r, mask, is_causal=False, **kwargs)[0])
            offset += length
        start = offset
    return torch.cat(outputs, dim=1)
