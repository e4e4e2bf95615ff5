"""``PPOTrainer``: the classic ``step(queries, responses, scores)`` PPO trainer on accelerate.

``step()`` reads top-down like ``PPO_SPEC.md``: validate, shape the scores, forward passes,
rewards, advantages, epochs, statistics, controller update. The math lives in
:mod:`trl_lite.core`; this module batches rows, moves them to the device and talks to the
other processes.

Per-token tensors inside ``step()`` use a compact layout: ``(B, L)`` where position ``k`` of
row ``b`` is the prediction of response token ``k`` (decoder-only models) or of decoder token
``k + 1`` (encoder-decoder models). It holds exactly the action positions of PPO_SPEC section 3
and nothing of the query. Logits are computed only at the slots of that layout that hold a
response token (N of them per mini-batch, see ``_token_slots``), and scattered back into it.
:meth:`PPOTrainer.batched_forward_pass` returns the spec's ``(B, T)`` layout for users.

Process and device set-up (accelerate, DeepSpeed, the default optimizer) is in
:mod:`.accelerate_setup`; the dataloader's resumable position in :mod:`.resumable_loader`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .. import core
from ..core import (
    compute_gae,
    compute_kl_rewards,
    entropy_from_logits,
    flatten_dict,
    full_kl_from_logits,
    kl_estimate,
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    stats_to_np,
)
from ..models import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    create_reference_model,
)
from .accelerate_setup import (
    build_accelerator,
    default_optimizer,
    empty_device_cache,
    fill_deepspeed_config,
    prepare_deepspeed_reference,
)
from .cpu_memory import keep_freed_cpu_memory
from .kl_controllers import AdaptiveKLController, FixedKLController
from .ppo_config import PPOConfig
from .resumable_loader import ResumableLoader
from .running_moments import RunningMoments

SUPPORTED_MODELS = (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)
_TRAINER_STATE = "trl_lite_trainer_state.json"
# Statistics that are distributions (1-D arrays): concatenated over processes instead of averaged.
_DIST_STATS = (
    "objective/kl_dist",
    "objective/logprobs",
    "objective/ref_logprobs",
    "tokens/queries_dist",
    "tokens/responses_dist",
    "ppo/policy/advantages",
    "ppo/policy/ratio",
)


@dataclass
class _Rows:
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


class PPOTrainer:
    """PPO for language models with the classic API: the user generates and scores, ``step()`` trains.

    Args:
        config: the run's :class:`PPOConfig`.
        model: the policy, an ``AutoModelForCausalLMWithValueHead`` or ``AutoModelForSeq2SeqLMWithValueHead``.
        ref_model: the frozen reference; made with :func:`create_reference_model` when None, or, for a
            PEFT model, the same model with its adapter disabled.
        tokenizer: used for padding side and pad id, ``generate`` and ``save_pretrained``.
        dataset: optional ``torch`` or ``datasets`` dataset; gives ``trainer.dataloader``.
        optimizer: default ``Adam`` over the trainable parameters at ``config.learning_rate``.
        data_collator: collate function of the dataloader.
        num_shared_layers: layers shared between policy and the created reference.
        lr_scheduler: stepped once per ``step()``.
    """

    def __init__(
        self,
        config: PPOConfig | None = None,
        model: PreTrainedModelWrapper | None = None,
        ref_model: PreTrainedModelWrapper | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        dataset=None,
        optimizer: torch.optim.Optimizer | None = None,
        data_collator=None,
        num_shared_layers: int | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ):
        config = PPOConfig() if config is None else config
        _check_constructor_args(config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers)
        core.set_seed(config.seed)
        self.config = config
        self.accelerator = build_accelerator(config)
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size

        self.is_encoder_decoder = model.is_encoder_decoder
        self.is_peft_model = model.is_peft_model
        config.is_encoder_decoder = self.is_encoder_decoder
        config.is_peft_model = self.is_peft_model
        self.tokenizer = tokenizer
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()

        if ref_model is not None:
            self.ref_model = ref_model
        elif self.is_peft_model:
            self.ref_model = None
        else:
            self.ref_model = create_reference_model(model, num_shared_layers=num_shared_layers)

        if config.keep_freed_cpu_memory and self.accelerator.device.type == "cpu":
            keep_freed_cpu_memory()
        self.optimizer = optimizer or default_optimizer(model, config.learning_rate)
        self.lr_scheduler = lr_scheduler
        self.data_collator = data_collator
        self.dataset = dataset
        self._signature_columns = _signature_columns(model)
        self._data_generator = torch.Generator().manual_seed(config.seed)
        dataloader = self._build_dataloader(dataset, data_collator) if dataset is not None else None

        self.is_deepspeed_enabled = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        self._is_zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        if self.is_deepspeed_enabled:
            fill_deepspeed_config(self.accelerator, config)
        to_prepare = [model, self.optimizer] + ([dataloader] if dataloader is not None else [])
        to_prepare += [lr_scheduler] if lr_scheduler is not None else []
        prepared = list(self.accelerator.prepare(*to_prepare))
        self.model, self.optimizer = prepared[0], prepared[1]
        self.dataloader = ResumableLoader(prepared[2], self._data_generator) if dataloader is not None else None
        if lr_scheduler is not None:
            self.lr_scheduler = prepared[-1]
        if self.ref_model is not None:
            if self.is_deepspeed_enabled:
                self.ref_model = prepare_deepspeed_reference(self.ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)

        self.current_device = self.accelerator.device
        self.kl_ctl = (
            AdaptiveKLController(config.init_kl_coef, config.target, config.horizon)
            if config.adap_kl_ctrl
            else FixedKLController(config.init_kl_coef)
        )
        self.running = RunningMoments(self.accelerator)
        self.current_step = 0
        self.skipped_minibatches = 0

        unwrapped = self.accelerator.unwrap_model(self.model)
        self._vocab_size = unwrapped.pretrained_model.get_input_embeddings().num_embeddings
        self._pass_position_ids = "position_ids" in inspect.signature(unwrapped.transformers_model.forward).parameters
        self._pad_id = _pad_token_id(tokenizer, unwrapped.config)
        self._padding_side = getattr(tokenizer, "padding_side", "right") or "right"
        self._logits_buffer = None  # see _logits_out
        # (prepared model, unwrapped model) pairs, looked up once: unwrapping reads package metadata,
        # too slow for every mini-batch.
        self._unwrapped_model = unwrapped
        self._unwrapped = [(self.model, unwrapped)]
        if self.ref_model is not None:
            self._unwrapped.append((self.ref_model, self.accelerator.unwrap_model(self.ref_model)))

        if config.log_with is not None:
            self.accelerator.init_trackers(
                config.tracker_project_name,
                config={k: v for k, v in flatten_dict(asdict(config)).items() if isinstance(v, (int, float, str, bool))},
                init_kwargs=config.tracker_kwargs,
            )

    # ------------------------------------------------------------------------------------------
    # The PPO step
    # ------------------------------------------------------------------------------------------
    def step(
        self,
        queries: list[torch.LongTensor],
        responses: list[torch.LongTensor],
        scores: list[torch.FloatTensor],
        response_masks: list[torch.Tensor] | None = None,
    ) -> dict:
        """Run one PPO step on ``batch_size`` (query, response, score) triplets of this process.

        Returns the statistics of PPO_SPEC section 8 (floats and 1-D numpy arrays).
        """
        self._validate_step_inputs(queries, responses, scores, response_masks)
        config = self.config
        timing = {}
        t0 = time.time()

        # 1. Score shaping (section 2)
        scores = _scores_tensor(scores, self.current_device)
        if config.use_score_scaling:
            self.running.update(scores)
            scale = self.running.std + self.running.eps
            scores = (scores - self.running.mean) / scale if config.use_score_norm else scores / scale
        if config.score_clip is not None:
            scores = scores.clamp(-config.score_clip, config.score_clip)

        # 2. Forward passes without grad (section 3)
        t = time.time()
        rows = self._make_rows(queries, responses, response_masks)
        rows.reuse_logits_buffer = self.current_device.type == "cpu" and config.keep_freed_cpu_memory
        mask = rows.action_mask
        logprobs, ref_logprobs, values, full_kl = self._rollout_forward(rows)
        timing["time/ppo/forward_pass"] = time.time() - t

        # 3. KL-shaped rewards (section 4)
        t = time.time()
        kl_coef = self.kl_ctl.value
        kls = kl_estimate(logprobs, ref_logprobs, config.kl_penalty, full_kl)
        rewards, non_score_reward = compute_kl_rewards(scores, kls, mask, kl_coef)
        timing["time/ppo/compute_rewards"] = time.time() - t

        # 4. Advantages (section 5)
        t = time.time()
        values, advantages, returns = self._advantages(values, rewards, mask)
        timing["time/ppo/compute_advantages"] = time.time() - t

        # 5. PPO epochs (section 6)
        t = time.time()
        train_stats = self._optimize(rows, logprobs, values, advantages, returns)
        timing["time/ppo/optimize_step"] = time.time() - t

        # 6. Statistics (section 8)
        t = time.time()
        stats = self._step_stats(rows, scores, kls, logprobs, ref_logprobs, non_score_reward, advantages, kl_coef)
        stats.update(train_stats)
        stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        stats = self._reduce_stats(stats)
        timing["time/ppo/calc_stats"] = time.time() - t
        stats["ppo/learning_rate"] = self.optimizer.param_groups[0]["lr"]

        # 7. Controller and scheduler (section 7)
        if math.isfinite(stats["objective/kl"]):
            self.kl_ctl.update(stats["objective/kl"], config.batch_size * self.accelerator.num_processes)
        else:
            # A non-finite KL (a NaN in the rollout pass) would make kl_coef NaN for every later step.
            warnings.warn(f"objective/kl is {stats['objective/kl']}; the KL coefficient is left unchanged.", stacklevel=2)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        if config.optimize_device_cache:
            empty_device_cache()
        timing["time/ppo/total"] = time.time() - t0
        stats.update(timing)
        return stats

    # ------------------------------------------------------------------------------------------
    # Inputs
    # ------------------------------------------------------------------------------------------
    def _validate_step_inputs(self, queries, responses, scores, response_masks) -> None:
        """Reject a malformed batch with a message naming the argument and row, before any state changes."""
        n = self.config.batch_size
        for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of {n} tensors, got {type(value).__name__}.")
            if len(value) != n:
                raise ValueError(
                    f"{name} must hold config.batch_size={n} items (per process), got {len(value)}."
                )
        for name, seqs in (("queries", queries), ("responses", responses)):
            for i, seq in enumerate(seqs):
                if not isinstance(seq, torch.Tensor):
                    raise TypeError(f"{name}[{i}] must be a 1-D torch.LongTensor of token ids, got {type(seq).__name__}.")
                if seq.dim() != 1:
                    raise ValueError(f"{name}[{i}] must be 1-D (token ids), got shape {tuple(seq.shape)}.")
                if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                    raise TypeError(f"{name}[{i}] must hold integer token ids, got dtype {seq.dtype}.")
                if seq.numel() == 0:
                    raise ValueError(f"{name}[{i}] is empty; every query and response needs at least 1 token.")
            if self._vocab_size is not None:
                lows = torch.stack([s.min() for s in seqs]).cpu()
                highs = torch.stack([s.max() for s in seqs]).cpu()
                bad = ((lows < 0) | (highs >= self._vocab_size)).nonzero()
                if len(bad):
                    i = int(bad[0])
                    raise ValueError(
                        f"{name}[{i}] holds token ids outside [0, {self._vocab_size}) (the model's vocabulary): "
                        f"min {int(lows[i])}, max {int(highs[i])}."
                    )
        for i, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, (torch.Tensor, int, float, np.number, np.ndarray)):
                raise TypeError(f"scores[{i}] must be a number or a 0-d tensor, got {type(score).__name__}.")
            score_t = torch.as_tensor(score)
            if score_t.numel() != 1:
                raise ValueError(f"scores[{i}] must be one number (a 0-d tensor), got shape {tuple(score_t.shape)}.")
            if not torch.isfinite(score_t.float()).all():
                raise ValueError(f"scores[{i}] must be finite, got {score_t.item()}.")
        if response_masks is not None:
            if not isinstance(response_masks, (list, tuple)) or len(response_masks) != n:
                given = len(response_masks) if isinstance(response_masks, (list, tuple)) else type(response_masks).__name__
                raise ValueError(f"response_masks must be a list of {n} tensors (one per response), got {given}.")
            for i, (m, r) in enumerate(zip(response_masks, responses)):
                if not isinstance(m, torch.Tensor):
                    raise TypeError(f"response_masks[{i}] must be a tensor of 0/1 like responses[{i}], got {type(m).__name__}.")
                if m.shape != r.shape:
                    raise ValueError(
                        f"response_masks[{i}] must have the shape of responses[{i}], {tuple(r.shape)}, got {tuple(m.shape)}."
                    )
                if not ((m == 0) | (m == 1)).all():
                    raise ValueError(f"response_masks[{i}] must hold only 0 and 1, got values {m.unique().tolist()}.")
        n_actions = self._count_actions(responses, response_masks)
        if n_actions < 2:
            raise ValueError(
                f"responses/response_masks: the batch has {n_actions} action token(s) (response tokens with mask 1"
                f"{', excluding the first and last decoder token' if self.is_encoder_decoder else ''}); "
                "advantage whitening needs at least 2."
            )

    def _count_actions(self, responses, response_masks) -> int:
        if self.is_encoder_decoder:
            if response_masks is None:
                return sum(max(len(r) - 2, 0) for r in responses)
            return int(sum(m[2:].sum() for m in response_masks if len(m) > 2))
        if response_masks is None:
            return sum(len(r) for r in responses)
        return int(sum(m.sum() for m in response_masks))

    def _make_rows(self, queries, responses, response_masks) -> _Rows:
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
        return _Rows(queries, responses, sequences, query_len, response_len, action_mask, buffer_rows)

    def _slot_count(self, response: torch.Tensor) -> int:
        """How many slots of a row predict one of its response tokens (all but the first for encoder-decoders)."""
        return max(len(response) - (1 if self.is_encoder_decoder else 0), 0)

    def _width(self, rows: _Rows, idx: torch.Tensor) -> int:
        """Compact length ``L_mb`` of rows ``idx``: their longest response (minus one for encoder-decoders).

        Read from the host-side lengths of the response tensors, as :meth:`_token_slots` does.
        """
        longest = max(len(rows.responses[i]) for i in idx.tolist())
        return max(longest - 1, 1) if self.is_encoder_decoder else longest

    def _minibatch_inputs(self, rows: _Rows, idx: torch.Tensor) -> tuple[dict, torch.Tensor, tuple, torch.Tensor, int]:
        """Model inputs of rows ``idx``, padded to their own longest row.

        Returns the model kwargs, ``positions (b, L_mb)`` of the compact slots in the model's output,
        the slots that hold a response token as a pair ``(row, k)`` of length N (see
        :meth:`_token_slots`), their ``targets (N,)`` (the predicted token ids) and ``L_mb``. The
        model is asked for logits at those N slots only.
        """
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

    def _token_slots(self, rows: _Rows, index: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _forward_rows(self, model, rows: _Rows, idx: torch.Tensor, return_logits: bool = False):
        """Log-probs and values at the action positions of rows ``idx``.

        Shapes: logprobs, values ``(b, L_mb)`` (log-probs 0 past each response); with
        ``return_logits`` also the logits ``(N, V)`` at the token ``slots`` (else None for both).
        """
        head = None if return_logits else self._linear_head(model)
        outputs, targets, values, slots, width = self._head_rows(model, rows, idx, lm_head_inputs=head is not None)
        if head is None:
            logprobs = logprobs_from_logits(outputs, targets)
        else:
            out = self._logits_out(rows, head)
            logprobs = logprobs_from_hidden(outputs, head.weight, head.bias, targets, rows.buffer_rows, out)
        logprobs = _to_compact(logprobs, slots, len(idx), width)
        return logprobs, values, (outputs if return_logits else None), (slots if return_logits else None), width

    def _head_rows(self, model, rows: _Rows, idx: torch.Tensor, lm_head_inputs: bool = False):
        """The LM head's logits ``(N, V)`` at the token slots of rows ``idx`` - or, with ``lm_head_inputs``,
        its inputs ``(N, H)`` - their target ids ``(N,)`` and the values ``(b, L_mb)``."""
        inputs, positions, slots, targets, width = self._minibatch_inputs(rows, idx)
        if lm_head_inputs:
            inputs["return_lm_head_inputs"] = True
        outputs, _, values = model(**inputs)
        values = values[:, :-1] if self.is_encoder_decoder else values.gather(1, positions)
        return outputs, targets, values.float(), slots, width

    def _linear_head(self, model) -> torch.nn.Linear | None:
        """The model's LM head when the trainer may fuse it with the log-softmax, else None.

        Fused (``core.logprobs_and_entropy_from_hidden``), the head's logits become the softmax in
        place, in a buffer of ``_Rows.buffer_rows`` rows: one vocabulary-sized tensor per mini-batch
        instead of two, of the same size in every mini-batch of a step.
        """
        unwrapped = next((inner for known, inner in self._unwrapped if model is known), None)
        if unwrapped is None:
            unwrapped = self.accelerator.unwrap_model(model)
        # Asked every pass: the head may be replaced (resize_token_embeddings) after the trainer is made.
        return unwrapped.linear_lm_head()

    def _logits_out(self, rows: _Rows, head: torch.nn.Linear) -> torch.Tensor | None:
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
    def _rollout_forward(self, rows: _Rows):
        """Policy and reference passes without grad, in mini-batches (PPO_SPEC section 3).

        Returns logprobs, ref_logprobs, values ``(B, L)`` and, for ``kl_penalty="full"``, the exact
        per-token KL ``(B, L)`` (else None). Full-KL logits live one mini-batch at a time.
        """
        full = self.config.kl_penalty == "full"
        batch, width = len(rows), rows.action_mask.shape[1]
        out = torch.zeros(4 if full else 3, batch, width, device=self.current_device)
        self.model.eval()
        for idx in torch.arange(batch, device=self.current_device).split(self.config.mini_batch_size):
            logprobs, values, logits, slots, w = self._forward_rows(self.model, rows, idx, return_logits=full)
            with self._reference() as ref:
                ref_logprobs, _, ref_logits, _, _ = self._forward_rows(ref, rows, idx, return_logits=full)
            out[0, idx, :w], out[1, idx, :w], out[2, idx, :w] = logprobs, ref_logprobs, values
            if full:
                out[3, idx, :w] = _to_compact(full_kl_from_logits(logits, ref_logits), slots, len(idx), w)
        mask = rows.action_mask
        return out[0] * mask, out[1] * mask, out[2] * mask, (out[3] * mask if full else None)

    def _advantages(self, values, rewards, mask):
        """Masked values, whitened GAE advantages and returns (PPO_SPEC section 5). Shapes ``(B, L)``."""
        if self.config.whiten_rewards:
            rewards = self._whiten(rewards, mask, shift_mean=False)
        advantages, returns = compute_gae(values, rewards, mask, self.config.gamma, self.config.lam)
        advantages = self._whiten(advantages, mask)
        return values * mask, advantages.detach(), returns.detach()

    def _whiten(self, values, mask, shift_mean=True):
        """``masked_whiten`` with the statistics of the action tokens of every process. Shape ``(B, L)``.

        Whitening over all processes makes a step on N processes x B rows equal to one on N*B rows.
        """
        if self.accelerator.num_processes == 1:
            return masked_whiten(values, mask, shift_mean)
        sums = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]), reduction="sum")
        mean, count = sums[0] / sums[1], sums[1]
        squares = self.accelerator.reduce((((values - mean) ** 2) * mask).sum().reshape(1), reduction="sum")[0]
        whitened = (values - mean) * torch.rsqrt(squares / (count - 1).clamp(min=1) + 1e-8)
        return whitened if shift_mean else whitened + mean

    # ------------------------------------------------------------------------------------------
    # Optimisation
    # ------------------------------------------------------------------------------------------
    def _optimize(self, rows, old_logprobs, old_values, advantages, returns) -> dict:
        """``ppo_epochs`` epochs of shuffled mini-batches (PPO_SPEC section 6). Returns averaged statistics."""
        config = self.config
        batch = len(rows)
        minibatch_stats, ratios = [], []
        skipped_before = self.skipped_minibatches
        self.model.train()
        for _ in range(config.ppo_epochs):
            order = torch.randperm(batch).to(self.current_device)
            epoch_policykl = []
            for idx in order.split(config.mini_batch_size):
                w = self._width(rows, idx)
                stats, ratio = self._train_rows(
                    rows, idx, old_logprobs[idx, :w], old_values[idx, :w], advantages[idx, :w], returns[idx, :w]
                )
                if stats is not None:
                    minibatch_stats.append(stats)
                    ratios.append(ratio)
                    epoch_policykl.append(stats["policy/policykl"])
            if config.early_stopping and self._should_stop(epoch_policykl):
                break
        if minibatch_stats:
            stacked = {k: torch.stack([s[k] for s in minibatch_stats]).mean() for k in minibatch_stats[0]}
        else:
            stacked = {k: torch.tensor(float("nan")) for k in _TRAIN_STAT_KEYS}
        stats = {f"ppo/{k}": v for k, v in stacked.items()}
        stats["ppo/policy/ratio"] = torch.cat(ratios) if ratios else torch.zeros(0)
        stats["ppo/skipped_minibatches"] = torch.tensor(float(self.skipped_minibatches - skipped_before))
        return stats

    def _should_stop(self, epoch_policykl: list) -> bool:
        """Early stopping: the epoch's mean policykl over all processes above 1.5 * target_kl."""
        if not epoch_policykl:
            return False
        policykl = torch.stack(epoch_policykl).mean().reshape(1)
        policykl = self.accelerator.reduce(policykl, reduction="mean")
        return bool(policykl.item() > 1.5 * self.config.target_kl)

    def _train_rows(self, rows, idx, old_logprobs, old_values, advantages, returns):
        """One mini-batch: forward with grad, losses, guarded backward and optimizer step.

        Returns its statistics (None when skipped) and the masked per-token ratios.
        """
        mask = rows.action_mask[idx, : old_logprobs.shape[1]]
        with self.accelerator.accumulate(self.model):
            head = self._linear_head(self.model)
            outputs, targets, vpreds, slots, width = self._head_rows(self.model, rows, idx, head is not None)
            if head is None:
                logprobs, entropy = logprobs_and_entropy_from_logits(outputs, targets)
            else:
                logprobs, entropy = logprobs_and_entropy_from_hidden(
                    outputs, head.weight, head.bias, targets, rows.buffer_rows, self._logits_out(rows, head)
                )
            del outputs  # the logits, when the head ran in the model: the saved softmax replaces them
            logprobs = _to_compact(logprobs, slots, len(idx), width)
            entropy = _to_compact(entropy, slots, len(idx), width)
            pg_loss, vf_loss, stats = self.loss(
                old_logprobs, old_values, None, vpreds, logprobs, mask, advantages, returns, entropy=entropy
            )
            loss = pg_loss + self.config.vf_coef * vf_loss
            reason = self._skip_reason(loss, stats["policy/ratio"], mask)
            if reason is not None:
                self._skip(reason)
                if self.accelerator.sync_gradients:
                    self.optimizer.zero_grad()
                return None, None
            self.accelerator.backward(loss)
            if self.accelerator.sync_gradients and not self._gradients_finite():
                self._skip("the gradients are not finite")
                self.optimizer.zero_grad()
                return None, None
            self.optimizer.step()
            self.optimizer.zero_grad()
        ratio = torch.exp(logprobs - old_logprobs).detach()[mask.bool()]
        return stats, ratio

    def _skip_reason(self, loss: torch.Tensor, mean_ratio: torch.Tensor, mask: torch.Tensor) -> str | None:
        """Why this mini-batch must be skipped on every process, or None. One host sync."""
        flags = torch.stack([
            (mask.sum() == 0).float(),
            (~torch.isfinite(loss)).float(),
            (mean_ratio > self.config.ratio_threshold).float(),
        ])  # fmt: skip
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        no_actions, not_finite, ratio_high = flags.tolist()
        if no_actions:
            # Its masked means are 0 / 0: there is nothing to learn from, and no finite loss.
            return "it has no action tokens (every response in it is masked out or too short)"
        if not_finite:
            return "the loss is not finite"
        if ratio_high:
            return f"the mean ratio {mean_ratio.item():.2f} exceeds ratio_threshold={self.config.ratio_threshold}"
        return None

    def _skip(self, reason: str) -> None:
        self.skipped_minibatches += 1
        warnings.warn(f"Skipping a PPO mini-batch because {reason}; the weights are not updated for it.", stacklevel=3)

    def _gradients_finite(self) -> bool:
        """Clip the gradient norm (when ``max_grad_norm``) and tell whether every gradient is finite."""
        if self.is_deepspeed_enabled:
            # DeepSpeed owns the gradients: it clips and checks them inside its own step, which
            # accelerate's backward has already run, and skips the update when they are not finite.
            return self.model.was_step_applied()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.config.max_grad_norm is not None:
            total = self.accelerator.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            # Only finiteness is wanted: a sum is inf or NaN when any term is (it would overflow only
            # past 3e38), and it reads each gradient once, without the squares of a norm.
            sums = [p.grad.sum(dtype=torch.float32) for p in params if p.grad is not None]
            total = torch.stack(sums).sum() if sums else torch.zeros(())
        return bool(torch.isfinite(torch.as_tensor(total)).item())

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, entropy=None):
        """PPO losses of one mini-batch (PPO_SPEC section 6), with their statistics.

        Shapes: every per-token argument ``(b, L)``, logits ``(b, L, V)``. The entropy statistic
        comes from ``entropy`` ``(b, L)`` when given (logits may then be None), else from the logits.
        Returns the policy loss, the value loss and a dict of detached 0-d statistics.
        """
        if entropy is None:
            entropy = entropy_from_logits(logits.detach())
        pg_loss, pg_stats = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, self.config.cliprange)
        vf_loss, vf_stats = ppo_value_loss(vpreds, values, returns, mask, self.config.cliprange_value)
        with torch.no_grad():
            stats = {
                "loss/policy": pg_loss.detach(),
                "loss/value": vf_loss.detach(),
                "loss/total": (pg_loss + self.config.vf_coef * vf_loss).detach(),
                "policy/entropy": masked_mean(entropy, mask),
                "policy/approxkl": pg_stats["approxkl"],
                "policy/policykl": pg_stats["policykl"],
                "policy/clipfrac": pg_stats["clipfrac"],
                "policy/advantages_mean": masked_mean(advantages, mask),
                "policy/ratio": pg_stats["ratio"],
                "returns/mean": masked_mean(returns, mask),
                "returns/var": masked_var(returns, mask),
                "val/vpred": masked_mean(vpreds.detach(), mask),
                "val/error": masked_mean((vpreds.detach() - returns) ** 2, mask),
                "val/clipfrac": vf_stats["clipfrac"],
                "val/mean": masked_mean(values, mask),
                "val/var": masked_var(values, mask),
            }
        return pg_loss, vf_loss, stats

    # ------------------------------------------------------------------------------------------
    # Statistics
    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _step_stats(self, rows, scores, kls, logprobs, ref_logprobs, non_score_reward, advantages, kl_coef) -> dict:
        """The batch statistics of PPO_SPEC section 8 (this process), as tensors."""
        mask = rows.action_mask
        kl_per_row = (kls * mask).sum(-1)
        is_action = mask.bool()
        query_len, response_len = rows.query_len.float(), rows.response_len.float()
        return {
            "objective/kl": kl_per_row.mean(),
            "objective/kl_dist": kl_per_row,
            "objective/logprobs": logprobs[is_action],
            "objective/ref_logprobs": ref_logprobs[is_action],
            "objective/kl_coef": torch.tensor(kl_coef),
            "objective/entropy": (-logprobs * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(non_score_reward, mask),
            "ppo/mean_scores": scores.mean(),
            "ppo/std_scores": scores.std() if len(scores) > 1 else torch.tensor(0.0),
            "ppo/policy/advantages": advantages[is_action],
            "tokens/queries_len_mean": query_len.mean(),
            "tokens/queries_len_std": query_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/queries_dist": query_len,
            "tokens/responses_len_mean": response_len.mean(),
            "tokens/responses_len_std": response_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/responses_dist": response_len,
        }

    def _reduce_stats(self, stats: dict) -> dict:
        """Average scalar statistics over processes and concatenate the distributions; to numpy."""
        accelerator = self.accelerator
        device = self.current_device
        scalar_keys = [k for k in stats if k not in _DIST_STATS]
        scalars = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32, device=device) for k in scalar_keys])
        dists = {k: stats[k].float().flatten().to(device) for k in _DIST_STATS if k in stats}
        if accelerator.num_processes > 1:
            scalars = accelerator.reduce(scalars, reduction="mean")
            for key, value in dists.items():
                padded = accelerator.pad_across_processes(value, dim=0, pad_index=float("nan"))
                gathered = accelerator.gather(padded)
                dists[key] = gathered[~torch.isnan(gathered)]
        out = dict(zip(scalar_keys, scalars.cpu().tolist()))
        out.update(stats_to_np(dists))
        return out

    # ------------------------------------------------------------------------------------------
    # The classic public-ish helpers
    # ------------------------------------------------------------------------------------------
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

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks, full_kl=None):
        """KL-shaped rewards (PPO_SPEC section 4) for any per-token layout.

        Shapes: scores ``(B,)`` (or a list of B scalars), the rest ``(B, L)``.
        Returns rewards, non_score_reward and the per-token KL estimate, ``(B, L)`` each.
        """
        if isinstance(scores, (list, tuple)):
            scores = _scores_tensor(scores, logprobs.device)
        kls = kl_estimate(logprobs, ref_logprobs, self.config.kl_penalty, full_kl)
        rewards, non_score_reward = compute_kl_rewards(scores, kls, masks, self.kl_ctl.value)
        return rewards, non_score_reward, kls

    def compute_advantages(self, values, rewards, mask):
        """Masked values, whitened advantages and returns (PPO_SPEC section 5). Shapes ``(B, L)``."""
        return self._advantages(values, rewards, mask)

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns):
        """One optimisation step on precomputed new log-probs/values (classic signature).

        ``logprobs``, ``vpreds`` and ``logits`` must come from a forward pass with grad.
        Returns the mini-batch statistics.
        """
        self.model.train()
        pg_loss, vf_loss, stats = self.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)
        loss = pg_loss + self.config.vf_coef * vf_loss
        self.accelerator.backward(loss)
        if self.accelerator.sync_gradients:
            if self._gradients_finite():
                self.optimizer.step()
            else:
                self._skip("the gradients are not finite")
        self.optimizer.zero_grad()
        return stats

    # ------------------------------------------------------------------------------------------
    # Generation, logging, saving
    # ------------------------------------------------------------------------------------------
    @contextmanager
    def _generation_model(self, model):
        """The unwrapped model with full weights: under ZeRO-3 gathered once for the whole call."""
        unwrapped = self.accelerator.unwrap_model(model)
        if self._is_zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
                yield unwrapped
        else:
            yield unwrapped

    @torch.no_grad()
    def generate(
        self,
        query_tensor,
        length_sampler=None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        remove_padding: bool = True,
        **generation_kwargs,
    ):
        """Generate responses for one query (1-D tensor) or a list of them.

        A list is generated in chunks of ``batch_size`` with left padding and returned as a list of
        1-D tensors with padding (and anything after the first EOS) removed. ``length_sampler``
        draws ``max_new_tokens`` per call (per chunk for a list). With ``generate_ref_response``
        the reference model's responses are returned too.

        Under ZeRO-3 generation is collective: every process must call ``generate`` the same number
        of times, but the processes may pass different numbers of queries and lengths.
        """
        if isinstance(query_tensor, (list, tuple)):
            responses = self._generate_batched(
                self.model, query_tensor, length_sampler, batch_size, return_prompt, remove_padding, **generation_kwargs
            )
            if not generate_ref_response:
                return responses
            with self._reference() as ref:
                ref_responses = self._generate_batched(
                    ref, query_tensor, length_sampler, batch_size, return_prompt, remove_padding, **generation_kwargs
                )
            return responses, ref_responses
        if not isinstance(query_tensor, torch.Tensor) or query_tensor.dim() != 1:
            raise ValueError(
                "query_tensor must be a 1-D tensor of token ids or a list of them, got "
                f"{type(query_tensor).__name__}{tuple(query_tensor.shape) if isinstance(query_tensor, torch.Tensor) else ''}."
            )
        if length_sampler is not None:
            generation_kwargs["max_new_tokens"] = length_sampler()
        query = query_tensor.unsqueeze(0).to(self.current_device)
        with self._generation_model(self.model) as model:
            response = model.generate(input_ids=query, **generation_kwargs)
        if not return_prompt and not self.is_encoder_decoder:
            response = response[:, query.shape[1] :]
        if not generate_ref_response:
            return response
        with self._reference() as ref, self._generation_model(ref) as ref_model:
            ref_response = ref_model.generate(input_ids=query, **generation_kwargs)
        if not return_prompt and not self.is_encoder_decoder:
            ref_response = ref_response[:, query.shape[1] :]
        return response, ref_response

    def _generate_batched(self, model, queries, length_sampler, batch_size, return_prompt, remove_padding, **kwargs):
        """Generate for a list of queries in left-padded chunks; one 1-D tensor per query."""
        if self.tokenizer is None:
            raise ValueError("generate() with a list of queries needs the trainer's tokenizer (for padding); got None.")
        device = self.current_device
        eos = self.tokenizer.eos_token_id
        pad = self._pad_id
        kwargs.setdefault("pad_token_id", pad)
        outputs = []
        was_training = model.training
        model.eval()
        starts = range(0, len(queries), batch_size)
        with self._generation_model(model) as gen_model:
            for _ in range(self._missing_generate_calls(len(starts))):
                # Under ZeRO-3 every forward pass is a collective, so a process with fewer chunks
                # than another joins the extra calls with a one-row stand-in whose output is dropped.
                stand_in = (queries[0][:1] if len(queries) else torch.tensor([pad])).to(device).unsqueeze(0)
                gen_model.generate(input_ids=stand_in, attention_mask=torch.ones_like(stand_in), **kwargs)
            for start in starts:
                if length_sampler is not None:
                    kwargs["max_new_tokens"] = length_sampler()
                chunk = [q.to(device) for q in queries[start : start + batch_size]]
                input_ids = pad_sequence(chunk, batch_first=True, padding_value=pad, padding_side="left")
                lengths = torch.tensor([len(q) for q in chunk], device=device)
                attention_mask = (
                    torch.arange(input_ids.shape[1], device=device) >= (input_ids.shape[1] - lengths).unsqueeze(1)
                ).long()
                generations = gen_model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
                for row, generation in enumerate(generations):
                    if not self.is_encoder_decoder:
                        prompt_pad = input_ids.shape[1] - int(lengths[row])
                        generation = generation[prompt_pad:]
                        if not return_prompt:
                            generation = generation[int(lengths[row]) :]
                    if remove_padding and eos is not None:
                        eos_at = (generation == eos).nonzero()
                        if self.is_encoder_decoder:
                            eos_at = eos_at[eos_at > 0]
                        if len(eos_at):
                            generation = generation[: int(eos_at.flatten()[0]) + 1]
                    outputs.append(generation)
        if was_training:
            model.train()
        return outputs

    def _missing_generate_calls(self, calls: int) -> int:
        """How many fewer ``generate`` calls this process makes than the busiest one (0 unless ZeRO-3)."""
        if not self._is_zero3 or self.accelerator.num_processes == 1:
            return 0
        counts = self.accelerator.gather(torch.tensor([calls], device=self.current_device))
        return int(counts.max()) - calls

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send ``stats`` and reward statistics of this step to the accelerate trackers (main process)."""
        if self.config.log_with is None:
            return
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rewards]).to(self.current_device)
        rewards = self.accelerator.gather(rewards.reshape(-1))
        logs = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        logs["env/reward_mean"] = rewards.mean().item()
        logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
        if self.config.log_with != "tensorboard":
            logs.update({k: v for k, v in stats.items() if isinstance(v, np.ndarray)})
            logs["env/reward_dist"] = rewards.cpu().numpy()
            if self.config.log_with == "wandb" and all(c in batch for c in columns_to_log):
                import wandb

                rows = [[*(batch[c][i] for c in columns_to_log), rewards[i].item()] for i in range(len(batch[columns_to_log[0]]))]
                logs["game_log"] = wandb.Table(columns=[*columns_to_log, "reward"], rows=rows)
        self.accelerator.log(logs, step=self.current_step)

    def save_pretrained(self, save_directory: str) -> None:
        """Save the policy with its value head (full weights, also under ZeRO-3) and the tokenizer."""
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.accelerator.is_main_process:
            unwrapped = self.accelerator.unwrap_model(self.model)
            unwrapped.save_pretrained(save_directory, state_dict=state_dict)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(save_directory)
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------------------------------
    # Checkpoint and resume
    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Save everything a run needs to continue exactly: weights, optimizer, scheduler, KL
        controller, score moments, step counter, dataloader position and every process's RNG.

        The checkpoint is written to a sibling directory and renamed into place, so a run killed
        while saving leaves the previous checkpoint at ``path`` whole.
        """
        path = os.path.abspath(path)
        tmp = f"{path}.tmp"
        accelerator = self.accelerator
        if accelerator.is_main_process and os.path.exists(tmp):
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp, safe_serialization=True)
        # Every process writes its own files into tmp (RNG states, DeepSpeed shards): all must be
        # done before the main process renames tmp into place.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {
                "current_step": self.current_step,
                "skipped_minibatches": self.skipped_minibatches,
                "kl_ctl": self.kl_ctl.state_dict(),
                "running": self.running.state_dict(),
                "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
                "num_processes": accelerator.num_processes,
            }
            with open(os.path.join(tmp, _TRAINER_STATE), "w") as f:
                json.dump(state, f)
            old = f"{path}.old"
            if os.path.exists(path):
                if os.path.exists(old):
                    shutil.rmtree(old)
                os.rename(path, old)
            os.rename(tmp, path)
            if os.path.exists(old):
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` (same number of processes)."""
        path = os.path.abspath(path)
        if not os.path.exists(os.path.join(path, _TRAINER_STATE)) and os.path.exists(
            os.path.join(f"{path}.old", _TRAINER_STATE)
        ):
            # A save was killed between its two renames: the previous checkpoint is whole under .old.
            path = f"{path}.old"
        state_file = os.path.join(path, _TRAINER_STATE)
        if not os.path.exists(state_file):
            raise ValueError(f"path={path!r} is not a trl_lite checkpoint (no {_TRAINER_STATE} in it).")
        with open(state_file) as f:
            state = json.load(f)
        if state["num_processes"] != self.accelerator.num_processes:
            raise ValueError(
                f"the checkpoint at {path!r} was written by {state['num_processes']} processes; "
                f"this run has {self.accelerator.num_processes}. Resume with the same number of processes."
            )
        self.accelerator.load_state(path)
        self.current_step = state["current_step"]
        self.skipped_minibatches = state["skipped_minibatches"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running"])
        if self.dataloader is not None and state["dataloader"] is not None:
            self.dataloader.load_state_dict(state["dataloader"])

    # ------------------------------------------------------------------------------------------
    # Data
    # ------------------------------------------------------------------------------------------
    def _build_dataloader(self, dataset, data_collator) -> DataLoader:
        """Shuffled, ``batch_size`` rows, last incomplete batch dropped; seeded for exact resume."""
        if self.config.remove_unused_columns and hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
            unused = [c for c in dataset.column_names if c not in self._signature_columns]
            dataset = dataset.remove_columns(unused) if unused else dataset
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            collate_fn=data_collator,
            shuffle=True,
            drop_last=True,
            generator=self._data_generator,
        )

    def prepare_dataloader(self, dataset, data_collator=None) -> DataLoader:
        """A prepared dataloader over ``dataset`` with the trainer's batch size (classic helper)."""
        return self.accelerator.prepare(self._build_dataloader(dataset, data_collator))


_TRAIN_STAT_KEYS = (
    "loss/policy", "loss/value", "loss/total", "policy/entropy", "policy/approxkl", "policy/policykl",
    "policy/clipfrac", "policy/advantages_mean", "policy/ratio", "returns/mean", "returns/var",
    "val/vpred", "val/error", "val/clipfrac", "val/mean", "val/var",
)  # fmt: skip


def _signature_columns(model: PreTrainedModelWrapper) -> set[str]:
    """Dataset columns kept by ``remove_unused_columns``: the model's forward arguments plus the classic text columns."""
    return set(inspect.signature(model.transformers_model.forward).parameters) | {"label", "query", "response"}


def _check_constructor_args(config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers):
    if not isinstance(config, PPOConfig):
        raise TypeError(f"config must be a PPOConfig, got {type(config).__name__}.")
    config.validate()  # fields may have been changed after the config was built
    if not isinstance(model, SUPPORTED_MODELS):
        raise TypeError(
            "model must be an AutoModelForCausalLMWithValueHead or AutoModelForSeq2SeqLMWithValueHead "
            f"(wrap a transformers model with .from_pretrained(model)), got {type(model).__name__}."
        )
    if ref_model is not None and not isinstance(ref_model, SUPPORTED_MODELS):
        raise TypeError(f"ref_model must be None or a value-head model like model, got {type(ref_model).__name__}.")
    if ref_model is not None and ref_model is model:
        raise ValueError("ref_model is the same object as model; pass None to get a frozen copy.")
    if ref_model is not None and num_shared_layers is not None:
        raise ValueError("num_shared_layers only applies when the trainer creates the reference (ref_model=None).")
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer or None, got {type(tokenizer).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        raise TypeError(f"lr_scheduler must be a torch LR scheduler or None, got {type(lr_scheduler).__name__}.")


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


def _scores_tensor(scores, device) -> torch.Tensor:
    """A list of B scalars (numbers or 0-d tensors) as a float32 ``(B,)`` tensor on ``device``."""
    return torch.stack([torch.as_tensor(s, dtype=torch.float32).to(device).reshape(()) for s in scores])


def _pad_token_id(tokenizer, model_config) -> int:
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
