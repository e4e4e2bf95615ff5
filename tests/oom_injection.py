"""Out-of-memory errors on the CPU, for tests of the back-off (docs/out_of_memory.md).

:class:`InjectedOutOfMemory` installs a forward pre-hook on a module (a transformers model) that raises
``torch.OutOfMemoryError`` as a device would: when a call holds more than ``max_tokens`` tokens (a memory
limit), or at the calls named in ``calls`` (a one-off failure, e.g. in the first, a middle or the last pass).
With ``in_backward=True`` the error comes in the backward of that call instead (from a hook on its output's
gradient), where a real device runs out of memory most often.

A call's tokens: the sum of its ``attention_mask`` when it has one (padded rows), else the size of its
``input_ids`` (packed rows). Calls are counted from installation; ``training_only`` counts (and fails) only
calls in training mode, the learner's passes, not the rollout's (which run in eval mode). ``bug=True`` raises a
plain ``RuntimeError`` (a shape mismatch, as a bug would) instead, at the same calls.

Usage::

    with InjectedOutOfMemory(trainer.model.pretrained_model, max_tokens=40) as injected:
        stats = trainer.step(queries, responses, scores)
    assert injected.failures == 1
"""

from __future__ import annotations

import torch


class InjectedOutOfMemory:
    """Raises ``torch.OutOfMemoryError`` in calls of ``module`` over ``max_tokens`` tokens or at ``calls``.

    ``failures``: how many errors it raised; ``seen``: the tokens of every call it counted, in order;
    ``rows``: the rows of each (packed calls: the rows whose position ids restart at 0).
    """

    def __init__(self, module: torch.nn.Module, max_tokens: int | None = None, calls: tuple = (),
                 in_backward: bool = False, training_only: bool = True, bug: bool = False):  # fmt: skip
        self.module = module
        self.max_tokens = max_tokens
        self.calls = set(calls)
        self.in_backward = in_backward
        self.training_only = training_only
        self.bug = bug
        self.failures = 0
        self.seen = []
        self.rows = []
        self._handles = []

    def __enter__(self) -> InjectedOutOfMemory:
        self._handles.append(self.module.register_forward_pre_hook(self._before, with_kwargs=True))
        if self.in_backward:
            self._handles.append(self.module.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _fails(self, args, kwargs) -> bool:
        """Whether this call fails; counts it."""
        if self.training_only and not self.module.training:
            return False
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 4:  # a packed pass's placeholder (rows_mask): not a padding mask
            mask = None
        tokens = int(mask.sum()) if mask is not None else ids.numel()
        positions = kwargs.get("position_ids")
        packed = mask is None and positions is not None
        call = len(self.seen)
        self.seen.append(tokens)
        self.rows.append(int((positions == 0).sum()) if packed else ids.shape[0])
        return call in self.calls or (self.max_tokens is not None and tokens > self.max_tokens)

    def _raise(self, *_):
        self.failures += 1
        if self.bug:
            raise RuntimeError(f"Injected: mat1 and mat2 shapes cannot be multiplied in a call of {self.seen[-1]} tokens.")
        raise torch.OutOfMemoryError(f"Injected: out of memory in a call of {self.seen[-1]} tokens.")

    def _before(self, module, args, kwargs):
        self._pending = self._fails(args, kwargs)
        if self._pending and not self.in_backward:
            self._raise()

    def _after(self, module, args, output):
        if self._pending:
            logits = output.logits if hasattr(output, "logits") else output[0]
            if logits.requires_grad:
                logits.register_hook(self._raise)
