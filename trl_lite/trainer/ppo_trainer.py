"""``PPOTrainer``: the classic ``step(queries, responses, scores)`` PPO trainer on accelerate.

``step()`` reads top-down like ``PPO_SPEC.md``: validate, shape the scores, forward passes,
rewards, advantages, epochs, statistics, controller update. The math lives in
:mod:`trl_lite.core`; this module runs the epochs and talks to the other processes. What the
trainer uses lives beside it: the rows, compact layout and forward passes in :mod:`.rollout`,
the PPO epochs and losses in :mod:`.optimization`, the statistics and their logging in
:mod:`.statistics`, the separate critic, PTX, EMA and save_pretrained in :mod:`.actor_critic`,
generation in :mod:`.generation`, checkpoints in :mod:`.checkpointing`, input checks in
:mod:`.step_inputs`, process and device set-up in :mod:`.accelerate_setup`, the dataloader's
resumable position in :mod:`.resumable_loader`.
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
from dataclasses import asdict

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .. import core
from ..core import (
    compute_gae,
    masked_mean,
    compute_kl_rewards,
    discounted_returns,
    flatten_dict,
    grpo_advantages,
    kl_estimate,
    masked_whiten,
    rloo_advantages,
    sequence_to_tokens,
)
from ..models import (
    PreTrainedModelWrapper,
    as_value_model,
    create_reference_model,
)
from .accelerate_setup import (
    build_accelerator,
    default_optimizer,
    empty_device_cache,
    fill_deepspeed_config,
    prepare_deepspeed_reference,
)
from .actor_critic import ActorCriticMixin
from .checkpointing import CheckpointMixin
from .classic_helpers import ClassicHelpersMixin
from .cpu_memory import keep_freed_cpu_memory
from .ema import PolicyEMA
from .generation import build_generation
from .kl_controllers import AdaptiveKLController, FixedKLController
from .objective import PolicyObjective
from .optimization import OptimizationMixin
from .ppo_config import PPOConfig
from .resumable_loader import ResumableLoader
from .rollout import RolloutMixin, packing_unsupported
from .running_moments import RunningMoments
from .statistics import StatisticsMixin, resolve_stop_token_ids
from .step_inputs import (
    check_constructor_args,
    check_critic_args,
    resolve_group_ids,
    scores_tensor,
    validate_generation_logprobs,
    validate_step_inputs,
    wrap_plain_model,
)
from .timing import PhaseTimer

class PPOTrainer(
    RolloutMixin, OptimizationMixin, StatisticsMixin, CheckpointMixin, ClassicHelpersMixin,
    ActorCriticMixin,
):
    """PPO for language models with the classic API: the user generates and scores, ``step()`` trains.

    Args:
        config: the run's :class:`PPOConfig`.
        model: the policy, an ``AutoModelForCausalLMWithValueHead`` or ``AutoModelForSeq2SeqLMWithValueHead``;
            with a critic-free ``advantage_estimator`` also a plain transformers LM (or ``PeftModel`` of one),
            which ``save_pretrained`` writes back as a plain model. Whenever the estimator needs no values,
            the policy's value head is frozen and never run.
        ref_model: the frozen reference (a value-head model or a plain LM); made with
            :func:`create_reference_model` when None, or, for a PEFT model, the same model with its adapter disabled.
        tokenizer: used for padding side and pad id, ``generate`` and ``save_pretrained``.
        dataset: optional ``torch`` or ``datasets`` dataset; gives ``trainer.dataloader``.
        optimizer: default ``Adam`` over the trainable parameters at ``config.learning_rate``.
        data_collator: collate function of the dataloader.
        num_shared_layers: layers shared between policy and the created reference.
        lr_scheduler: stepped once per ``step()``.
        value_model: a separate critic (PPO_SPEC section 9): a decoder-only transformers
            ``AutoModelForSequenceClassification`` with ``num_labels=1`` (e.g. a reward model), a PEFT
            model of one, or a :class:`~trl_lite.models.ValueModel`; it then gives the values and is
            trained by the value loss alone; the policy (which may be a plain causal LM) trains on the
            policy loss, and a value head it has is frozen and not run.
        critic_optimizer: the critic's optimizer; default ``Adam`` at ``config.critic_learning_rate``.
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
        value_model=None,
        critic_optimizer: torch.optim.Optimizer | None = None,
    ):
        config = PPOConfig() if config is None else config
        check_constructor_args(
            config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers, value_model
        )
        check_critic_args(config, model, value_model, critic_optimizer)
        model_config = getattr(getattr(model, "pretrained_model", model), "config", None)
        if config.missing_eos_penalty is not None and not resolve_stop_token_ids(config.stop_token_id, tokenizer, model_config):
            raise ValueError(
                f"missing_eos_penalty={config.missing_eos_penalty} needs an EOS token id, but stop_token_id is None and "
                "neither the tokenizer nor the model config has an eos_token_id; set stop_token_id."
            )
        self.critic = as_value_model(value_model) if value_model is not None else None
        # A plain LM gets a value-head wrapper for logits_positions and the fused LM head; its head never runs.
        model, self._policy_is_plain = wrap_plain_model(model)
        ref_model, _ = wrap_plain_model(ref_model) if ref_model is not None else (None, False)
        # Decided before any state changes: padding_free=True with a model that cannot pack raises here.
        self._pack = _choose_packing(config, model, ref_model, self.critic)
        core.set_seed(config.seed)
        self.config = config
        if not self._uses_value_head:
            # No gradient, optimizer state or DDP bucket for a head that never runs.
            model.v_head.requires_grad_(False)
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
            if self.critic is not None:
                self.critic.gradient_checkpointing_enable()

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
        if dataset is None:
            warnings.warn(
                f"PPOTrainer got no dataset: step() expects batches of config.batch_size={config.batch_size} rows "
                "per process; make sure that is the number of queries you pass to each step().",
                UserWarning,
                stacklevel=2,
            )

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
        self._prepare_critic(critic_optimizer)
        if self.ref_model is not None:
            if self.is_deepspeed_enabled:
                self.ref_model = prepare_deepspeed_reference(self.ref_model, self.accelerator)
            else:
                self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)

        self.current_device = self.accelerator.device
        self._phase_timer = PhaseTimer(self.current_device)
        self.kl_ctl = (
            AdaptiveKLController(config.init_kl_coef, config.target, config.horizon)
            if config.adap_kl_ctrl
            else FixedKLController(config.init_kl_coef)
        )
        self.running = RunningMoments(self.accelerator)
        self._objective = PolicyObjective.from_config(config)
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
        self._find_row_attention_models([self.model, self.ref_model, self.critic])
        self._ema = PolicyEMA(unwrapped, config.ema_decay) if config.ema_decay is not None else None
        self.generation = build_generation(
            config, model=self.model, unwrapped=unwrapped, accelerator=self.accelerator, tokenizer=tokenizer,
            pad_token_id=self._pad_id, is_encoder_decoder=self.is_encoder_decoder, is_zero3=self._is_zero3,
            reference_context=self._reference, optimizer=self.optimizer, timer=self._phase_timer,
        )  # fmt: skip

        if config.log_with is not None:
            self.accelerator.init_trackers(
                config.tracker_project_name,
                config={k: v for k, v in flatten_dict(asdict(config)).items() if isinstance(v, (int, float, str, bool))},
                init_kwargs=config.tracker_kwargs,
            )

    @property
    def _uses_value_head(self) -> bool:
        """Whether the policy's value head runs and trains: only for GAE, never on a plain LM, and not
        when a separate critic gives the values."""
        return not self.config.critic_free and not self._policy_is_plain and self.critic is None

    # ------------------------------------------------------------------------------------------
    # The PPO step
    # ------------------------------------------------------------------------------------------
    def step(
        self,
        queries: list[torch.LongTensor],
        responses: list[torch.LongTensor],
        scores: list[torch.FloatTensor],
        response_masks: list[torch.Tensor] | None = None,
        group_ids: list[int] | torch.Tensor | None = None,
        ptx_inputs: list[torch.LongTensor] | None = None,
        generation_logprobs: list[torch.Tensor] | None = None,
    ) -> dict:
        """Run one PPO step on ``batch_size`` (query, response, score) triplets of this process.

        ``group_ids`` (``'rloo'``/``'grpo'``): one id per row, rows of a group answer one query;
        default: consecutive runs of ``num_samples_per_query`` rows (PPO_SPEC section 12).
        ``ptx_inputs`` (with ``config.ptx_coef > 0``): ``batch_size`` token sequences whose
        language-modelling loss joins the policy's loss (PPO_SPEC section 10); row ``i`` goes into
        the mini-batches of triplet ``i``.
        ``generation_logprobs``: per row, a 1-D float tensor with the log-prob of each response token
        under the engine that sampled it (``generate(..., return_logprobs=True)``); the step then reports
        the gap to the policy (``rollout/logprob_diff/mean|max``) and, with
        ``importance_sampling_correction="tis"``, weights the policy loss (PPO_SPEC section 15).
        Returns the statistics of PPO_SPEC section 8 (floats and 1-D numpy arrays); critic-free
        estimators report no value statistics.
        """
        validate_step_inputs(
            queries, responses, scores, response_masks,
            batch_size=self.config.batch_size, vocab_size=self._vocab_size, is_encoder_decoder=self.is_encoder_decoder,
        )  # fmt: skip
        groups = resolve_group_ids(group_ids, queries, self.config)
        self._check_ptx_inputs(ptx_inputs)
        validate_generation_logprobs(generation_logprobs, responses)
        config = self.config
        timing = {}
        t0 = time.time()

        # 1. Score shaping: the rollout's penalties (section 14), then scaling and clipping (section 2)
        scores = scores_tensor(scores, self.current_device)
        lengths = torch.tensor([len(r) for r in responses], device=self.current_device)
        ends_with_eos = self._ends_with_eos(responses)
        scores = core.shape_scores(
            scores, lengths, ends_with_eos, config.missing_eos_penalty, config.max_response_length,
            config.overlong_buffer_len, config.overlong_penalty_factor,
        )  # fmt: skip
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
        gap_stats, token_weights = self._generation_gap(rows, logprobs, generation_logprobs)
        timing["time/ppo/forward_pass"] = time.time() - t

        # 3. KL-shaped rewards (section 4); with kl_in_reward=False the KL goes to the loss (section 12)
        t = time.time()
        kl_coef = self.kl_ctl.value
        kls = kl_estimate(logprobs, ref_logprobs, config.kl_penalty, full_kl)
        reward_kl_coef = kl_coef if config.kl_in_reward_resolved else 0.0
        rewards, non_score_reward = compute_kl_rewards(scores, kls, mask, reward_kl_coef)
        timing["time/ppo/compute_rewards"] = time.time() - t

        # 4. Advantages (section 5, or section 12 for critic-free estimators)
        t = time.time()
        if config.critic_free:
            advantages = self._critic_free_advantages(scores, rewards, non_score_reward, mask, groups)
            values = returns = None
        else:
            values, advantages, returns = self._advantages(values, rewards, mask)
        timing["time/ppo/compute_advantages"] = time.time() - t

        # 5. PPO epochs (section 6)
        t = time.time()
        kl_loss_ref = None if config.kl_in_reward_resolved else ref_logprobs
        ptx = self._ptx_rows(ptx_inputs) if ptx_inputs is not None else None
        with self._per_row_attention():  # over the backward passes too: gradient checkpointing recomputes
            train_stats = self._optimize(
                rows, logprobs, values, advantages, returns, kl_loss_ref, kl_coef, ptx, token_weights
            )
        timing["time/ppo/optimize_step"] = time.time() - t

        # 6. Statistics (section 8)
        t = time.time()
        stats = self._step_stats(rows, scores, kls, logprobs, ref_logprobs, non_score_reward, advantages, kl_coef)
        stats.update(self._rollout_stats(lengths, ends_with_eos, scores, groups))
        stats.update(train_stats)
        stats.update(gap_stats)
        if not config.critic_free:
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
        stats.update(self._phase_timer.pop())
        return stats

    def generate(
        self,
        query_tensor,
        length_sampler=None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        remove_padding: bool = True,
        return_logprobs: bool = False,
        **generation_kwargs,
    ):
        """Generate responses for one query (1-D tensor) or a list of them, on the configured engine.

        A list gives a list of 1-D tensors with padding (and anything after the first EOS) removed.
        With ``num_return_sequences=k`` (a generation kwarg) each query gets k responses, next to each
        other: entries ``i*k .. i*k+k-1`` answer query ``i``, the layout ``step()`` expects for
        ``num_samples_per_query=k``. One query gives the ``(k, S)`` output of ``generate``.
        With ``generate_ref_response`` the reference model's responses are returned too (always by
        transformers). With ``return_logprobs=True`` (a list only) the last returned element is one
        1-D float tensor per row: the log-probability of each generated token (prompt excluded) under
        the generating model's raw logits (temperature 1), ready for ``step(..., generation_logprobs=...)``.

        The transformers engine (default) generates in chunks of ``batch_size`` queries and draws
        ``length_sampler`` once per chunk; under ZeRO-3 generation is collective (every process calls
        ``generate`` equally often; query counts and lengths may differ). The vLLM engine
        (``use_vllm=True``) sends all queries at once, draws ``length_sampler`` once per query, maps the
        generation kwargs to vLLM's sampling parameters and refuses any it cannot map (see
        :func:`~trl_lite.trainer.engines.sampling_params`); after the policy changed, it first receives
        the new weights (``time/rollout/weight_sync``; a collective under ZeRO-3).

        The call's wall-clock time counts in ``time/rollout/generate`` of the next ``step()``'s statistics.
        """
        return self.generation.generate(
            query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
            return_logprobs, **generation_kwargs,
        )  # fmt: skip

    def _trim_generations(self, generations, prompt_width, lengths, return_prompt, remove_padding) -> list:
        """The transformers engine's trimming of a left-padded ``generate`` output (see :func:`.engines.trim_rows`)."""
        return self.generation.reference_engine.trim(generations, prompt_width, lengths, return_prompt, remove_padding)

    def timed(self, phase: str):
        """Time a phase of your loop: ``with trainer.timed("rollout/reward"): scores = reward_fn(...)``.

        The seconds (summed if the phase runs several times) appear as ``time/<phase>`` in the
        statistics of the next ``step()``, next to ``time/rollout/generate`` (every ``generate`` call
        since the last step) and ``time/ppo/*``, so ``log_stats`` logs them too. On CUDA the device
        is synchronised at both ends of the phase.
        """
        return self._phase_timer(phase)

    # ------------------------------------------------------------------------------------------
    # Advantages
    # ------------------------------------------------------------------------------------------
    def _advantages(self, values, rewards, mask):
        """Masked values, whitened GAE advantages and returns (PPO_SPEC section 5). Shapes ``(B, L)``."""
        if self.config.whiten_rewards:
            rewards = self._whiten(rewards, mask, shift_mean=False)
        advantages, returns = compute_gae(values, rewards, mask, self.config.gamma, self.config.lam)
        advantages = self._whiten(advantages, mask)
        return values * mask, advantages.detach(), returns.detach()

    def _critic_free_advantages(self, scores, rewards, non_score_reward, mask, groups):
        """Advantages ``(B, L)`` of the critic-free estimators (PPO_SPEC section 12).

        ``scores (B,)`` after shaping; ``rewards``, ``non_score_reward`` ``(B, L)`` (the latter zero
        when the KL is in the loss); ``groups (B,)`` group ids for 'rloo'/'grpo'.
        """
        config = self.config
        if config.advantage_estimator == "reinforce_pp":
            if config.whiten_rewards:
                rewards = self._whiten(rewards, mask, shift_mean=False)
            return (self._whiten(discounted_returns(rewards, mask, config.gamma), mask) * mask).detach()
        sequence_rewards = scores + non_score_reward.sum(-1)
        groups = groups.to(sequence_rewards.device)
        if config.advantage_estimator == "rloo":
            sequence_advantages = rloo_advantages(sequence_rewards, groups)
        else:
            sequence_advantages = grpo_advantages(sequence_rewards, groups, config.grpo_scale_rewards)
        return sequence_to_tokens(sequence_advantages, mask).detach()

    @torch.no_grad()
    def _generation_gap(self, rows, logprobs, generation_logprobs) -> tuple[dict, torch.Tensor | None]:
        """The log-prob gap to the generating engine and the TIS weights (PPO_SPEC section 15).

        ``logprobs`` ``(B, L)``: ``lp_old`` of the rollout pass; ``generation_logprobs``: per row one
        log-prob per response token, or None (then no statistic and no weights). Returns the
        ``rollout/*`` statistics and, with ``importance_sampling_correction="tis"``, the weights
        ``min(exp(lp_old - lp_gen), cap)`` ``(B, L)`` (else None).
        """
        config = self.config
        if generation_logprobs is None:
            return {}, None
        device, width = logprobs.device, logprobs.shape[1]
        padded = torch.nn.utils.rnn.pad_sequence(
            [lp.to(device=device, dtype=logprobs.dtype) for lp in generation_logprobs], batch_first=True
        )
        # Compact column k predicts response token k (decoder token k + 1 for encoder-decoders).
        shift = 1 if self.is_encoder_decoder else 0
        gen = torch.nn.functional.pad(padded[:, shift:], (0, max(width - padded.shape[1] + shift, 0)))[:, :width]
        mask = rows.action_mask
        gap = (logprobs - gen).abs() * mask
        stats = {
            "rollout/logprob_diff/mean": masked_mean(gap, mask),
            "rollout/logprob_diff/max": gap.max(),
        }
        if config.importance_sampling_correction != "tis":
            return stats, None
        weights = torch.exp(logprobs - gen).clamp(max=config.importance_sampling_cap) * mask
        stats["rollout/is_weight/mean"] = masked_mean(weights, mask)
        return stats, weights

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
    # Checkpoint and resume (the mechanism is in .checkpointing)
    # ------------------------------------------------------------------------------------------
    def _checkpoint_state(self) -> dict:
        """The trainer's counters that accelerate's state does not hold (JSON-serialisable)."""
        return {
            "current_step": self.current_step,
            "skipped_minibatches": self.skipped_minibatches,
            "kl_ctl": self.kl_ctl.state_dict(),
            "running": self.running.state_dict(),
            "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
        }

    def _checkpoint_tensors(self) -> dict:
        return self._ema.state_dict() if self._ema is not None else {}

    def _load_checkpoint_tensors(self, tensors: dict) -> None:
        if self._ema is not None:
            self._ema.load_state_dict(tensors)

    def _load_checkpoint_state(self, state: dict) -> None:
        self.current_step = state["current_step"]
        self.skipped_minibatches = state["skipped_minibatches"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running"])
        self.generation.weights_changed()
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


def _choose_packing(config: PPOConfig, model, ref_model, critic) -> bool:
    """Whether ``step()`` packs mini-batches (``config.padding_free``): every model of its passes must support it.

    A reference made by the trainer copies ``model``; for a PEFT model it is ``model`` itself. The
    separate critic takes the policy's inputs, so it must pack too.
    """
    if config.padding_free is False:
        return False
    for name, wrapper in (("model", model), ("ref_model", ref_model), ("value_model", critic)):
        reason = packing_unsupported(wrapper) if wrapper is not None else None
        if reason is not None:
            if config.padding_free:
                raise ValueError(f"padding_free=True, but {name} cannot take packed rows: {reason}. Use padding_free=None or False.")
            return False
    return True


def _signature_columns(model: PreTrainedModelWrapper) -> set[str]:
    """Dataset columns kept by ``remove_unused_columns``: the model's forward arguments plus the classic text columns."""
    return set(inspect.signature(model.transformers_model.forward).parameters) | {"label", "query", "response"}


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
