"""The forward part: log-probs and values of rows in mini-batches, for the rollout (no grad, docs/algorithm.md
section 3) and for training (with grad), and the classic ``batched_forward_pass``.

:class:`ForwardPass` owns what every pass needs and nothing else: the input layout (pad id, padding
side, position ids), whether passes are packed and which models attend per row, the LM head's path
(:class:`~.head_path.HeadPath`), truncated sampling's kept sets, and the prepared-to-unwrapped model map. The trainer hands it the run's out-of-memory
back-off and its sequence-parallel part.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from contextlib import contextmanager

import torch

from ...core.kept_sets import KeptSets, Truncation
from ...engines.vllm_engine import VLLMEngine
from ...models.dropout import has_dropout
from ...models.packed_attention import ROW_LENGTHS, attend_per_row, rows_mask, takes_row_lengths, without_cudnn
from ...models.varlen_attention import packed_rows
from ..layout.rows import InputLayout, Rows, at_positions, make_rows, pad_token_id, to_compact, to_device
from ..memory.cpu_memory import transient_blocks_in_heap
from ..memory.oom_backoff import MemoryBackoff
from ..memory.prefix_sharing import PrefixSharing, Schedule, obstacle, units_passes
from ..memory.token_budget import split_by_tokens
from .head_path import HeadChoice, HeadPath


class ForwardPass:
    """Mini-batch forward passes of the policy, the reference and the critic over :class:`~.rows.Rows`.

    Args:
        accelerator: the run's accelerator (unwraps models it has not seen).
        models: ``(prepared, unwrapped)`` pairs of the policy (first) and the reference; unwrapping
            reads package metadata, too slow for every mini-batch, so it is done once here.
        layout: pad id, padding side and position ids of model inputs.
        is_encoder_decoder: whether the policy is an encoder-decoder.
        mini_batch_size: rows per pass.
        memory: the trainer's :class:`~.oom_backoff.MemoryBackoff`, shared with the learner: it holds the token
            budget of a pass (``PPOConfig.max_tokens_per_minibatch``, or None: passes of ``mini_batch_size``
            rows) and redoes a rollout whose pass runs out of memory with half of it.
        pack: whether the passes of the models in ``models`` (and the critic) take packed rows.
        row_attention: the prepared modules whose packed passes attend per row (see
            :func:`~trl_lite.models.packed_attention.takes_row_lengths`); others attend through
            transformers' block-diagonal mask, to the same result.
        reuse_logits_buffer: whether the fused LM head writes into one buffer kept between passes
            (CPU with ``keep_freed_cpu_memory``, see :meth:`.head_path.HeadPath.logits_out`).
        sequence: the trainer's sequence-parallel part: the :class:`~trl_lite.parallel.SequenceParallel` group
            packed passes are cut over (see :meth:`gather_slots`), or a :class:`~trl_lite.parallel.NoSequenceParallel`.
        lm_head_chunk_size: ``PPOConfig.lm_head_chunk_size`` (None: automatic; see :meth:`.head_path.HeadPath.choose`).
        temperature: ``PPOConfig.temperature``: log-probs and full KL under ``logits / temperature`` (section 20).
        prefix_sharing: ``PPOConfig.prefix_sharing`` (None: automatic), decided for every step and pass by
            :attr:`prefix`, a :class:`~.prefix_sharing.PrefixSharing` built from this part's passes, ``critic`` (the
            prepared separate critic, or None), ``dropout`` (a trained model has dropout above 0) and ``schedule``
            (a :class:`~.prefix_sharing.Schedule`).
        truncation: ``PPOConfig``'s top-k/top-p/min-p cut (:meth:`~trl_lite.core.kept_sets.Truncation.of`), or None:
            the policy's log-probs are then ``log pi_T^K`` over each position's kept set, made in the rollout pass
            and replayed by every training pass (docs/algorithm_rollouts.md section 23, :meth:`with_kept`).
    """

    def __init__(self, accelerator, models: list[tuple], layout: InputLayout, *, is_encoder_decoder: bool,
                 mini_batch_size: int, memory: MemoryBackoff, sequence, pack: bool = False,
                 row_attention: dict | None = None, reuse_logits_buffer: bool = False,
                 lm_head_chunk_size: int | None = None, temperature: float = 1.0, prefix_sharing: bool | None = None,
                 critic=None, dropout: bool = False, schedule: Schedule | None = None,
                 truncation: Truncation | None = None):  # fmt: skip
        self.accelerator = accelerator
        self.device = accelerator.device
        self.models = models
        self.layout = layout
        self.is_encoder_decoder = is_encoder_decoder
        self.mini_batch_size = mini_batch_size
        self.pack = pack
        self.row_attention = row_attention or {}
        self.memory = memory
        self._warned_long_row = False
        self.sequence = sequence
        self._sequence_pass = None  # this process's slice of the last packed pass (sequence parallelism)
        self.temperature = temperature
        models_of_passes = {"policy": models[0][0], "reference": models[1][0] if len(models) > 1 else None, "critic": critic}
        not_attending = [name for name, m in models_of_passes.items() if m is not None and id(m) not in self.row_attention]
        why_not = obstacle(pack, is_encoder_decoder, self.sequence.cuts, not_attending)
        self.prefix = PrefixSharing(prefix_sharing, why_not, dropout, schedule)  # the one decider of sharing
        self.truncation = truncation
        # The LM head's path of every pass, decided in one place (head_path.py).
        self.head = HeadPath(self.unwrapped, memory, lm_head_chunk_size, temperature, truncation, accelerator.autocast,
                             reuse_logits_buffer)  # fmt: skip
        self._kept_passes = None  # the rollout's policy passes' kept sets: (keys, ids, counts) per pass
        self._rollout_kept = None  # (KeptSets, untruncated entropy (B, L)) of the last rollout
        self._said_rederived = False
        self.no_kept_sets = None  # why the run's engine cannot record its sampler's kept sets, or None

    @classmethod
    def build(cls, accelerator, policy, reference, critic, tokenizer, config, pack: bool, memory: MemoryBackoff,
              sequence) -> ForwardPass:  # fmt: skip
        """The forward part of a trainer: ``policy``, ``reference`` (or None) and ``critic`` (or None) prepared;
        ``memory`` and ``sequence``: the trainer's back-off and sequence-parallel part."""
        unwrapped = accelerator.unwrap_model(policy)
        models = [(policy, unwrapped)]
        if reference is not None:
            models.append((reference, accelerator.unwrap_model(reference)))
        row_attention = {}
        for module in (m for m in (policy, reference, critic) if m is not None and pack):
            inner = next((inner for known, inner in models if module is known), None)
            inner = accelerator.unwrap_model(module) if inner is None else inner
            if takes_row_lengths(inner.transformers_model):
                row_attention[id(module)] = inner.transformers_model
        layout = InputLayout(
            pad_id=pad_token_id(tokenizer, unwrapped.config),
            padding_side=getattr(tokenizer, "padding_side", "right") or "right",
            pass_position_ids="position_ids" in inspect.signature(unwrapped.transformers_model.forward).parameters,
        )
        reuse = accelerator.device.type == "cpu" and config.keep_freed_cpu_memory
        sequence.check_models(pack, [m for m in (policy, reference, critic) if m is not None], row_attention)
        forward = cls(accelerator, models, layout, is_encoder_decoder=unwrapped.is_encoder_decoder,
                      mini_batch_size=config.mini_batch_size, memory=memory, sequence=sequence, pack=pack,
                      row_attention=row_attention, reuse_logits_buffer=reuse,
                      lm_head_chunk_size=config.lm_head_chunk_size, temperature=config.temperature,
                      prefix_sharing=config.prefix_sharing, critic=critic,
                      dropout=has_dropout(policy, critic),
                      schedule=Schedule.of(config, (reference is not None) + 1),
                      truncation=Truncation.of(config, order="vllm" if config.use_vllm else "transformers"))  # fmt: skip
        forward.no_kept_sets = VLLMEngine.no_kept_sets if config.use_vllm else None  # why vLLM's are re-derived
        return forward

    @property
    def max_tokens(self) -> int | None:
        """The token budget of a pass now: the configured one, or the one an out-of-memory back-off left."""
        return self.memory.budget

    def buffer_rows(self, rows: Rows) -> int:
        """The LM-head buffer rows of a pass over ``rows`` (see :meth:`.oom_backoff.MemoryBackoff.buffer_rows`)."""
        return self.memory.buffer_rows(rows.buffer_rows)

    # ------------------------------------------------------------------------------------------
    # Rows and mini-batches
    # ------------------------------------------------------------------------------------------
    def make_rows(self, queries, responses, response_masks=None, prompts: tuple | None = None) -> Rows:
        """One batch on the device with its compact action mask (see :func:`~.rows.make_rows`); under
        sequence parallelism the LM-head buffers sized for one slice of a pass. ``prompts``: the rows'
        :func:`~.prefix_sharing.prompt_ids`, found on the host before the batch's copy (None: found here)."""
        rows = make_rows(queries, responses, response_masks, device=self.device,
                         is_encoder_decoder=self.is_encoder_decoder, mini_batch_size=self.mini_batch_size,
                         max_tokens=self.max_tokens)  # fmt: skip
        if not self.sequence.cuts:
            return self.prefix.rows(rows, prompts or queries, self.max_tokens)
        tokens = [rows.tokens(i) for i in range(len(rows))]
        slice_rows = self.sequence.slice_buffer_rows(rows.buffer_rows, tokens, self.mini_batch_size, self.max_tokens)
        return dataclasses.replace(rows, buffer_rows=slice_rows)

    def minibatches(self, rows: Rows, agree: bool = True):
        """The no-grad passes over every row of ``rows``: ``(index, idx)``, a host list and the same on the device.

        Consecutive runs of ``mini_batch_size`` rows, or under a token budget the balanced split of
        :meth:`split` (the same number of passes on every process; ``agree=False``: this process's own split,
        no collective).
        """
        if self.max_tokens is None:
            for start in range(0, len(rows), self.mini_batch_size):
                stop = min(start + self.mini_batch_size, len(rows))
                yield list(range(start, stop)), torch.arange(start, stop, device=self.device)
            return
        for index in self.split([list(range(len(rows)))], [rows.tokens(i) for i in range(len(rows))], agree, rows)[0]:
            yield index, to_device(index, self.device)

    def split(self, groups: list[list[int]], costs, agree: bool = True, rows: Rows | None = None,
              training: bool = False) -> list:  # fmt: skip
        """Each group of row numbers split into passes of at most ``max_tokens`` tokens (docs/algorithm.md
        section 18): per group, a list of passes, each a list of row numbers. ``costs[i]``: row ``i``'s tokens.
        ``rows``: their passes may count a shared prompt once (:meth:`~.prefix_sharing.PrefixSharing.units`; the
        passes are ``training`` passes or not).

        Under several processes every process makes, for each group, the largest number of passes any
        of them needs (one collective): each pass runs collectives (ZeRO-3 gathers parameters in the
        forward, ZeRO-2 reduces gradients in each backward, the learner's skip check reduces flags), and
        they must line up. A group of ``n`` rows never needs more than ``n`` passes, and every process
        holds as many rows, so the larger count can always be met. ``agree=False``: no collective, each
        process its own split.
        """
        units = [self.prefix.units(group, costs, rows, self.max_tokens, training=training) for group in groups]
        splits = [split_by_tokens(unit_costs, self.max_tokens) for _, unit_costs in units]
        if agree and self.accelerator.num_processes > 1 and splits:
            counts = torch.tensor([len(s) for s in splits], device=self.device)
            counts = self.accelerator.reduce(counts, reduction="max").tolist()
            units = [self.prefix.units(group, costs, rows, self.max_tokens, n, training) for group, n in zip(groups, counts)]
            again = zip(splits, counts, units)
            splits = [s if len(s) == n else split_by_tokens(c, self.max_tokens, n) for s, n, (_, c) in again]
        longest = max((costs[i] for group in groups for i in group), default=0)
        if longest > self.max_tokens and not self._warned_long_row:
            self._warned_long_row = True
            warnings.warn(
                f"A row of {longest} prompt+response tokens exceeds max_tokens_per_minibatch={self.max_tokens}: "
                "it gets a forward/backward pass of its own, larger than the budget.",
                stacklevel=3,
            )
        return [units_passes(s, u, group) for s, (u, _), group in zip(splits, units, groups)]

    def unwrapped(self, model):
        return next((inner for known, inner in self.models if model is known), None) or self.accelerator.unwrap_model(model)

    def packs(self, model) -> bool:
        """Whether the passes of ``model`` take packed rows: packing is on and ``model`` is one the trainer checked."""
        return self.pack and any(model is known for known, _ in self.models)

    @contextmanager
    def per_row_attention(self):
        """The block every pass of the trainer runs in (forward and backward): packed passes attend within each
        row (under sequence parallelism through the Ulysses all-to-all), and on CUDA sdpa runs without cuDNN
        attention - padded and PTX passes too, whose widths change from mini-batch to mini-batch (cuDNN builds
        a graph per new shape, docs/gpu_path.md)."""
        with attend_per_row(self.row_attention.values(), self.sequence.attention), without_cudnn(self.device):
            yield

    def gather_slots(self, *per_slot: torch.Tensor | None) -> tuple:
        """Per-slot results ``(n, ...)`` of the last pass's LM head, whole: under sequence parallelism this
        process's slice's ``n`` slots gathered to the pass's ``N`` over the group (differentiable, see
        :class:`~trl_lite.parallel.sequence_parallel.SequencePass`); otherwise as given."""
        if self._sequence_pass is None:
            return per_slot
        return self._sequence_pass.gather_slots(*per_slot)

    def kept_of(self, rows: Rows, idx: torch.Tensor, slots: tuple):
        """The kept sets ``(ids (N, K), counts (N,))`` of a pass's slots ``(b, k)`` over rows ``idx`` - under sequence
        parallelism of this process's slice of them (the last :meth:`head_inputs`' cut) - or None for rows that carry
        none (an untruncated run)."""
        if rows.kept is None:
            return None
        row, position = idx[slots[0]], slots[1]
        if self._sequence_pass is not None:
            row, position = row[self._sequence_pass.slots], position[self._sequence_pass.slots]
        return rows.kept.for_slots(row, position)

    def replaying(self, rows: Rows, records: list | None) -> Rows:
        """``rows`` carrying the sampler's own kept sets (docs/algorithm_rollouts.md section 23): ``records`` per row a
        one-row :class:`~trl_lite.core.kept_sets.KeptSets` over its compact positions, or None (no record: the
        rollout pass re-derives that row's sets; said once per run, with why)."""
        if self.truncation is None:
            return rows
        why = self.no_kept_sets or ("not among those the trainer's engine sampled since the last step: edited, "
                                    "sampled elsewhere, or by a greedy generate() (do_sample=False draws from no "
                                    "distribution; its rows are scored under PPOConfig's)")  # fmt: skip
        records = records or [None] * len(rows)
        missing = sum(record is None for record in records)
        if missing and not self._said_rederived:
            self._said_rederived = True
            cut = self.truncation
            warnings.warn(
                f"PPOConfig truncates sampling (top_k={cut.top_k}, top_p={cut.top_p}, min_p={cut.min_p}): {missing} of "
                f"{len(rows)} responses have no kept sets recorded by their sampler ({why}), so their sets are "
                f"re-derived from the rollout pass's logits by the {cut.order} sampler's rule and order; where they "
                "differ from the sampler's at a cut-off, a tie or a penalty, rollout/logprob_diff shows it. Said once "
                "per run (docs/truncated_sampling.md).",
                stacklevel=5,
            )
        if missing == len(rows):
            return rows
        return dataclasses.replace(rows, kept=KeptSets.stacked(records, rows.action_mask.shape[1], self.device))

    def with_kept(self, rows: Rows) -> tuple[Rows, torch.Tensor | None]:
        """``rows`` carrying the kept sets the last :meth:`rollout`'s policy passes made, and the policy's untruncated
        entropy ``(B, L)`` there (the statistic beside the truncated one); ``rows`` and None when it made none."""
        made, self._rollout_kept = self._rollout_kept, None
        if made is None:
            return rows, None
        return dataclasses.replace(rows, kept=made[0]), made[1]

    # ------------------------------------------------------------------------------------------
    # Passes
    # ------------------------------------------------------------------------------------------
    def head_inputs(self, model, rows: Rows, index: list[int], idx: torch.Tensor, lm_head_inputs: bool = False,
                    return_values: bool = True, critic=None):  # fmt: skip
        """The LM head's logits ``(N, V)`` at the token slots of rows ``index`` - or, with ``lm_head_inputs``,
        its inputs ``(N, H)`` - their target ids ``(N,)``, the values ``(b, L_mb)`` (None without
        ``return_values``), the slots and ``L_mb``.

        With a separate ``critic`` (docs/algorithm.md section 9) the values are its outputs on the
        same mini-batch inputs, read at the same positions; the policy's value head does not run.
        """
        packed = self.packs(model)
        # Whether this pass lays out shared prompts once is the decider's (a pass in train mode: dropout active).
        shared = self.prefix.inputs(rows, index, model.training, self.device) if packed else None
        if shared is None:
            inputs, positions, slots, targets, width = self.layout.inputs(rows, index, idx, packed=packed)
        else:
            inputs, positions, slots, targets, width, attention_rows = shared
        piece = self._sequence_pass = None
        if packed and self.sequence.cuts:
            inputs, piece = self.cut(inputs, rows, index)
            targets = targets[piece.slots]
            self._sequence_pass = piece
        critic_inputs = {key: value for key, value in inputs.items() if key != "logits_positions"}
        if lm_head_inputs:
            inputs["return_lm_head_inputs"] = True
        if packed:
            # Built once for the pass and shared by its layers and the critic's: the offsets of the
            # varlen kernel (one host-to-device copy) and, on CUDA, the mask that spares transformers'
            # packed-row detection its host read (see models.packed_attention.rows_mask).
            # A slice's layers get its SequencePass, which holds the whole stream's rows.
            if piece is None:
                if shared is None:
                    attention_rows = packed_rows((len(rows.sequences[i]) for i in index), self.device)
                mask, keywords = rows_mask(attention_rows, self.device), {ROW_LENGTHS: attention_rows}
            else:
                mask, keywords = None, piece.attention_keywords
            for module, module_inputs in ((model, inputs), (critic, critic_inputs)):
                if id(module) in self.row_attention:
                    module_inputs.update(keywords)
                    if mask is not None:
                        module_inputs["attention_mask"] = mask
        outputs, _, values = model(**inputs, return_values=return_values and critic is None)
        if critic is not None:
            values = critic(**critic_inputs)
        if values is not None:
            values = values if piece is None else piece.gather_tokens(values)
            values = (values[:, :-1] if rows.shift else at_positions(values, positions)).float()
        return outputs, targets, values, slots, width

    def cut(self, inputs: dict, rows: Rows, index: list[int]):
        """This process's slice of the packed pass of rows ``index`` (see
        :meth:`~trl_lite.parallel.sequence_parallel.SequenceParallel.cut`), from host-side lengths."""
        lengths = [len(rows.sequences[i]) for i in index]
        firsts, start = [], 0
        for i, length in zip(index, lengths):
            firsts.append(start + len(rows.queries[i]) - 1)
            start += length
        return self.sequence.cut(inputs, lengths, firsts, [rows.slot_count(i) for i in index], self.layout.pad_id)

    def logprobs(self, model, rows: Rows, index: list[int], idx: torch.Tensor, return_logits: bool = False,
                 return_values: bool = True, critic=None, return_head_inputs: bool = False,
                 gather_outputs: bool = True, truncated: bool = False, choice: HeadChoice | None = None):  # fmt: skip
        """Log-probs and values at the action positions of rows ``index``, without the entropy.

        Shapes: logprobs, values ``(b, L_mb)`` (log-probs 0 past each response; values None without
        ``return_values``); with ``return_logits`` also the logits ``(N, V)`` at the token slots and
        the slots (else None for both) - or with ``return_head_inputs`` (the model has a linear head)
        the head's inputs ``(N, H)`` there instead of the logits; and ``L_mb``. Under sequence parallelism
        ``gather_outputs=False`` keeps those logits or inputs to this process's slots (:meth:`gather_slots`
        gathers what is computed from them). ``truncated`` (the policy's rollout and classic passes of a truncating
        run): log-probs under ``pi_T^K``, the kept sets made from the pass's logits and, in a rollout, recorded.
        ``choice``: the head's path (default :meth:`~.head_path.HeadPath.choose`'s, the model's logits with
        ``return_logits``).
        """
        if choice is None:
            choice = self.head.choose(model, self.buffer_rows(rows), own_logits=return_logits)
        outputs, targets, values, slots, width = self.head_inputs(
            model, rows, index, idx, lm_head_inputs=choice.fused, return_values=return_values, critic=critic
        )
        if truncated and self.truncation is not None:
            # The sampler's sets where the rows carry them (replayed), the rule's from these logits elsewhere.
            kept = self.kept_of(rows, idx, slots)
            logprobs, _, entropy, ids, counts = self.head.truncated(choice, outputs, targets, self.temperature, kept,
                                                                    derive=self.truncation)  # fmt: skip
            if self._kept_passes is not None:
                if self._sequence_pass is not None:  # the slice's sets and entropy, whole on every process of the group
                    ids, counts = self._sequence_pass.gather_sets(ids, counts)
                    (entropy,) = self._sequence_pass.gather_slots(entropy)
                keys = idx[slots[0]] * rows.action_mask.shape[1] + slots[1]
                self._kept_passes.append((keys, ids, counts, entropy))
        else:
            logprobs, _ = self.head.apply(choice, outputs, targets, self.buffer_rows(rows), rows)
        keep = return_logits or return_head_inputs
        logprobs, gathered = self.gather_slots(logprobs, outputs if keep and gather_outputs else None)
        logprobs = to_compact(logprobs, slots, len(index), width)
        outputs = gathered if gather_outputs else outputs
        return logprobs, values, (outputs if keep else None), (slots if keep else None), width

    @torch.no_grad()
    def rollout(self, rows: Rows, policy, reference, critic=None, policy_values: bool = True, full_kl: bool = False,
                policy_pass: bool = True, reference_pass: bool = True):  # fmt: skip
        """Policy and reference passes without grad, in mini-batches (docs/algorithm.md section 3).

        ``reference``: a context-manager factory yielding the module that computes reference
        log-probs. Returns logprobs, ref_logprobs, values ``(B, L)`` (values zero when neither
        ``policy_values`` nor a ``critic`` gives them) and, with ``full_kl``, the exact per-token KL
        ``(B, L)`` (else None). Full-KL logits live one mini-batch at a time, or one chunk of tokens at a
        time (:meth:`~.head_path.HeadPath.kl_choices`: from both models' head inputs). ``policy_pass`` /
        ``reference_pass`` False: that model does not run and its results are None (see
        :class:`~.rollout_plan.RolloutPlan`; ``full_kl`` needs both).
        """
        batch, width = len(rows), rows.action_mask.shape[1]
        policy.eval()
        if critic is not None:
            critic.eval()
        models = (policy, reference, critic, policy_values, full_kl, policy_pass, reference_pass)

        def passes():
            out = torch.zeros(4 if full_kl else 3, batch, width, device=self.device)
            self._kept_passes = [] if self.truncation is not None and policy_pass else None
            # Asked per attempt: a back-off shrinks the passes, and with them the head's buffer.
            kl_choices = self.head.kl_choices(policy, reference, self.buffer_rows(rows)) if full_kl else None
            with self.per_row_attention():
                for index, idx in self.minibatches(rows):
                    self.memory.begin_pass(self.prefix.run_tokens(rows, index), len(index))  # as it runs
                    with self.memory.attempt(what="a rollout pass"):
                        self.rollout_pass(out, rows, index, idx, *models, kl_choices)
                    if self.memory.stop_early:
                        break
            return out

        # A pass that runs out of memory: every pass again with half the budget (see oom_backoff).
        try:
            with transient_blocks_in_heap():  # a sequence-parallel process's activations: reused, not mapped anew
                out = self.memory.until_done(passes)
            if self._kept_passes is not None:
                self._rollout_kept = self._kept_of_passes(batch, width)
        finally:
            self._kept_passes = None
        mask = rows.action_mask
        logprobs = out[0] * mask if policy_pass else None
        values = out[2] * mask if policy_pass else None
        return logprobs, (out[1] * mask if reference_pass else None), values, (out[3] * mask if full_kl else None)

    def _kept_of_passes(self, batch: int, width: int) -> tuple[KeptSets, torch.Tensor]:
        """The rollout's kept sets as one :class:`~trl_lite.core.kept_sets.KeptSets` over its ``(B, L)`` positions,
        and the untruncated entropy ``(B, L)`` of the same passes."""
        passes = self._kept_passes
        entropy = torch.zeros(batch * width, device=self.device)
        for keys, _, _, full in passes:
            entropy[keys] = full.float()
        kept = KeptSets.from_passes(batch, width, [(keys, ids, counts) for keys, ids, counts, _ in passes], self.device)
        return kept, entropy.view(batch, width)

    def rollout_pass(self, out, rows: Rows, index: list[int], idx: torch.Tensor, policy, reference, critic,
                     policy_values: bool, full_kl: bool, policy_pass: bool, reference_pass: bool,
                     kl_choices: tuple | None) -> None:  # fmt: skip
        """One pass of :meth:`rollout` over rows ``index``: writes their log-probs, reference log-probs, values
        (and exact KL, by ``kl_choices``: both models' logits or head inputs) into ``out`` ``(3 or 4, B, L)``.
        Under sequence parallelism each process computes the KL of its slice's slots, then gathers it."""
        choice, ref_choice = kl_choices or (None, None)
        kl_outputs = {"return_head_inputs": full_kl, "gather_outputs": False}
        if policy_pass:
            logprobs, values, logits, slots, w = self.logprobs(
                policy, rows, index, idx, return_values=policy_values, critic=critic, truncated=True, choice=choice,
                **kl_outputs,
            )  # fmt: skip
            out[0, idx, :w] = logprobs
            if values is not None:
                out[2, idx, :w] = values
        if reference_pass:
            with reference() as ref:
                ref_logprobs, _, ref_logits, _, w = self.logprobs(
                    ref, rows, index, idx, return_values=False, choice=ref_choice, **kl_outputs
                )
            out[1, idx, :w] = ref_logprobs
        if full_kl:
            (kl,) = self.gather_slots(self.head.full_kl(logits, ref_logits, choice, ref_choice))
            out[3, idx, :w] = to_compact(kl, slots, len(index), w)
