"""``GRPOTrainer``: TRL 1.x's GRPO trainer (constructor, ``train()``, ``evaluate()``, ``save_model()``, metrics) as
a loop over trl_lite's parts.

One generation of the loop: the next prompts (:class:`.prompts.PromptOrder`) -> completions on ``PPOTrainer``'s
engine and rewards (:class:`.rollout.GRPORollout`) -> ``PPOTrainer.step()``, which is the whole update of that
generation (``steps_per_generation / gradient_accumulation_steps * num_iterations`` optimizer steps) -> the
scheduler, transformers' callbacks (``on_step_end`` once per optimizer step, ``on_log``, ``on_evaluate``,
``on_save``), logs with TRL's metric names, checkpoints (:mod:`.checkpoints`). The ``PPOConfig`` the step runs is
made from the ``GRPOConfig`` in :mod:`.config_mapping` alone.

Why not a ``transformers.Trainer`` subclass: its loop is one forward/backward per batch of a dataloader, and each
of its parts (the dataloader, ``training_step``, ``compute_loss``, the optimizer step, gradient accumulation,
checkpointing) would be overridden by trl_lite's, since one ``step()`` is a whole PPO update with its own
mini-batches, accumulation, back-off and checkpoint. What transformers gives for a loop is used as it is:
``TrainingArguments`` (the config), ``TrainerState``/``TrainerControl``/``CallbackHandler`` and its default
callbacks (flow, progress bar, ``report_to`` integrations), ``get_scheduler``.
"""

from __future__ import annotations

import math
import warnings

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, get_scheduler
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_pt_utils import get_parameter_names
from transformers.trainer_utils import TrainOutput

from ...core import set_seed
from ..accelerate_setup import launched_processes
from ..ppo_trainer import PPOTrainer
from ..step_inputs import NoDatasetWarning
from .agents import AgentRollouts, environment_rows, with_environment_rewards
from .checkpoints import load_checkpoint, resolve_checkpoint, save_checkpoint
from .config_mapping import optimizer_steps_per_generation, to_ppo_config
from .grpo_config import GRPOConfig
from .prompts import PromptOrder
from .rewards import RewardFunctions, mean_logged_metrics
from .rollout import GRPORollout

# step() statistics reported under TRL's names (kl only with beta != 0, as TRL).
STEP_METRICS = {
    "entropy": "ppo/policy/entropy", "clip_ratio/low_mean": "ppo/policy/clipfrac_low",
    "clip_ratio/high_mean": "ppo/policy/clipfrac_high", "clip_ratio/region_mean": "ppo/policy/clipfrac",
    "loss": "ppo/loss/total",
}  # fmt: skip
# ... and those a step reports only with the engine's log-probs (use_vllm with the importance-sampling correction).
SAMPLING_METRICS = {
    "sampling/sampling_logp_difference/mean": "rollout/logprob_diff/mean",
    "sampling/sampling_logp_difference/max": "rollout/logprob_diff/max",
    "sampling/importance_sampling_ratio/mean": "rollout/is_weight/mean",
}  # fmt: skip


