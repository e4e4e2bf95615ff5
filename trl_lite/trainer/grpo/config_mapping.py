"""The one place where a TRL 1.x ``GRPOConfig`` becomes trl_lite: which fields are honoured, which are refused,
TRL's derived batch sizes, and the ``PPOConfig`` the trainer runs (docs/migrating_from_trl.md has the table).

Every ``GRPOConfig`` field (``TrainingArguments``' own included) is in :data:`HONOURED` or refused: a refused field
at its default is harmless (it is TRL's default behaviour, or a feature that is off), set to anything else it
raises ``ValueError`` naming it. Honoured fields whose values trl_lite supports only in part are checked by value.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
from transformers.trainer_pt_utils import AcceleratorConfig

from ..ppo_config import PPOConfig

# TrainingArguments' fields the loop honours (the rest, at a non-default value, are refused).
TRAINING_ARGUMENTS_HONOURED = frozenset({
    "output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "gradient_accumulation_steps", "max_grad_norm", "bf16", "fp16", "gradient_checkpointing",
    "logging_strategy", "logging_steps", "logging_first_step", "disable_tqdm", "report_to", "run_name",
    "save_strategy", "save_steps", "save_total_limit", "seed", "eval_strategy", "eval_steps",
    "per_device_eval_batch_size", "do_train", "do_eval", "do_predict", "resume_from_checkpoint", "local_rank",
    "use_cpu", "remove_unused_columns",
})  # fmt: skip
# GRPOConfig's own fields the loop honours.
GRPO_HONOURED = frozenset({
    "model_init_kwargs", "trust_remote_code", "disable_dropout", "num_generations", "num_generations_eval",
    "max_completion_length", "shuffle_dataset", "generation_batch_size", "steps_per_generation", "temperature",
    "top_p", "top_k", "min_p", "chat_template_kwargs", "repetition_penalty", "use_vllm", "vllm_mode",
    "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "beta", "num_iterations",
    "epsilon", "delta", "epsilon_high", "importance_sampling_level", "reward_weights", "scale_rewards", "loss_type",
    "mask_truncated_completions", "entropy_coef", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap",
    "log_completions", "log_multimodal", "num_completions_to_print", "max_tool_calling_iterations",
})  # fmt: skip
HONOURED = TRAINING_ARGUMENTS_HONOURED | GRPO_HONOURED

# Honoured fields with a restricted set of values: field -> accepted values.
ACCEPTED_VALUES = {
    "loss_type": ("dapo", "grpo", "dr_grpo", "bnpo"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "importance_sampling_level": ("token", "sequence"),
    "optim": ("adamw_torch", "adamw_torch_fused"),
    "logging_strategy": ("steps", "no"),
    "save_strategy": ("steps", "no"),
    "eval_strategy": ("no", "steps"),
    "remove_unused_columns": (False,),
}


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_OFF = object()


def _plain(value):
    """A value as given, with what ``TrainingArguments.__post_init__`` and ``HfArgumentParser`` make of it undone
    (strategy enums, ``debug``'s list, the default ``AcceleratorConfig``; "off" spelt None, "", False, "no" or
    an empty list), so that a default compares equal to itself however it was written."""
    if isinstance(value, AcceleratorConfig) and value == AcceleratorConfig():
        return _OFF
    value = getattr(value, "value", value)
    if value is None or value is False or (isinstance(value, (str, list, dict)) and value in ("", "no", [], {})):
        return _OFF
    return value


def refused_fields(args, honoured=HONOURED) -> list[str]:
    """The fields of ``args`` not in ``honoured`` that differ from their defaults, in field order."""
    refused = []
    for f in dataclasses.fields(args):
        if f.name in honoured or not f.init:
            continue
        default = _default(f)
        if default is not dataclasses.MISSING and _plain(getattr(args, f.name)) != _plain(default):
            refused.append(f.name)
    return refused


def check_grpo_config(args) -> None:
    """Refuse what trl_lite cannot honour, then derive TRL's sizes (``generation_batch_size``,
    ``steps_per_generation``) and resolve ``bf16``/``scale_rewards`` as TRL does. ``ValueError`` naming the field."""
    refused = refused_fields(args)
    if refused:
        values = ", ".join(f"{name}={getattr(args, name)!r}" for name in refused)
        raise ValueError(f"trl_lite's GRPOTrainer does not support {values}: leave {'it' if len(refused) == 1 else 'them'} "
                         "at TRL's default (docs/migrating_from_trl.md lists every field).")  # fmt: skip
    check_common(args)
    args.scale_rewards = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
    if args.vllm_importance_sampling_cap is not None:
        warnings.warn("vllm_importance_sampling_cap is deprecated: use vllm_importance_sampling_clip_max.", FutureWarning,
                      stacklevel=4)  # fmt: skip
        args.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_cap
    if args.use_vllm and args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode != "token_truncate":
        raise ValueError(
            f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} is not supported by trl_lite: with "
            "use_vllm, set vllm_importance_sampling_mode='token_truncate' (per-token weights min(ratio, "
            "vllm_importance_sampling_clip_max), trl_lite's TIS) or vllm_importance_sampling_correction=False."
        )
    if args.delta is not None and not args.delta > 1.0 + (args.epsilon_high if args.epsilon_high is not None else args.epsilon):
        raise ValueError(f"delta must be None or > 1 + epsilon_high (two-sided GRPO's bound above the clip), got {args.delta}.")


def check_common(args) -> None:
    """What GRPO and RLOO check alike (``ValueError`` naming the field): the values of :data:`ACCEPTED_VALUES`
    among ``args``' fields, the group and completion sizes; then ``bf16`` as TRL resolves it and TRL's sizes."""
    for name, accepted in ACCEPTED_VALUES.items():
        if hasattr(args, name) and getattr(getattr(args, name), "value", getattr(args, name)) not in accepted:
            raise ValueError(f"{name}={getattr(args, name)!r} is not supported by trl_lite's {type(args).__name__[:-6]}"
                             f"Trainer; accepted: {accepted}.")  # fmt: skip
    if args.bf16 is None:  # TRL: on unless fp16; here only where the device has bf16 (TRL's default fails on a CPU)
        args.bf16 = not args.fp16 and not args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if args.num_generations is None or args.num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2 (GRPO's group), got {args.num_generations!r}.")
    if args.max_completion_length is None or args.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be an int >= 1, got {args.max_completion_length!r}.")
    _derive_batch_sizes(args, int(os.environ.get("WORLD_SIZE", "1")))


def _derive_batch_sizes(args, num_processes: int) -> None:
    """TRL's ``generation_batch_size``/``steps_per_generation`` rule, plus trl_lite's: whole groups on each
    process, and a generation that is a whole number of optimizer steps."""
    per_step = args.per_device_train_batch_size * num_processes
    if args.generation_batch_size is None and args.steps_per_generation is None:
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = per_step * args.steps_per_generation
    elif args.generation_batch_size is not None and args.steps_per_generation is None:
        if args.generation_batch_size % per_step != 0:
            raise ValueError(f"generation_batch_size ({args.generation_batch_size}) must be divisible by the global "
                             f"batch size ({per_step}).")  # fmt: skip
        args.steps_per_generation = args.generation_batch_size // per_step
    elif args.generation_batch_size is None:
        args.generation_batch_size = per_step * args.steps_per_generation
    else:
        raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time")
    per_process = args.generation_batch_size // num_processes
    if per_process % args.num_generations != 0:
        raise ValueError(
            f"generation_batch_size / processes = {per_process} completions per process must be a multiple of "
            f"num_generations ({args.num_generations}): trl_lite keeps each prompt's group on one process."
        )
    if args.steps_per_generation % args.gradient_accumulation_steps != 0:
        raise ValueError(
            f"steps_per_generation ({args.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
            f"({args.gradient_accumulation_steps}): trl_lite's update takes whole optimizer steps from one generation."
        )


def optimizer_steps_per_generation(args) -> int:
    """Optimizer steps one ``PPOTrainer.step()`` call makes: TRL's ``global_step`` advances by this much."""
    return args.steps_per_generation // args.gradient_accumulation_steps * args.num_iterations


