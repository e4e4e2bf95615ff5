"""``PPOTrainer``: the classic ``step(queries, responses, scores)`` PPO trainer on accelerate.

The trainer is a facade over parts, each built here from explicit inputs:

- :class:`~.oom_backoff.MemoryBackoff` and :class:`~trl_lite.parallel.SequenceParallel` (a no-op without it) -
  the run's token budget and sequence-parallel group, handed to the parts that use them;
- :class:`~.forward.ForwardPass` - rows, mini-batch inputs and the models' passes;
- :class:`~.experience_maker.ExperienceMaker` - ``make(batch) -> Experience``: score shaping, the
  passes without grad, KL-shaped rewards, advantages (docs/algorithm.md sections 1-5, 12, 14, 15);
- :class:`~.learner.Learner` - ``train(experience) -> stats``: the PPO epochs (sections 6, 9-11, 13);
- :class:`~.statistics.StepStatistics` - the statistics, reduced over processes, and their logging;
- :class:`~.checkpointing.Checkpointer` - atomic checkpoints for exact resume;
- :class:`~trl_lite.engines.generation.RolloutGeneration` - ``generate`` on the configured engine.

``step()`` reads: check the inputs, make the experience, train on it, reduce the statistics, update
the KL controller. The classic helpers (``batched_forward_pass``, ``compute_rewards``, ``loss``, ...)
are a thin mixin over the parts (:mod:`.classic_helpers`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from dataclasses import asdict

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .. import core
from ..core import flatten_dict
from ..engines.generation import build_generation
from ..models import PreTrainedModelWrapper, as_value_model, create_reference_model
from ..models.dropout import disable_dropout_in_model
from ..models.reference import reference_context
from ..parallel import fsdp
from ..parallel.sequence_parallel import SequenceParallel, configure_deepspeed, preparing_again
from .accelerate_setup import (
    build_accelerator,
    default_optimizer,
    fill_deepspeed_config,
    full_state_dict,
    prepare_deepspeed_reference,
    save_full_model,
)
from .classic.helpers import ClassicHelpersMixin
from .memory.cpu_memory import set_cpu_malloc
from .memory.oom_backoff import MemoryBackoff, empty_device_cache
from .ppo_config import PPOConfig
from .state.checkpointing import Checkpointer
from .state.ema import PolicyEMA
from .state.kl_controllers import AdaptiveKLController, FixedKLController, update_kl_controller
from .state.resumable_loader import ResumableLoader
from .state.running_moments import RunningMoments
from .step.experience import StepBatch
from .step.experience_maker import ExperienceMaker
from .step.forward import ForwardPass
from .step.learner import Learner
from .step.objective import PolicyObjective
from .step.rollout_plan import RolloutPlan
from .step.statistics import StepStatistics, resolve_stop_token_ids
from .step.timing import PhaseTimer
from .step_inputs import (
    check_constructor_args,
    check_critic_args,
    choose_packing,
    kept_sets_of,
    resolve_group_ids,
    staleness,
    unscored_allowed,
    validate_generation_logprobs,
    validate_ptx_inputs,
    validate_step_inputs,
    warn_without_dataset,
    wrap_plain_model,
)

# Where save_pretrained(save_value_model=True) writes the critic, inside the policy's directory.
VALUE_MODEL_SUBFOLDER = "value_model"


class PPOTrainer(ClassicHelpersMixin):
    """PPO for language models with the classic API: the user generates and scores, ``step()`` trains.

    Args:
        config: the run's :class:`PPOConfig`.
        model: the policy, an ``AutoModelForCausalLMWithValueHead`` or ``AutoModelForSeq2SeqLMWithValueHead``;
            with a critic-free ``advantage_estimator`` also a plain transformers LM (or ``PeftModel`` of one),
            which ``save_pretrained`` writes back as a plain model. Whenever the estimator needs no values,
            the policy's value head is frozen and never run.
        ref_model: the frozen reference (a value-head model or a plain LM); made with
            :func:`create_reference_model` when None, or, for a PEFT model, the same model with its adapter disabled.
            With ``init_kl_coef=0`` none is made or run, unless ``compute_reference_kl`` (:class:`~.rollout_plan.RolloutPlan`).
        tokenizer: used for padding side and pad id, ``generate`` and ``save_pretrained``.
        dataset: optional ``torch`` or ``datasets`` dataset; gives ``trainer.dataloader``.
        optimizer: default ``Adam`` over the trainable parameters at ``config.learning_rate``.
        data_collator: collate function of the dataloader.
        num_shared_layers: layers shared between policy and the created reference.
        lr_scheduler: stepped once per ``step()``.
        value_model: a separate critic (docs/algorithm.md section 9): a decoder-only transformers
            ``AutoModelForSequenceClassification`` with ``num_labels=1`` (e.g. a reward model), a PEFT
            model of one, or a :class:`~trl_lite.models.ValueModel`; it then gives the values and is trained by the
            value loss alone; the policy (maybe a plain causal LM) trains on the policy loss; its value head is frozen, not run.
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
        # The trainer works on its own copy: the values it derives (world size, global batch sizes, ...)
        # are filled in there, and the config the user passed stays as it was.
        config = copy.deepcopy(config) if isinstance(config, PPOConfig) else (PPOConfig() if config is None else config)
        check_constructor_args(
            config, model, ref_model, tokenizer, optimizer, lr_scheduler, num_shared_layers, value_model
        )
        check_critic_args(config, model, value_model, critic_optimizer)
        model_config = getattr(getattr(model, "pretrained_model", model), "config", None)
        self._eos_ids = resolve_stop_token_ids(config.stop_token_id, tokenizer, model_config)
        self._check_eos_penalty(config)
        self.critic = as_value_model(value_model) if value_model is not None else None
        # A plain LM gets a value-head wrapper for logits_positions and the fused LM head; its head never runs.
        model, self._policy_is_plain = wrap_plain_model(model)
        ref_model, _ = wrap_plain_model(ref_model) if ref_model is not None else (None, False)
        # Decided before any state changes: padding_free=True with a model that cannot pack raises here.
        self._pack = choose_packing(config, model, ref_model, self.critic)
        core.set_seed(config.seed)
        self.config = config
        self.rollout_plan = self.plan_rollout(config)
        if not self._uses_value_head:
            # No gradient, optimizer state or DDP bucket for a head that never runs.
            model.v_head.requires_grad_(False)
        self.accelerator = build_accelerator(config)
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        self.is_encoder_decoder = config.is_encoder_decoder = model.is_encoder_decoder
        self.is_peft_model = config.is_peft_model = model.is_peft_model
        self.tokenizer = tokenizer
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.critic is not None:
                self.critic.gradient_checkpointing_enable()
        if ref_model is None and not self.is_peft_model and self.rollout_plan.reference:
            ref_model = create_reference_model(model, num_shared_layers=num_shared_layers)
        self.ref_model = ref_model  # None: a PEFT policy's reference is itself without its adapter, or none runs
        if config.disable_dropout:
            disable_dropout_in_model(model, ref_model, self.critic)
        set_cpu_malloc(config, self.accelerator)  # glibc's malloc on CPU (memory/cpu_memory.py)
        self.optimizer = optimizer or default_optimizer(model, config.learning_rate)
        self.lr_scheduler = lr_scheduler
        self.data_collator = data_collator
        self.dataset = dataset
        self._signature_columns = _signature_columns(model)
        self._data_generator = torch.Generator().manual_seed(config.seed)
        dataloader = self._build_dataloader(dataset, data_collator) if dataset is not None else None
        if dataset is None:
            warn_without_dataset(config.batch_size)
        self._prepare(model, dataloader, lr_scheduler, critic_optimizer)
        self.current_device = self.accelerator.device
        self._phase_timer = PhaseTimer(self.current_device)
        self.kl_ctl = (
            AdaptiveKLController(config.init_kl_coef, config.target, config.horizon)
            if config.adap_kl_ctrl
            else FixedKLController(config.init_kl_coef)
        )
        self.running = RunningMoments(self.accelerator)
        self.current_step = 0
        self._build_parts()
        if config.log_with is not None:
            self.accelerator.init_trackers(
                config.tracker_project_name,
                config={k: v for k, v in flatten_dict(asdict(config)).items() if isinstance(v, (int, float, str, bool))},
                init_kwargs=config.tracker_kwargs,
            )

    def _prepare(self, model, dataloader, lr_scheduler, critic_optimizer) -> None:
        """``accelerator.prepare`` the policy, optimizer, dataloader and scheduler, then the critic (a second
        call: under DeepSpeed an engine of its own) and the reference (evaluation mode)."""
        accelerator, config = self.accelerator, self.config
        self.is_deepspeed_enabled = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        self._is_zero3 = self.is_deepspeed_enabled and accelerator.state.deepspeed_plugin.zero_stage == 3
        if self.is_deepspeed_enabled:
            configure_deepspeed(accelerator, model, self.critic)
            fill_deepspeed_config(accelerator, config)
        self.cpu_sharding = fsdp.cpu_sharding(accelerator)  # FSDP2 without GPUs: models sharded by trl_lite
        preparer = self.cpu_sharding or accelerator
        to_prepare = [model, self.optimizer] + ([dataloader] if dataloader is not None else [])
        to_prepare += [lr_scheduler] if lr_scheduler is not None else []
        prepared = list(preparer.prepare(*to_prepare))
        self.model, self.optimizer = prepared[0], prepared[1]
        self.dataloader = ResumableLoader(prepared[2], self._data_generator) if dataloader is not None else None
        if lr_scheduler is not None:
            self.lr_scheduler = prepared[-1]
        self.critic_optimizer = None
        if self.critic is not None:
            learning_rate = config.critic_learning_rate or config.learning_rate
            optimizer = critic_optimizer or default_optimizer(self.critic, learning_rate)
            with preparing_again(accelerator):
                self.critic, self.critic_optimizer = preparer.prepare(self.critic, optimizer)
        if self.ref_model is not None:
            if self.is_deepspeed_enabled:
                self.ref_model = prepare_deepspeed_reference(self.ref_model, accelerator)
            else:
                self.ref_model = preparer.prepare_model(self.ref_model, evaluation_mode=True)
        self.is_fsdp = fsdp.keep_roots_gathered(self.model, self.critic, self.ref_model)  # the fused head runs after

    def _build_parts(self) -> None:
        """The parts ``step()`` calls, each from explicit inputs (see the module docstring)."""
        config, accelerator = self.config, self.accelerator
        self.sequence = SequenceParallel.from_accelerator(accelerator)  # a no-op part without sequence parallelism
        # The run's one back-off, shared by the rollouts, the learner and the checkpoints. Forwards that gather
        # parameters (ZeRO-3) or exchange attention inputs (sequence parallelism) cannot be redone alone.
        self.memory = MemoryBackoff(accelerator, config.max_tokens_per_minibatch, config.oom_backoff,
                                    collective_forwards=self._is_zero3 or self.is_fsdp or self.sequence.cuts)  # fmt: skip
        self.forward = ForwardPass.build(accelerator, self.model, self.ref_model, self.critic, self.tokenizer, config,
                                         self._pack, self.memory, self.sequence)  # fmt: skip
        unwrapped = self.forward.unwrapped(self.model)
        self._vocab_size = unwrapped.pretrained_model.get_input_embeddings().num_embeddings
        self._reference = fsdp.resharding(functools.partial(reference_context, self.ref_model, self.model, unwrapped))
        self._ema = PolicyEMA(unwrapped, config.ema_decay) if config.ema_decay is not None else None
        self.experience_maker = ExperienceMaker(
            config, accelerator, self.forward, self.model, self._reference, self.critic, self.kl_ctl, self.running,
            self._eos_ids, self._uses_value_head, self.rollout_plan, sequence=self.sequence,
        )  # fmt: skip
        self.learner = Learner(
            config, accelerator, self.forward, self.model, self.optimizer, PolicyObjective.from_config(config),
            self.critic, self.critic_optimizer, self._ema, self._uses_value_head, memory=self.memory,
            sequence=self.sequence,
        )  # fmt: skip
        self.statistics = StepStatistics(config, accelerator, self.sequence)
        self.checkpointer = Checkpointer(accelerator, {"memory": self.memory}, self.cpu_sharding)
        self.generation = build_generation(
            config, model=self.model, unwrapped=unwrapped, accelerator=accelerator, tokenizer=self.tokenizer,
            pad_token_id=self.forward.layout.pad_id, is_encoder_decoder=self.is_encoder_decoder,
            is_zero3=self._is_zero3, reference_context=self._reference, optimizer=self.optimizer,
            timer=self._phase_timer, sequence=self.sequence,
        )  # fmt: skip

    plan_rollout = staticmethod(RolloutPlan.from_config)  # the passes without grad, decided once (see rollout_plan)
    @property
    def _uses_value_head(self) -> bool:
        """Whether the policy's value head runs and trains: only for GAE, never on a plain LM, and not
        when a separate critic gives the values."""
        return not self.config.critic_free and not self._policy_is_plain and self.critic is None

    @property
    def skipped_minibatches(self) -> int:
        """Mini-batches skipped by the learner's guards since the run began (see ``ppo/skipped_minibatches``)."""
        return self.learner.skipped_minibatches

    def _check_eos_penalty(self, config) -> None:
        if config.missing_eos_penalty is not None and not self._eos_ids:
            raise ValueError(
                f"missing_eos_penalty={config.missing_eos_penalty} needs an EOS token id, but stop_token_id is None and "
                "neither the tokenizer nor the model config has an eos_token_id; set stop_token_id."
            )

    # --- The PPO step ----------------------------------------------------------------------------
    def step(
        self,
        queries: list[torch.LongTensor],
        responses: list[torch.LongTensor],
        scores: list[torch.FloatTensor],
        response_masks: list[torch.Tensor] | None = None,
        group_ids: list[int] | torch.Tensor | None = None,
        ptx_inputs: list[torch.LongTensor] | None = None,
        generation_logprobs: list[torch.Tensor] | None = None,
        policy_version: int | list[int] | None = None,
        kept_sets: list | None = None,
    ) -> dict:
        """Run one PPO step on ``batch_size`` (query, response, score) triplets of this process.

        ``response_masks``: per row 0/1 like the response (0: a token the model did not generate, e.g.
        a tool's output; it is no action). ``group_ids`` (``'rloo'``/``'grpo'``): one id per row, rows of
        a group answer one query; default: consecutive runs of ``num_samples_per_query`` rows
        (docs/algorithm.md section 12). ``ptx_inputs`` (with ``config.ptx_coef > 0``): ``batch_size``
        token sequences whose language-modelling loss joins the policy's loss (section 10); row ``i``
        goes into the mini-batches of triplet ``i``. ``generation_logprobs``: per row, a 1-D float
        tensor with the log-prob of each response token under the engine that sampled it
        (``generate(..., return_logprobs=True)``); the step then reports the gap to the policy (``rollout/logprob_diff``)
        and, with ``importance_sampling_correction="tis"``, weights the policy loss (section 15). ``policy_version``: the
        ``current_step`` whose weights generated the batch (one int, or one per row): ``rollout/staleness`` (section 17).
        ``kept_sets`` (truncated sampling, section 23): per row its sampler's kept sets or None; default: those the
        engine recorded for the responses it generated since the last step, found by their tokens.
        Returns the statistics of section 8 (floats and 1-D numpy arrays); critic-free estimators
        report no value statistics.
        """
        batch = self._check_step_inputs(queries, responses, scores, response_masks, group_ids, ptx_inputs,
                                        generation_logprobs, policy_version, kept_sets)  # fmt: skip
        config = self.config
        clock = self.experience_maker.clock
        t0 = clock.mark()
        experience = self.experience_maker.make(batch)
        t = clock.mark()
        train_stats, forward_logprobs = self.learner.train(experience)
        if forward_logprobs is not None:  # lp_old came from the training forwards (no policy pass)
            experience = self.experience_maker.complete(experience, forward_logprobs)
        spans = {**experience.timings, "time/ppo/optimize_step": (t, clock.mark())}
        t = clock.mark()
        stats = self.statistics.step_stats(experience, train_stats)
        spans["time/ppo/calc_stats"] = (t, clock.mark())
        stats["ppo/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        stats["prefix_sharing/tokens_saved_fraction"] = self.forward.prefix.take_saving(self.accelerator)

        # Section 7: the KL controller and the scheduler
        if self.rollout_plan.reference:  # else the coefficient is 0 and stays 0, and the KL is not measured
            update_kl_controller(self.kl_ctl, stats["objective/kl"], self.statistics.global_rows)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1
        if config.optimize_device_cache:
            empty_device_cache()
        spans["time/ppo/total"] = (t0, clock.mark())
        stats.update(clock.seconds(spans))
        stats.update(self._phase_timer.pop())
        return stats

    def _check_step_inputs(self, queries, responses, scores, response_masks, group_ids, ptx_inputs,
                           generation_logprobs, policy_version, kept_sets=None) -> StepBatch:  # fmt: skip
        """Every check of ``step()``'s arguments, before any state changes; the batch they make."""
        config = self.config
        actions = validate_step_inputs(
            queries, responses, scores, response_masks, unscored_allowed(config),
            batch_size=config.batch_size, vocab_size=self._vocab_size, is_encoder_decoder=self.is_encoder_decoder,
        )  # fmt: skip
        groups = resolve_group_ids(group_ids, queries, config)  # dense ids on the host
        validate_ptx_inputs(ptx_inputs, config, self.is_encoder_decoder, self._vocab_size)
        validate_generation_logprobs(generation_logprobs, responses)
        self._check_eos_penalty(config)  # the field may have been set on trainer.config since
        return StepBatch(
            queries, responses, scores, response_masks, groups, generation_logprobs, ptx_inputs,
            staleness(policy_version, self.current_step, config.batch_size),
            num_groups=int(groups.max()) + 1 if groups is not None else None, actions=actions,
            kept_sets=kept_sets_of(kept_sets, queries, responses, self.is_encoder_decoder, self.generation.records),
        )  # fmt: skip

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
        transformers). With ``return_logprobs=True`` (a list only) the last returned element is one 1-D float tensor
        per row: each generated token's log-prob under ``PPOConfig``'s distribution (``log pi_T^K`` when it truncates),
        for ``step(..., generation_logprobs=...)``. Sampling follows ``PPOConfig`` (the model's ``generation_config``
        overridden with a warning); a differing kwarg samples as given on transformers, as classic TRL did, warned once
        (docs/truncated_sampling.md: scoring, and the kept sets recorded for ``step()``); ``use_vllm`` refuses it.

        The transformers engine (default) generates in chunks of ``batch_size`` queries and draws
        ``length_sampler`` once per chunk; under ZeRO-3 generation is collective (every process calls
        ``generate`` equally often; query counts and lengths may differ). The vLLM engine
        (``use_vllm=True``) sends all queries at once, draws ``length_sampler`` once per query, maps the
        generation kwargs to vLLM's sampling parameters and refuses any it cannot map (see
        :func:`~trl_lite.engines.sampling_params`); after the policy changed, it first receives
        the new weights (``time/rollout/weight_sync``; a collective under ZeRO-3).

        The call's wall-clock time counts in ``time/rollout/generate`` of the next ``step()``'s statistics.
        """
        if generate_ref_response and self.ref_model is None and not self.is_peft_model:
            raise ValueError("generate_ref_response=True needs a reference model, but with init_kl_coef=0 none was "
                             "made: pass ref_model=... or set PPOConfig.compute_reference_kl=True.")  # fmt: skip
        return self.generation.generate(
            query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
            return_logprobs, classic=True, **generation_kwargs,
        )  # fmt: skip

    def timed(self, phase: str):
        """Time a phase of your loop: ``with trainer.timed("rollout/reward"): scores = reward_fn(...)``.

        The seconds (summed if the phase runs several times) appear as ``time/<phase>`` in the
        statistics of the next ``step()``, next to ``time/rollout/generate`` (every ``generate`` call
        since the last step) and ``time/ppo/*``, so ``log_stats`` logs them too. On CUDA the device
        is synchronised at both ends of the phase.
        """
        return self._phase_timer(phase)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send ``stats`` and reward statistics of this step to the accelerate trackers (main process).

        With ``config.log_completions_every = N``, every N-th step also logs a table of ``columns_to_log``
        of ``batch`` (one entry per row) and the rewards, with the rows of every process, as ``game_log``
        (see :meth:`.statistics.StepStatistics.log`). Every process must call this when any does.
        """
        self.statistics.log(self.current_step, stats, batch, rewards, columns_to_log)

    # --- Saving, checkpoint and resume -----------------------------------------------------------
    @property
    def ema_model(self):
        """The policy's moving average as a model (float32), for generation and evaluation.

        Under ZeRO-3 the average is kept partitioned: save it with ``save_pretrained(dir, ema=True)``
        and load that directory in a process without DeepSpeed.
        """
        if self._ema is None:
            raise ValueError("ema_model needs PPOConfig.ema_decay (the policy's moving average is not kept).")
        if self._ema.model is None:
            raise ValueError(
                "Under DeepSpeed ZeRO-3 the policy's EMA is kept partitioned over the processes; "
                "use save_pretrained(dir, ema=True) to write it whole."
            )
        return self._ema.model

    def save_pretrained(self, save_directory: str, ema: bool = False, save_value_model: bool = False) -> None:
        """Save the policy (full weights, also under ZeRO-3) and the tokenizer: with its value head, or as
        the plain transformers (or PEFT) model the user passed.

        ``ema=True`` writes the policy's moving average (``config.ema_decay``) instead of its weights;
        ``save_value_model=True`` also writes the separate critic to ``save_directory/value_model``.
        Every process must call this.
        """
        if ema and self._ema is None:
            raise ValueError("save_pretrained(ema=True) needs an EMA of the policy: set PPOConfig.ema_decay.")
        if save_value_model and self.critic is None:
            raise ValueError("save_pretrained(save_value_model=True) needs a separate critic: pass value_model.")
        # Under ZeRO-3 both gathers are collectives, and DeepSpeed returns the consolidated state dict
        # on the main process only (None elsewhere): each runs exactly once on every process.
        state_dict = full_state_dict(self.accelerator, self.model)
        if ema:
            state_dict = self._ema.averaged_state_dict(state_dict)
        accelerator, tokenizer = self.accelerator, self.tokenizer
        save_full_model(accelerator, self.model, tokenizer, save_directory, state_dict, plain=self._policy_is_plain)
        if save_value_model:
            save_full_model(accelerator, self.critic, tokenizer, os.path.join(save_directory, VALUE_MODEL_SUBFOLDER))

    def save_checkpoint(self, path: str) -> None:
        """Save everything a run needs to continue exactly: what accelerate holds (weights, optimizers,
        scheduler, every process's RNG), the KL controller, score moments, step counter, dataloader
        position and the policy's EMA. Written atomically (see :class:`.checkpointing.Checkpointer`);
        every process must call this."""
        state = {
            "current_step": self.current_step,
            "skipped_minibatches": self.learner.skipped_minibatches,
            "kl_ctl": self.kl_ctl.state_dict(),
            "running": self.running.state_dict(),
            "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
        }
        self.checkpointer.save(path, state, self._ema.state_dict() if self._ema is not None else {})

    def load_checkpoint(self, path: str) -> None:
        """Continue from a checkpoint written by :meth:`save_checkpoint` (same number of processes)."""
        state, tensors = self.checkpointer.load(path)
        self.current_step = state["current_step"]
        self.learner.skipped_minibatches = state["skipped_minibatches"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running"])
        self.generation.weights_changed()
        if self.dataloader is not None and state["dataloader"] is not None:
            self.dataloader.load_state_dict(state["dataloader"])
        if self._ema is not None:
            self._ema.load_state_dict(tensors)

    # --- Data ------------------------------------------------------------------------------------
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


def _signature_columns(model: PreTrainedModelWrapper) -> set[str]:
    """Dataset columns kept by ``remove_unused_columns``: the model's forward arguments plus the classic text columns."""
    return set(inspect.signature(model.transformers_model.forward).parameters) | {"label", "query", "response"}