class GRPOTrainer:
    """TRL 1.x's ``GRPOTrainer``: ``GRPOTrainer(model, reward_funcs, args, train_dataset, ...).train()``.

    Args:
        model: a path or hub name (loaded with ``AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs)``)
            or a causal LM (a ``PeftModel`` of one included).
        reward_funcs: a callable ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``
            (sync or async), a sequence-classification model or its path, or a list of these.
        args: a :class:`GRPOConfig`; None: ``GRPOConfig(output_dir="<model name>-GRPO")``.
        train_dataset / eval_dataset: ``datasets.Dataset`` or ``IterableDataset`` with a ``prompt`` column
            (text, or a conversation of ``{"role", "content"}`` messages); other columns reach the reward functions.
        processing_class: the policy's tokenizer; None: loaded from the model's name or path.
        reward_processing_classes: tokenizers of the reward models (one, or one per reward function).
        callbacks: transformers ``TrainerCallback`` s, added to the default ones.
        optimizers: ``(optimizer, lr_scheduler)``; None: AdamW with ``args``' hyperparameters, ``get_scheduler``.
        peft_config: a PEFT config applied to the model (its reference is the model without the adapter).
        tools / environment_factory: TRL's: functions the model calls, and a factory (or ``{name: factory}``) of one
            environment per completion (``reset``, tool methods, optional ``get_reward``); :mod:`.agents`.
        quantization_config, rollout_func: TRL's; not supported (``ValueError`` when set).
    """

    # What RLOOTrainer (rloo_trainer.py) changes: its config, its mapping, where the KL metric comes from.
    config_class, algorithm = GRPOConfig, "GRPO"
    to_ppo_config = staticmethod(to_ppo_config)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):  # fmt: skip
        for name, value in (("quantization_config", quantization_config), ("rollout_func", rollout_func)):
            if value is not None:
                raise ValueError(f"{name} is not supported by trl_lite's GRPOTrainer, got {value!r}; pass None.")
        model_name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        if args is None:
            args = self.config_class(output_dir=f"{str(model_name).rstrip('/').split('/')[-1]}-{self.algorithm}")
        if not isinstance(args, self.config_class):
            raise TypeError(f"args must be a trl_lite {self.config_class.__name__}, got {type(args).__name__}.")
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}.")
        train_dataset = train_dataset if train_dataset is not None else environment_rows(environment_factory, args)
        self.args = args
        # As transformers' Trainer does first: what is drawn from here on (weights a model loaded by name lacks, the
        # adapter of peft_config) comes from args.seed, not from torch's default generator, seeded anew per process.
        set_seed(args.seed)
        model = self._load_model(model, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path, padding_side="left")
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        self.processing_class = processing_class
        agents, reward_weights = None, args.reward_weights
        if tools or environment_factory is not None:  # checked here, before any state changes
            agents = AgentRollouts(tools, environment_factory, args.max_tool_calling_iterations, processing_class,
                                   args.chat_template_kwargs)  # fmt: skip
            agents.check_dataset(train_dataset)
            reward_funcs, reward_weights, reward_processing_classes = with_environment_rewards(
                agents.reward_sources, reward_funcs, reward_weights, reward_processing_classes)
        if reward_funcs is None:
            raise ValueError("reward_funcs is required (a function, a model or a list of them) unless the environments "
                             "of environment_factory score completions with get_reward().")  # fmt: skip
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.reward_funcs = RewardFunctions(reward_funcs, reward_weights, reward_processing_classes,
                                            args.model_init_kwargs, args.chat_template_kwargs)  # fmt: skip
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.steps_per_generation = optimizer_steps_per_generation(args)
        num_processes = launched_processes()
        self.ppo_config = self.to_ppo_config(args, num_processes)
        optimizer, lr_scheduler = optimizers
        optimizer = optimizer or _adamw(model, args)
        with warnings.catch_warnings():  # step() gets the batches made here, not a dataset's
            warnings.simplefilter("ignore", NoDatasetWarning)
            self.ppo = PPOTrainer(self.ppo_config, model, tokenizer=processing_class, optimizer=optimizer)
        self.accelerator = self.ppo.accelerator
        self.prompts = PromptOrder(train_dataset, args.generation_batch_size // args.num_generations,
                                   self.accelerator.process_index, self.accelerator.num_processes, args.seed,
                                   shuffle=args.shuffle_dataset)  # fmt: skip
        self.max_steps = self._max_steps()
        self.lr_scheduler = lr_scheduler or get_scheduler(
            args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(self.max_steps),
            num_training_steps=self.max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )  # fmt: skip
        self.accelerator.register_for_checkpointing(self.lr_scheduler)  # saved and restored with the step's state
        self.reward_funcs.to(self.accelerator.device)
        self.rollout = GRPORollout(self.ppo, processing_class, self.reward_funcs, args.num_generations,
                                   args.max_completion_length, args.mask_truncated_completions,
                                   logprobs=self.ppo_config.importance_sampling_correction is not None,
                                   chat_template_kwargs=args.chat_template_kwargs, keep_table=args.log_completions,
                                   agents=agents, batch_scale=getattr(args, "scale_rewards", None) == "batch")  # fmt: skip
        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)  # fmt: skip
        self.control = TrainerControl()
        defaults = [DefaultFlowCallback] + get_reporting_integration_callbacks(args.report_to)
        defaults.append(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.callback_handler = CallbackHandler(defaults + list(callbacks or []), self.model, processing_class,
                                                optimizer, self.lr_scheduler)  # fmt: skip
        self._metrics: dict[str, list[float]] = {}
        self._pending_rows: list[torch.Tensor] = []  # each generation's metric rows, until _flush_metrics
        self._pending_logged: list[dict] = []  # each generation's log_metric sums of this process, likewise
        self._last_table: dict[str, list] = {}
        # As TRL's GRPOTrainer does once it is built: each process samples from a seed of its own (args.seed + its
        # index), so that the processes' completions are drawn apart, not from one stream of draws.
        set_seed(args.seed + self.accelerator.process_index)

    @staticmethod
    def _load_model(model, args: GRPOConfig):
        if isinstance(model, str):
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            return AutoModelForCausalLM.from_pretrained(model, **kwargs)
        if args.model_init_kwargs is not None:
            raise ValueError("model_init_kwargs applies when model is a path or name; the model was given loaded.")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a path, a hub name or a causal LM, got {type(model).__name__}.")
        return model

    def _max_steps(self) -> int:
        """``max_steps`` if > 0, else ``num_train_epochs`` passes over the prompts, in optimizer steps."""
        if self.args.max_steps > 0:
            return self.args.max_steps
        per_epoch = self.prompts.generations_per_epoch
        if per_epoch is None:
            raise ValueError("max_steps must be set (> 0) for an IterableDataset train_dataset: its length is unknown.")
        return math.ceil(self.args.num_train_epochs * per_epoch) * self.steps_per_generation

    # --- What TRL's trainer exposes -------------------------------------------------------------
    @property
    def model(self) -> PreTrainedModel:
        """The policy as the user gave it (a transformers model, or a ``PeftModel``), unwrapped."""
        return self.accelerator.unwrap_model(self.ppo.model).pretrained_model

    @property
    def optimizer(self):
        return self.ppo.optimizer

    @property
    def reward_func_names(self) -> list[str]:
        return self.reward_funcs.names

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    # --- The loop --------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train for ``max_steps`` optimizer steps (or ``num_train_epochs``), resuming from a checkpoint path, or
        from the newest one in ``output_dir`` with ``True``; a resumed run ends bit-identical to an uninterrupted one."""
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if checkpoint is not None:
            self._load(checkpoint)
        args, state = self.args, self.state
        state.max_steps, state.num_train_epochs = self.max_steps, args.num_train_epochs
        state.train_batch_size = args.per_device_train_batch_size
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name) or 0
            setattr(state, name, math.ceil(self.max_steps * value) if 0 < value < 1 else int(value) or 500)
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        losses = []
        while state.global_step < self.max_steps and not self.control.should_training_stop:
            self.control = self.callback_handler.on_step_begin(args, state, self.control)
            metrics = self._generation_step()
            losses.append(metrics.get("loss", 0.0))
            for name, value in metrics.items():
                self._metrics.setdefault(name, []).append(value)
            for _ in range(self.steps_per_generation):  # TRL's global_step counts optimizer steps
                self.lr_scheduler.step()
                state.global_step += 1
                state.epoch = self._epoch()
                self.control = self.callback_handler.on_step_end(args, state, self.control)
            if self.control.should_log or self.control.should_save or self.control.should_evaluate:
                self._flush_metrics()
            if self.control.should_log:
                self._log_window()
            if self.control.should_evaluate and self.eval_dataset is not None:
                self.evaluate()
            if self.control.should_save:
                save_checkpoint(self.ppo, state, self._loop_state(), args.output_dir, args.save_total_limit)
                self.control = self.callback_handler.on_save(args, state, self.control)
        self._flush_metrics()
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        train_loss = sum(losses) / len(losses) if losses else 0.0
        return TrainOutput(state.global_step, train_loss, {"train_loss": train_loss, "epoch": state.epoch})

    def _epoch(self) -> float:
        per_epoch = self.prompts.generations_per_epoch
        if per_epoch is None:
            return float(self.prompts.epoch)
        return self.prompts.epoch + self.prompts.index / (per_epoch * self.prompts.per_generation)

    def _step_metrics(self) -> dict[str, str]:
        """TRL's names of the step statistics; with one ratio per completion (GSPO, RLOO) the clip ratios are
        shares of the completions, as TRL's."""
        if self.ppo_config.importance_sampling_level == "token":
            return STEP_METRICS
        return {**STEP_METRICS, **{name: f"{key}_seq" for name, key in STEP_METRICS.items() if name.startswith("clip")}}

    def _generation_step(self) -> dict[str, float]:
        """One generation and its update: TRL's metrics of it."""
        generation = self.rollout.run(self.prompts.next_rows(), trainer_state=self.state)
        self._pending_rows.append(generation.metric_rows)
        self._pending_logged.append(generation.reward_metrics)
        metrics = {}
        self._last_table = generation.table
        if generation.has_actions:  # else every completion is out of the loss: nothing to train on (no step)
            stats = self.ppo.step(generation.queries, generation.responses, generation.scores,
                                  response_masks=generation.response_masks,
                                  generation_logprobs=generation.generation_logprobs, group_ids=generation.group_ids,
                                  kept_sets=generation.kept_sets)  # fmt: skip
            for name, key in self._step_metrics().items():
                metrics[name] = float(stats[key])
            metrics.update({name: float(stats[key]) for name, key in SAMPLING_METRICS.items() if key in stats})
            if self.args.beta != 0.0:
                metrics["kl"] = self._kl(stats)
        return metrics

    def _kl(self, stats: dict) -> float:
        """TRL's ``kl``: the token mean of the k3 estimate the loss used (whatever ``loss_type``)."""
        return float(stats["ppo/policy/kl"])

    def _flush_metrics(self) -> None:
        """The generation metrics of the generations since the last flush (and ``num_input_tokens_seen``): made
        only where they are read (a log, a checkpoint, an evaluation, the end), in one gather over processes."""
        if not self._pending_rows:
            return
        logged = self._logged_metrics(self._pending_logged)
        for metrics, by_functions in zip(self.rollout.metrics(self._pending_rows, self.args.num_generations), logged):
            self.state.num_input_tokens_seen += int(metrics.pop("_tokens"))
            metrics["num_tokens"] = float(self.state.num_input_tokens_seen)
            for name, value in {**metrics, **by_functions}.items():
                self._metrics.setdefault(name, []).append(value)
        self._pending_rows, self._pending_logged = [], []

    def _logged_metrics(self, pending: list[dict]) -> list[dict[str, float]]:
        """What the reward functions logged with ``log_metric`` in each pending generation, averaged over every
        process's values (TRL's rule); on several processes one object gather for all of them."""
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return [mean_logged_metrics([sums]) for sums in pending]
        from accelerate.utils import gather_object

        per_process = gather_object([pending])  # one list of generations per process
        return [mean_logged_metrics([generations[g] for generations in per_process]) for g in range(len(pending))]

    def _log_window(self) -> None:
        """Log the means of the metrics since the last log (TRL's window), the learning rate and the epoch."""
        logs = {name: sum(values) / len(values) for name, values in self._metrics.items() if name != "num_tokens"}
        if "num_tokens" in self._metrics:
            logs["num_tokens"] = self._metrics["num_tokens"][-1]
        logs["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
        self._metrics = {}
        self.log(logs)
        if self.args.log_completions and self.accelerator.is_main_process:
            self._print_completions()

    def log(self, logs: dict[str, float]) -> None:
        """transformers' ``Trainer.log``: add the epoch, append to ``state.log_history``, call ``on_log``."""
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _print_completions(self) -> None:
        from tqdm.auto import tqdm

        table = self._last_table
        rows = len(table.get("prompt", []))
        shown = rows if self.args.num_completions_to_print is None else min(rows, self.args.num_completions_to_print)
        for i in range(shown):
            tqdm.write(" | ".join(f"{key}: {values[i] if i < len(values) else None!r}" for key, values in table.items()))

    # --- Evaluation and saving -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Generate ``num_generations_eval`` (default ``num_generations``) completions for every prompt of the
        evaluation set (in order, ``per_device_eval_batch_size`` prompts per generation) and report TRL's reward
        and completion metrics as ``eval_<name>``, averaged over the batches; no weight changes."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: pass one to the trainer or to evaluate().")
        k = self.args.num_generations_eval or self.args.num_generations
        rows = list(dataset)
        share = rows[self.accelerator.process_index :: self.accelerator.num_processes]
        size = self.args.per_device_eval_batch_size
        sums: dict[str, list[float]] = {}
        for start in range(0, len(share), size):
            generation = self.rollout.run(share[start : start + size], num_generations=k, trainer_state=self.state)
            (metrics,) = self.rollout.metrics([generation.metric_rows], k)
            (by_functions,) = self._logged_metrics([generation.reward_metrics])
            metrics.pop("_tokens")
            for name, value in {**metrics, **by_functions}.items():
                sums.setdefault(name, []).append(value)
        results = {f"{metric_key_prefix}_{name}": sum(v) / len(v) for name, v in sums.items()}
        self.log(results)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=results)
        return results

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy (as the plain or PEFT model given) and the tokenizer; every process must call this."""
        self.ppo.save_pretrained(output_dir or self.args.output_dir)

    def _loop_state(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "metrics": self._metrics}

    def _load(self, checkpoint: str) -> None:
        state, loop = load_checkpoint(self.ppo, checkpoint)
        state.is_local_process_zero = self.accelerator.is_local_main_process
        state.is_world_process_zero = self.accelerator.is_main_process
        self.state = state
        self.prompts.load_state_dict(loop["prompts"])
        self._metrics = {name: list(values) for name, values in loop["metrics"].items()}


def _adamw(model, args: GRPOConfig) -> torch.optim.AdamW:
    """transformers' default optimizer: AdamW, weight decay on every trainable weight but biases and norms."""
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], ["bias", "layernorm", "rmsnorm", "norm"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)  # fmt: skip

