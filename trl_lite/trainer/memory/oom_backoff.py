"""Out-of-memory back-off: a pass that runs out of memory is redone in passes of half the token budget.

A backward batch's update does not depend on how its rows are split into passes (docs/algorithm.md
section 18), so a training pass (or a rollout pass) that raises ``torch.OutOfMemoryError`` can be redone
in smaller passes and the step is the one that would have run without the failure.
:class:`MemoryBackoff` holds the run's current token budget and what happens on a failure: it catches the
error of one attempt (:meth:`~MemoryBackoff.attempt`), lets every process agree that some process failed
(:meth:`~MemoryBackoff.agree`), halves the budget and tells the caller to redo its work from its start
(:class:`PassOutOfMemory`). The trainer makes the one back-off of a run and hands it to the forward part and
the learner, which call it, and to the checkpointer, which saves and restores it (:meth:`~MemoryBackoff.state_dict`);
what a user sees is in docs/out_of_memory.md.
"""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager

import torch


def empty_device_cache() -> None:
    """Collect garbage and return cached CUDA memory to the driver (``optimize_device_cache``)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# What to change when a single row does not fit, named in every message that gives up.
_REMEDIES = (
    "turn on gradient_checkpointing=True, set lm_head_chunk_size (the LM head's log-probs computed chunk by "
    "chunk of tokens), or generate shorter responses (a smaller max_new_tokens)"
)


class PassOutOfMemory(Exception):
    """Every process agreed that a pass ran out of memory and the budget was halved: the caller redoes its
    backward batch (or rollout) from its start. Raised and caught inside the trainer."""


class MemoryBackoff:
    """The token budget of a pass, halved when a pass runs out of memory, and the bookkeeping of failures.

    Args:
        accelerator: the run's accelerator (process count and the agreement's reduction).
        budget: the starting token budget (``PPOConfig.max_tokens_per_minibatch``), or None: passes of
            ``mini_batch_size`` rows until the first failure.
        enabled: ``PPOConfig.oom_backoff``; when False no error is caught.
        collective_forwards: whether every forward runs collectives (ZeRO-3 gathers parameters inside it,
            sequence parallelism exchanges every attention layer's inputs): on several processes a failure
            there leaves the peers inside a collective, so a forward's failure cannot be redone.

    ``budget``: the current budget (prompt + response tokens of a pass), None while no budget is set and
    nothing failed; ``backed_off``: whether a failure set or lowered it; ``retries``: failures since the run
    began (each one redid a backward batch or a rollout); ``discardable``: whether the work since the last
    agreement can be dropped - the learner sets it False once a DeepSpeed engine has accumulated a backward of
    the backward batch under way (its buffers are its own), and a failure then cannot be redone.
    """

    def __init__(self, accelerator, budget: int | None, enabled: bool, collective_forwards: bool = False):
        self.accelerator = accelerator
        self.forwards_synchronise = collective_forwards and accelerator.num_processes > 1
        self.budget = budget
        self.enabled = enabled
        self.backed_off = False
        self.retries = 0
        self.discardable = True
        self._catching = False  # inside the trainer's own passes (user calls such as train_minibatch are not)
        self._reported = 0  # retries already reported by step_stats
        self._pass = (0, 1)  # tokens and rows of the pass under way
        self._failure = None  # (tokens, rows) of this process's failed pass, until the processes agree

    # ------------------------------------------------------------------------------------------
    # One attempt
    # ------------------------------------------------------------------------------------------
    def begin_pass(self, tokens: int, rows: int) -> None:
        """Name the pass about to run: its prompt+response tokens and its row count (for the back-off)."""
        self._pass = (int(tokens), int(rows))

    @property
    def failed(self) -> bool:
        """Whether a pass of this process ran out of memory and the processes have not agreed on it yet."""
        return self._failure is not None

    @contextmanager
    def attempt(self, recoverable: bool | None = None, what: str = "a pass"):
        """The block of one forward (or backward) of the pass named by :meth:`begin_pass`.

        Inside :meth:`catching` (and with ``enabled``), a ``torch.OutOfMemoryError`` inside it is recorded, the
        device cache emptied, and the error swallowed: the caller carries on to the next agreement (see
        :meth:`agree`); outside, errors pass through untouched. ``recoverable=False``:
        the block synchronises the processes (a gradient-reducing backward on several processes) or holds
        state that cannot be discarded (a DeepSpeed engine's accumulated gradients), so it cannot be redone;
        the error is raised again with a message that says so (docs/out_of_memory.md, several processes).
        None: a forward's, recoverable unless forwards synchronise the processes (ZeRO-3, sequence parallelism).
        """
        recoverable = not self.forwards_synchronise if recoverable is None else recoverable
        if not (self.enabled and self._catching):
            yield
            return
        try:
            yield
        except torch.OutOfMemoryError as error:
            if not recoverable:
                raise torch.OutOfMemoryError(self._unrecoverable_message(what)) from error
            self._failure = self._failure or self._pass
        except RuntimeError as error:
            if recoverable or self.accelerator.num_processes == 1 or not broke_collective(error):
                raise  # the pass's own error (a bug, a shape mismatch) as it is
            # The collective broke because a peer left it: say where to look (gloo reports a closed connection).
            raise RuntimeError(
                f"Process {self.accelerator.process_index} failed inside a collective of {what} ({error}). When another "
                "process reports running out of memory, that is the cause: see docs/out_of_memory.md."
            ) from error
        # Outside the handler: the error and the frames of the failed pass are gone, their memory free.
        if self._failure is not None:
            empty_device_cache()

    @contextmanager
    def catching(self):
        """The block of the trainer's own passes, whose failures :meth:`attempt` catches and can have redone."""
        outer, self._catching = self._catching, True
        try:
            yield
        finally:
            self._catching = outer

    def raise_if_alone(self) -> None:
        """On one process a failure needs no agreement: back off now and raise :class:`PassOutOfMemory`."""
        if self.failed and self.accelerator.num_processes == 1:
            self.agree()

    def agree(self) -> None:
        """Every process calls this at the same point: when any of them failed since the last call, all back
        off to the same halved budget and raise :class:`PassOutOfMemory` (or, when a failed pass held a single
        row, ``torch.OutOfMemoryError`` naming the remedies). One reduction on several processes.
        With :attr:`discardable` False a failure raises ``torch.OutOfMemoryError`` on every process instead."""
        tokens, rows = self._failure if self._failure is not None else (0, 0)
        failed, single = float(self._failure is not None), float(rows == 1)
        if self.accelerator.num_processes > 1:
            shared = torch.tensor([failed, float(tokens), single * failed], device=self.accelerator.device)
            failed, tokens, single = self.accelerator.reduce(shared, reduction="max").tolist()
        self._failure = None
        if failed and not self.discardable:
            budget = next_budget(self.budget, int(tokens))
            raise torch.OutOfMemoryError(
                f"A training pass of {int(tokens)} prompt+response tokens ran out of memory on a process after earlier "
                "passes of its backward batch had run their backward in the DeepSpeed engine, which keeps their "
                "gradients: the backward batch cannot be redone. Restart from the last checkpoint with "
                f"max_tokens_per_minibatch={max(budget, 1)} or lower, or {_REMEDIES} (see docs/out_of_memory.md)."
            )
        if failed:
            self.back_off(int(tokens), bool(single))

    def back_off(self, tokens: int, single_row: bool) -> None:
        """Lower the budget after a failed pass that ran ``tokens`` tokens (:func:`next_budget`: below the pass, so
        no pass like it comes again) and raise :class:`PassOutOfMemory`; a pass of one row cannot be split: raise
        the error."""
        budget = next_budget(self.budget, tokens)
        if single_row or budget < 1:
            raise torch.OutOfMemoryError(
                f"A single row of {tokens} prompt+response tokens ran out of memory in a pass of its own (token "
                f"budget {self.budget}): it cannot be split into smaller passes. To fit it, {_REMEDIES}."
            )
        warnings.warn(
            f"Out of memory in a pass of {tokens} tokens as it ran (token budget {self.budget}): redoing it with "
            f"max_tokens_per_minibatch={budget}, kept for the rest of the run.",
            stacklevel=3,
        )
        self.budget, self.backed_off = budget, True
        self.retries += 1
        raise PassOutOfMemory

    def _unrecoverable_message(self, what: str) -> str:
        tokens, rows = self._pass
        budget = next_budget(self.budget, tokens)
        return (
            f"Out of memory on process {self.accelerator.process_index} in {what} of {rows} rows and {tokens} "
            f"prompt+response tokens (token budget {self.budget}). This pass cannot be redone: it synchronises the "
            "processes (the others wait inside its collective) or runs inside a DeepSpeed engine, which keeps its "
            f"gradients. Restart from the last checkpoint with max_tokens_per_minibatch={max(budget, 1)} or lower, "
            f"or {_REMEDIES} (see docs/out_of_memory.md)."
        )

    # ------------------------------------------------------------------------------------------
    # Whole rollouts
    # ------------------------------------------------------------------------------------------
    def until_done(self, run, every_process: bool = True):
        """``run()`` (a rollout's passes, each inside :meth:`attempt`) again with the halved budget until no
        process failed in it; returns its result. On one process a failed ``run`` may stop at its failure
        (see :attr:`stop_early`); on several each runs all its passes, so the collectives line up, then they agree.
        ``every_process`` False: callers may run it on some processes only, so on several nothing is caught."""
        if not self.enabled or (not every_process and self.accelerator.num_processes > 1):
            return run()
        self.discardable = True
        while True:
            with self.catching():
                result = run()
            try:
                self.agree()
            except PassOutOfMemory:
                continue
            return result

    @property
    def stop_early(self) -> bool:
        """Whether a rollout may stop at this process's failure (one process: nobody waits on its passes)."""
        return self.failed and self.accelerator.num_processes == 1

    def buffer_rows(self, rows: int) -> int:
        """The LM-head buffer rows of a pass of this step's ``rows`` (``Rows.buffer_rows``), capped by the
        backed-off budget: a pass of ``budget`` tokens has at most as many token slots, and the buffer must
        shrink with the passes (a longer row alone still gets its own size, see ``core.logprobs``)."""
        return min(rows, self.budget) if self.backed_off else rows

    # ------------------------------------------------------------------------------------------
    # Statistics and checkpoints
    # ------------------------------------------------------------------------------------------
    def step_stats(self) -> dict:
        """``memory/oom_retries`` (failures since the last step's statistics) and
        ``memory/max_tokens_per_minibatch`` (the current budget; 0 while none is set: mini-batches of rows)."""
        retries, self._reported = self.retries - self._reported, self.retries
        budget = 0.0 if self.budget is None else float(self.budget)
        return {"memory/oom_retries": torch.tensor(float(retries)), "memory/max_tokens_per_minibatch": torch.tensor(budget)}

    def state_dict(self) -> dict:
        return {"budget": self.budget, "backed_off": self.backed_off, "retries": self.retries}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved back-off: a resumed run starts with the budget its failures left (or the configured
        one, when that is smaller)."""
        if state["backed_off"]:
            self.budget = state["budget"] if self.budget is None else min(self.budget, state["budget"])
            self.backed_off = True
        self.retries = self._reported = state["retries"]


def next_budget(budget: int | None, tokens: int) -> int:
    """The budget after a pass that ran ``tokens`` tokens failed under ``budget`` (None: none set): half the budget,
    or half the failed pass where that half would still hold the pass (no budget; a pass at most half the budget),
    so every pass planned under it runs fewer tokens than the one that failed (only a row alone can exceed it)."""
    if budget is not None and budget // 2 < tokens:
        return budget // 2
    return tokens // 2


def broke_collective(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective's failure (a torch.distributed error, or gloo's plain RuntimeError, which
    names its transport), such as a peer leaving it, rather than an error of the pass's own computation."""
    return isinstance(error, torch.distributed.DistError) or "gloo" in str(error)


def drop_gradients(models) -> None:
    """Drop the gradients of ``models`` (prepared), between accumulation boundaries too (accelerate's
    ``zero_grad`` waits for one), and reset what a DDP model's reducer prepared for them."""
    for model in models:
        for param in model.parameters():  # not model.zero_grad: a DeepSpeed engine's takes no set_to_none
            param.grad = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # A forward of a synchronising pass prepared the reducer for a backward that did not run: left so,
            # the next backward (even under no_sync) would start gradient reductions on this process alone.
            # Every process resets it at the same point (after the agreement), so the buckets stay in step.
            model.reducer._reset_state()
