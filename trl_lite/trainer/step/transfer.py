"""A step's host-device traffic in one copy each way: the batch to the device, the statistics back.

On a GPU each pageable ``tensor.to("cuda")`` blocks the host until the copy is done, and each read of
a device value (``.cpu()``, ``.item()``, ``.tolist()``) waits for every queued kernel. A step that moves
its rows one by one and reads its statistics one by one pays that per row and per statistic. Here the
host tensors of a step are laid end to end in one pinned buffer and copied with one non-blocking copy
(:func:`to_device_together`); the statistics come back in one copy (:func:`to_host_together`).

The host syncs of one ``step()`` on a GPU, all of them (:func:`sync_budget` counts them for a config;
``tests/test_host_syncs.py`` counts them on the CPU):

- per step: the statistics' one copy back (:meth:`~.statistics.StepStatistics.reduce`; distributions
  are selected on the host after it, see :class:`Selected`);
- per training mini-batch: the skip guard's flags (``Learner.skip_reason``, a decision every process
  takes alike);
- per optimizer update (each mini-batch without gradient accumulation): whether the clipped gradients
  are finite (``Learner.backward_and_step``);
- only where configured: one per epoch with ``early_stopping`` (the epoch's policy KL);
- only for inputs given on the device: one per kind of input (queries, responses, masks and the
  count of their actions, scores, generation log-probs) for ``step()``'s checks of their values;
- only when it happens: a mini-batch skipped for its ratio reads the mean ratio for its warning.

That is one process; with several, the collectives (whitening, the statistics' reductions, the skip
guard's) wait as well. Nothing else: the group ids of 'rloo'/'grpo' travel in the batch's copy, dense, with
their count as a host int (no ``torch.unique``, no ``int(tensor)``); a token budget plans its passes from the
action counts of ``step()``'s input checks (host numbers), and its skip guard runs per pass with its flags
filled on the device from host numbers (no blocking ``torch.tensor(..., device=...)``); ``use_score_scaling``
merges the running moments on the device (:meth:`~.running_moments.RunningMoments.update_on_device`), read
back only for a checkpoint or a user. The phase timings' CUDA events are read after the copy back, when the
device is idle (:class:`~.timing.StepClock`). ``tests/test_host_syncs.py`` counts every synchronising
operation of a step at torch's dispatcher, per estimator and option, against :func:`sync_budget`.

The batch's copy and the packed passes' offsets (:func:`~trl_lite.models.varlen_attention.packed_rows`)
are non-blocking from pinned memory: no sync. Neither are the packed passes' masks (see
:func:`~trl_lite.models.packed_attention.rows_mask`).
"""

from __future__ import annotations

import dataclasses

import torch

# Each piece starts at a multiple of this many bytes in the buffer, so a piece of any dtype up to
# 8 bytes per element can be viewed in place on the device.
_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class Selected:
    """A distribution statistic: the entries of ``values`` where ``mask`` is true (both ``(B, L)``).

    Selected on the host after the statistics' one copy: a boolean selection on the device reads
    the number of entries back, one sync for each.
    """

    values: torch.Tensor
    mask: torch.Tensor


def to_device_together(tensors: list, device) -> list:
    """``tensors`` on ``device``, the host ones moved in one copy; same order, dtypes and shapes.

    Host tensors are laid end to end as bytes in one buffer (pinned when ``device`` is CUDA), copied
    once (non-blocking from pinned memory) and cut into views on the device. On a CPU ``device`` the
    buffer is the result (one host memcpy), so both run the same code. Tensors on an accelerator are
    left on ``device`` as they are, or moved one by one from another one. None entries stay None.
    """
    device = torch.device(device)
    out = list(tensors)
    host = [i for i, t in enumerate(out) if t is not None and t.device.type == "cpu"]
    for i, t in enumerate(out):
        if t is not None and t.device.type != "cpu" and t.device != device:
            out[i] = t.to(device)
    if not host:
        return out
    buffer, spans = _pack([out[i] for i in host])
    if device.type == "cuda":
        buffer = buffer.pin_memory()
    on_device = buffer.to(device, non_blocking=device.type == "cuda")
    for i, piece in zip(host, _unpack(on_device, spans, [out[i] for i in host])):
        out[i] = piece
    return out