def vllm_server_url(args) -> str:
    return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def to_ppo_config(args, num_processes: int) -> PPOConfig:
    """The ``PPOConfig`` of a (checked) ``GRPOConfig``: the whole mapping, field by field."""
    mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    accelerator_kwargs = {"mixed_precision": mixed_precision, **({"cpu": True} if args.use_cpu else {})}
    tis = args.use_vllm and args.vllm_importance_sampling_correction
    return PPOConfig(
        exp_name=args.run_name or "grpo", seed=args.seed, log_with=None, remove_unused_columns=False,
        accelerator_kwargs=accelerator_kwargs,
        # sizes: one step() call is one generation batch of this process
        batch_size=args.generation_batch_size // num_processes, mini_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, ppo_epochs=args.num_iterations,
        learning_rate=args.learning_rate, max_grad_norm=args.max_grad_norm or None,
        # GRPO's advantages and loss
        advantage_estimator="grpo", num_samples_per_query=args.num_generations,
        grpo_scale_rewards=args.scale_rewards != "none", grpo_std_eps=1e-4,
        grpo_std_scope="batch" if args.scale_rewards == "batch" else "group", kl_in_reward=False,
        init_kl_coef=args.beta,
        adap_kl_ctrl=False, cliprange=args.epsilon, cliprange_high=args.epsilon_high, dual_clip=args.delta,
        importance_sampling_level=args.importance_sampling_level, loss_type=args.loss_type,
        max_response_length=args.max_completion_length, entropy_coef=args.entropy_coef,
        entropy_token_mean=True,  # TRL's bonus: the micro-batch's mean entropy whatever loss_type
        seq_mean_all_rows=True,  # TRL's 'grpo' mean over completions counts masked ones as 0
        ratio_threshold=1e30,  # TRL skips no mini-batch (PPOConfig takes a finite number)
        # sampling
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty,
        # engine
        use_vllm=args.use_vllm, vllm_mode=args.vllm_mode, vllm_server_url=vllm_server_url(args),
        vllm_server_timeout=args.vllm_server_timeout, vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_max_model_len=args.vllm_max_model_length, vllm_tensor_parallel_size=args.vllm_tensor_parallel_size,
        vllm_enable_sleep_mode=args.vllm_enable_sleep_mode,
        importance_sampling_correction="tis" if tis else None,
        importance_sampling_cap=args.vllm_importance_sampling_clip_max if tis else 2.0,
        # memory
        gradient_checkpointing=args.gradient_checkpointing, disable_dropout=args.disable_dropout,
    )  # fmt: skip
