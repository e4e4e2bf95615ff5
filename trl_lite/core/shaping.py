"""Shaping of the rollout's scores and its diagnostics (docs/algorithm.md section 14), applied to the raw
scores before the scaling and clipping of section 2.

- ``missing_eos_penalty``: ``score -= p`` for a row whose response does not end with an EOS token;
- DAPO's soft overlong penalty, with ``L`` the response length, ``L_max`` the longest response of the
  run and ``W`` the buffer: ``0`` up to ``L_max - W`` tokens, then falling linearly to
  ``-overlong_penalty_factor`` at ``L_max``, and ``-overlong_penalty_factor`` beyond.

Shape names: ``B`` rows, ``G`` groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ends_with_stop(responses: Sequence[torch.Tensor], stop_token_ids: int | Sequence[int]) -> torch.Tensor:
    """Whether each response ends with one of ``stop_token_ids``.

    Shape: ``B`` 1-D token-id tensors -> bool ``(B,)`` on the device of the first response. An empty
    response does not end with a stop token.
    """
    ids = (stop_token_ids,) if isinstance(stop_token_ids, int) else stop_token_ids
    ids = tuple(ids) if isinstance(ids, (list, tuple)) else ()
    if not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise TypeError(f"stop_token_ids must be an int or a non-empty sequence of ints, got {stop_token_ids!r}.")
    if len(responses) == 0:
        return torch.zeros(0, dtype=torch.bool)
    # -1 is no token id, so an empty response never matches.
    last = torch.cat([r[-1:] if r.numel() else r.new_full((1,), -1) for r in responses])
    # Compared with each id as a Python number: no tensor of ids to copy to the device.
    ends = last == ids[0]
    for stop in ids[1:]:
        ends |= last == stop
    return ends


def missing_eos_penalty(scores: torch.Tensor, ends_with_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    """``scores - penalty`` where the response does not end with EOS, ``scores`` elsewhere.

    Shape: scores ``(B,)`` float, ends_with_eos ``(B,)`` bool -> ``(B,)`` in the scores' dtype.
    """
    if ends_with_eos.shape != scores.shape or ends_with_eos.dtype != torch.bool:
        raise ValueError(
            f"ends_with_eos must be a bool tensor of the scores' shape {tuple(scores.shape)}, "
            f"got {ends_with_eos.dtype} of shape {tuple(ends_with_eos.shape)}."
        )
    return scores - penalty * (~ends_with_eos).to(scores.dtype)


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong penalty (<= 0), to be added to the scores.

    ``0`` if ``L <= L_max - W``; ``(L_max - W - L) / W * penalty_factor`` if ``L_max - W < L <= L_max``;
    ``-penalty_factor`` beyond. Shape: lengths ``(B,)`` (token counts) -> ``(B,)``, float32 unless
    ``lengths`` is floating.
    """
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(
            f"buffer_len must be in [1, max_response_length={max_response_length}], got {buffer_len}."
        )
    if not penalty_factor >= 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}.")
    lengths = lengths if lengths.dtype.is_floating_point else lengths.to(torch.float32)
    exceed = lengths - (max_response_length - buffer_len)
    # The linear ramp, cut at 0 below the buffer and at -penalty_factor past L_max.
    return (-exceed / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)


def shape_scores(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    ends_with_eos: torch.Tensor | None,
    missing_eos: float | None = None,
    max_response_length: int | None = None,
    overlong_buffer_len: int | None = None,
    overlong_penalty_factor: float = 1.0,
) -> torch.Tensor:
    """The section-14 shaping in its order: the missing-EOS penalty, then the overlong penalty.

    Each is off when its parameter (``missing_eos``, ``overlong_buffer_len``) is None; with both off
    ``scores`` is returned as it is. Shape: scores ``(B,)``, lengths ``(B,)``, ends_with_eos ``(B,)``
    bool (needed only with ``missing_eos``) -> ``(B,)``.
    """
    if missing_eos is not None:
        if ends_with_eos is None:
            raise ValueError("missing_eos needs ends_with_eos (which rows end with EOS), got None.")
        scores = missing_eos_penalty(scores, ends_with_eos, missing_eos)
    if overlong_buffer_len is not None:
        if max_response_length is None:
            raise ValueError("overlong_buffer_len needs max_response_length (L_max of the penalty), got None.")
        lengths = lengths.to(scores.device)
        penalty = overlong_penalty(lengths, max_response_length, overlong_buffer_len, overlong_penalty_factor)
        scores = scores + penalty.to(scores.dtype)
    return scores


def groups_with_equal_scores(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """For each group, whether all its scores are equal (zero spread: no signal for RLOO/GRPO).

    Groups are ordered by id. Shape: scores ``(B,)``, group_ids ``(B,)`` integer -> bool ``(G,)``.
    ``num_groups``: with ids dense in ``[0, num_groups)`` on the scores' device nothing is read back; None:
    ids of any values, made dense with ``torch.unique`` (host syncs on a GPU).
    """
    if group_ids.shape != scores.shape:
        raise ValueError(
            f"group_ids must hold one id per score, shape {tuple(scores.shape)}, got {tuple(group_ids.shape)}."
        )
    index, groups = group_ids, num_groups
    if num_groups is None:
        _, index = torch.unique(group_ids.to(scores.device), return_inverse=True)
        groups = int(index.max()) + 1 if index.numel() else 0
    highest = scores.new_full((groups,), -torch.inf).scatter_reduce(0, index, scores, reduce="amax")
    lowest = scores.new_full((groups,), torch.inf).scatter_reduce(0, index, scores, reduce="amin")
    return highest == lowest