def _pack(tensors: list) -> tuple[torch.Tensor, list]:
    """``tensors`` (on the host) as one uint8 buffer, each piece starting at a multiple of ``_ALIGN``
    bytes, and each piece's ``(start, size)`` in bytes."""
    pieces, spans, offset = [], [], 0
    for tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        padding = -len(raw) % _ALIGN
        pieces.append(raw)
        if padding:
            pieces.append(raw.new_zeros(padding))
        spans.append((offset, len(raw)))
        offset += len(raw) + padding
    return torch.cat(pieces), spans


def _unpack(buffer: torch.Tensor, spans: list, templates: list) -> list:
    """The pieces of ``buffer`` (see :func:`_pack`) as views with the dtypes and shapes of ``templates``."""
    return [buffer[start : start + size].view(t.dtype).reshape(t.shape) for (start, size), t in zip(spans, templates)]


def to_host_together(tensors: list) -> list:
    """``tensors`` (float32, on one device) on the host in one copy: same order and shapes."""
    if not tensors:
        return []
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    return [piece.reshape(t.shape) for piece, t in zip(flat.split(sizes), tensors)]


def stack_scalars(values: list, device) -> torch.Tensor:
    """One float32 ``(K,)`` tensor on ``device`` of K scalars: numbers, or 1-element tensors on the host
    or on ``device``. The host values travel in one non-blocking copy; nothing is read back."""
    device = torch.device(device)
    on_device = [isinstance(v, torch.Tensor) and v.device == device for v in values]
    host = [torch.as_tensor(v, dtype=torch.float32).reshape(()) for v, here in zip(values, on_device) if not here]
    (host,) = to_device_together([torch.stack(host) if host else torch.zeros(0)], device)
    moved = iter(host.unbind())
    return torch.stack([v.reshape(()).float() if here else next(moved) for v, here in zip(values, on_device)])


def batch_to_device(batch, device, ends_with_eos: torch.Tensor | None = None):
    """A :class:`~.experience.StepBatch` with its per-row tensors on ``device``, moved in one copy, and
    ``ends_with_eos`` (bool ``(B,)`` or None, computed on the host) moved with it.

    Queries, responses, response masks, generation log-probs, the scores (as one float32 ``(B,)``
    tensor), the group ids and the staleness go into one buffer (:func:`to_device_together`). Scores that
    are tensors on ``device`` already are stacked there instead (no round trip through the host). The
    PTX inputs stay as they are (their own code moves them, once per step).
    """
    device = torch.device(device)
    n = len(batch.queries)
    masks = list(batch.response_masks) if batch.response_masks is not None else []
    gen = list(batch.generation_logprobs) if batch.generation_logprobs is not None else []
    scores = batch.scores
    if not isinstance(scores, torch.Tensor):
        if all(isinstance(s, torch.Tensor) and s.device == device for s in scores):
            scores = torch.stack([s.reshape(()).float() for s in scores])
        else:
            scores = torch.stack([torch.as_tensor(s, dtype=torch.float32, device="cpu").reshape(()) for s in scores])
    moved = to_device_together(
        [*batch.queries, *batch.responses, *masks, *gen, scores, batch.groups, batch.staleness, ends_with_eos], device
    )
    k = 2 * n + len(masks)
    batch = dataclasses.replace(
        batch, queries=moved[:n], responses=moved[n : 2 * n], scores=moved[-4].float(),
        response_masks=moved[2 * n : k] if batch.response_masks is not None else None,
        generation_logprobs=moved[k : k + len(gen)] if batch.generation_logprobs is not None else None,
        groups=moved[-3], staleness=moved[-2],
    )  # fmt: skip
    return batch, moved[-1]


def sync_budget(config, device_inputs: int = 0) -> dict:
    """The host syncs one ``step()`` of ``config`` makes on a GPU in one process: the itemised list of
    this module's docstring. ``device_inputs``: how many kinds of input ``step()`` is given on the
    device (0 when all come from the host; a mask list counts 2: its values and its actions).

    Returns ``{"per_step": ..., "per_minibatch": ..., "minibatches": ..., "total": ...}``; the total is
    what one step may make, ``per_minibatch`` (2 at most) what each training mini-batch adds.
    """
    minibatches = config.ppo_epochs * -(-config.batch_size // config.mini_batch_size)
    per_update = 1 / config.gradient_accumulation_steps
    per_step = 1 + device_inputs
    per_step += config.ppo_epochs if config.early_stopping else 0
    per_minibatch = 1 + per_update
    return {
        "per_step": per_step, "per_minibatch": per_minibatch, "minibatches": minibatches,
        "total": per_step + round(per_minibatch * minibatches),
    }  # fmt: skip
