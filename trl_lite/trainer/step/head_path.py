"""The LM head's path of every pass, decided in one place (issue 59 item 6): :class:`HeadPath`.

A pass asks :meth:`HeadPath.choose` once, before it runs the model, and gets a :class:`HeadChoice`: the model's
linear head the trainer applies itself (``head``), or None for the model's own ``(N, V)`` logits (a head it may
not apply, or a pass that returns logits), and the head's ``chunk`` - tokens per chunk, 0 for one ``(N, V)``
buffer, :data:`OWN_LOGITS` for the model's logits. The model's forward (whether it returns the head's inputs), the
head (:meth:`HeadPath.apply`) and the statistic ``memory/lm_head_chunk_size`` (:meth:`HeadPath.taken`: the path
the policy's last training pass took) all read that choice. Truncated sampling (docs/algorithm_rollouts.md section 23) takes the
same choice through :func:`~trl_lite.core.truncated_head.truncated_head`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ...core import full_kl_from_hidden, full_kl_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits
from ...core.kept_sets import Truncation
from ...core.lm_head import call_head, linear_head, linear_head_logprobs, lm_head_chunk_size
from ...core.truncated_head import truncated_from_logits, truncated_head, truncated_head_logprobs

# memory/lm_head_chunk_size of a model whose passes take its own (N, V) logits: not 0, which is one buffer.
OWN_LOGITS = -1


@dataclass(frozen=True)
class HeadChoice:
    """One pass's head path: ``head`` (the model's ``nn.Linear``, or None: the model's own logits), ``chunk``
    (tokens per chunk; 0: one buffer; :data:`OWN_LOGITS`) and ``partitioned`` (a ZeRO-3 weight, gathered by the
    head module's own call)."""

    head: torch.nn.Linear | None
    chunk: int
    partitioned: bool = False

    @property
    def fused(self) -> bool:
        """Whether the trainer applies the head: the model then returns the head's inputs ``(N, H)``."""
        return self.head is not None


class HeadPath:
    """Decides and runs the LM head of every pass (rollout, training, PTX, the classic pass).

    Args:
        unwrapped: maps a prepared model to its value-head wrapper (``ForwardPass.unwrapped``).
        memory: the trainer's :class:`~trl_lite.trainer.memory.oom_backoff.MemoryBackoff` (after a back-off the
            automatic rule takes chunks).
        lm_head_chunk_size: ``PPOConfig.lm_head_chunk_size`` (None: automatic, :func:`~trl_lite.core.lm_head_chunk_size`).
        temperature: ``PPOConfig.temperature`` (section 20).
        truncation: ``PPOConfig``'s cut (section 23), or None.
        autocast: the models' forward autocast context factory (``accelerator.autocast``).
        reuse_logits_buffer: one ``(R, V)`` buffer kept between passes (CPU with ``keep_freed_cpu_memory``,
            :meth:`logits_out`).
    """

    def __init__(self, unwrapped, memory, lm_head_chunk_size: int | None, temperature: float,
                 truncation: Truncation | None, autocast, reuse_logits_buffer: bool = False):  # fmt: skip
        self.unwrapped = unwrapped
        self.memory = memory
        self.lm_head_chunk_size = lm_head_chunk_size
        self.temperature = temperature
        self.truncation = truncation
        self.autocast = autocast
        self.reuse_logits_buffer = reuse_logits_buffer
        self._logits_buffer = None
        self._warned_no_chunks = False
        self._taken = {}  # id(model) -> the chunk of its last training pass

    def linear_head(self, model) -> torch.nn.Linear | None:
        """The model's LM head when passes may fuse it with the log-softmax, else None (warned once when
        ``lm_head_chunk_size`` was asked for). Asked per pass: ``resize_token_embeddings`` may replace it."""
        inner = self.unwrapped(model)
        head = inner.linear_lm_head()
        # A head partitioned by ZeRO-3 is applied too (call_head gathers it); another model's own head is the path
        # it was built with.
        if head is None and self.lm_head_chunk_size and not self._warned_no_chunks:
            self._warned_no_chunks = True
            reason = (
                "its LM head is not a plain nn.Linear the trainer may apply itself (an encoder-decoder, whose "
                "head input the model rescales; logits the model post-processes, e.g. soft-capping; an adapter "
                "or quantised head)"
            )  # fmt: skip
            warnings.warn(
                f"lm_head_chunk_size={self.lm_head_chunk_size} does not apply to {type(inner).__name__}: {reason}, so "
                "its passes take the model's own (tokens x vocabulary) float32 logits, as without chunks "
                "(memory/lm_head_chunk_size -1); bound them with max_tokens_per_minibatch.",
                stacklevel=4,
            )
        return head

    def choose(self, model, tokens: int, own_logits: bool = False, record: bool = False) -> HeadChoice:
        """The path of ``model``'s pass over up to ``tokens`` token slots: its linear head, in one buffer or chunks
        (``PPOConfig.lm_head_chunk_size``, or the automatic rule: one buffer while small on this device, never after
        an out-of-memory back-off), or its own logits (no linear head, or ``own_logits``: a pass that returns
        them). ``record``: the policy's training pass, whose path :meth:`taken` reports."""
        head = None if own_logits else self.linear_head(model)
        if head is None:
            choice = HeadChoice(None, OWN_LOGITS)
        else:
            weight = head.weight
            vocab = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3: the full head, not this process's shard
            chunk = lm_head_chunk_size(tokens, vocab, weight.device.type, self.lm_head_chunk_size,
                                       self.memory.backed_off, weight.dtype)  # fmt: skip
            choice = HeadChoice(head, chunk, hasattr(weight, "ds_id"))
        if record:
            self._taken[id(model)] = choice.chunk
        return choice

    def taken(self, model, tokens: int) -> int:
        """``memory/lm_head_chunk_size``: the chunk of ``model``'s last recorded pass (its path, as taken); before
        any, the path a pass of ``tokens`` slots would take."""
        chunk = self._taken.get(id(model))
        return self.choose(model, tokens).chunk if chunk is None else chunk

    def apply(self, choice: HeadChoice, outputs: torch.Tensor, targets: torch.Tensor, tokens: int, rows=None,
              temperature: float | None = None, kept=None):  # fmt: skip
        """Log-probs of ``targets`` ``(N,)`` and, when grad flows, the entropy ``(N,)`` (else None) under
        ``softmax(z / temperature)`` (default the config's); with ``kept`` (the slots' sets ``(ids, counts)``) under it
        renormalised over them (section 23). ``outputs``: the head's inputs ``(N, H)`` for a fused ``choice`` (one
        buffer: at least ``tokens`` rows; with the step's ``rows``, the shared :meth:`logits_out`), else the model's
        logits ``(N, V)``."""
        temperature = self.temperature if temperature is None else temperature
        if kept is not None:
            return self.truncated(choice, outputs, targets, temperature, kept)[:2]
        head, chunk = choice.head, choice.chunk
        if head is None:
            if torch.is_grad_enabled() and outputs.requires_grad:
                return logprobs_and_entropy_from_logits(outputs, targets, temperature)
            return logprobs_from_logits(outputs, targets, temperature=temperature), None
        out = None if chunk or rows is None or choice.partitioned else self.logits_out(rows, head)  # chunks: no (N, V)
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (outputs, head.weight, head.bias))

        def head_pass(hidden):
            with self.autocast():
                if grad:
                    return linear_head(hidden, head.weight, head.bias, targets, chunk, temperature, tokens, out)
                return linear_head_logprobs(hidden, head.weight, head.bias, targets, chunk, temperature, tokens, out), None

        return call_head(head, head_pass, outputs) if choice.partitioned else head_pass(outputs)

    def truncated(self, choice: HeadChoice, outputs, targets, temperature: float, kept, derive: Truncation | None = None):
        """A truncated pass's head: ``(logprobs, entropy_K, entropy or None, ids, counts)`` under ``pi_T^K``.
        ``kept``: the slots' sets ``(ids, counts)`` (a count 0: none), or None; ``derive`` (the rollout, no grad; the
        untruncated entropy beside): the rule that makes the sets missing there from the pass's own logits."""
        ids, counts = (None, None) if kept is None else kept
        head, chunk = choice.head, choice.chunk
        if head is None:
            return truncated_from_logits(outputs, targets, temperature, ids, counts, derive, derive is not None)
        grad = torch.is_grad_enabled()

        def head_pass(hidden):
            with self.autocast():
                if grad and derive is None:
                    return (*truncated_head(hidden, head.weight, head.bias, targets, ids, counts, chunk, temperature),
                            None, ids, counts)  # fmt: skip
                return truncated_head_logprobs(hidden, head.weight, head.bias, targets, chunk, temperature, ids, counts,
                                               derive, derive is not None)  # fmt: skip

        return call_head(head, head_pass, outputs) if choice.partitioned else head_pass(outputs)

    def logits_out(self, rows, head: torch.nn.Linear) -> torch.Tensor | None:
        """The ``(R, V)`` buffer the fused LM head of this pass writes its logits into, or None (a fresh one).

        Only with ``reuse_logits_buffer``: one buffer, made at the first fused pass, grown when a step
        needs more rows and kept between steps, so no vocabulary-sized block is freed and allocated
        again per mini-batch. glibc splits freed blocks for later small allocations, and a block that
        no longer fits in what is left grows the heap. Each pass is done with the buffer before the
        next begins (a training pass after its backward). Elsewhere each pass allocates its own: GPU
        caching allocators reuse blocks of one size well.
        """
        if not self.reuse_logits_buffer:
            return None
        buffer = _fitting(self._logits_buffer, head)
        if buffer is None or buffer.shape[0] < rows.buffer_rows:
            self._logits_buffer = None  # freed before its successor is allocated
            dtype = torch.promote_types(head.weight.dtype, torch.float32)
            self._logits_buffer = buffer = torch.empty(
                (rows.buffer_rows, head.weight.shape[0]), dtype=dtype, device=head.weight.device
            )
        return buffer

    def kl_choices(self, policy, reference, tokens: int) -> tuple[HeadChoice, HeadChoice]:
        """The paths of the rollout's policy and reference passes under ``kl_penalty="full"``: both fused and
        chunked (the KL from both models' head inputs, :meth:`full_kl`), else both the models' own logits (one
        buffer, a model without a linear head, or a ZeRO-3 head: the chunked KL reads both weights outside their
        calls)."""
        with reference() as ref:
            ref_choice = self.choose(ref, tokens)
        choice = self.choose(policy, tokens)
        if choice.fused and ref_choice.fused and choice.chunk and not (choice.partitioned or ref_choice.partitioned):
            return choice, HeadChoice(ref_choice.head, choice.chunk)
        return HeadChoice(None, OWN_LOGITS), HeadChoice(None, OWN_LOGITS)

    def full_kl(self, outputs, ref_outputs, choice: HeadChoice, ref_choice: HeadChoice) -> torch.Tensor:
        """Exact per-token KL of policy vs reference ``(N,)`` under ``pi_T`` (untruncated, section 23): from their
        logits ``(N, V)``, or from their head inputs ``(N, H)`` and heads, chunk by chunk (section 4)."""
        if not choice.fused:
            return full_kl_from_logits(outputs, ref_outputs, self.temperature)
        head, ref_head = choice.head, ref_choice.head
        with self.autocast():
            return full_kl_from_hidden(outputs, head.weight, head.bias, ref_outputs, ref_head.weight, ref_head.bias,
                                       choice.chunk, self.temperature)  # fmt: skip


def _fitting(buffer: torch.Tensor | None, head: torch.nn.Linear) -> torch.Tensor | None:
    """``buffer`` if it can hold the logits of ``head`` (vocabulary and dtype), else None."""
    if buffer is None or buffer.shape[1] != head.weight.shape[0]:
        return None
    return buffer if buffer.dtype == torch.promote_types(head.weight.dtype, torch.float32) else None
