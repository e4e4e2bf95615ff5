"""``RLOOConfig``: TRL 1.x's RLOO configuration, and the one place where it becomes trl_lite (docs/migrating_from_trl.md,
"RLOOTrainer").

TRL's ``RLOOConfig`` holds a subset of ``GRPOConfig``'s fields (same names and meanings; ``num_generations=2``
and ``beta=0.05`` by default instead of 8 and 0) plus ``normalize_advantages`` and ``reward_clip_range``; it has
none of GRPO's loss variants (``loss_type``, ``scale_rewards``, ``delta``, ``importance_sampling_level``, the
vLLM importance-sampling correction). So the class is made from ``GRPOConfig``'s own field definitions, by name
(:data:`RLOO_FIELDS`), and an RLOO run is a GRPO run with fixed GRPO settings (:data:`AS_GRPO`) whose
``PPOConfig`` then takes RLOO's estimator and KL (:func:`to_ppo_config`):

- advantages: ``advantage_estimator="rloo"``, ``A_i = rho_i - mean_{j != i} rho_j`` over the group's
  ``rho = reward - beta * sum_t (lp_old - lp_ref)`` (TRL: the KL in the reward, the k1 estimate summed per
  completion; ``kl_in_reward=True, kl_penalty="kl"``);
- loss: TRL's: one clipped ratio per completion, ``exp`` of its summed log-ratio
  (``importance_sampling_level="sequence_sum"``), ``-min(s_i A_i, clip(s_i) A_i)`` averaged over the
  micro-batch's completions (``loss_type="grpo"``, the row mean of a per-row constant);
- ``normalize_advantages=True`` is refused (trl_lite's group estimators do not whiten); ``reward_clip_range``
  only as ``(-c, c)`` (``score_clip=c``).
"""

import dataclasses
import types
from typing import Any  # noqa: F401  (GRPOConfig's field types are strings naming it, resolved here)

from transformers import TrainingArguments

from . import config_mapping
from .grpo_config import GRPOConfig

# TRL 1.x RLOOConfig's own fields, in its order (TrainingArguments' come first, as in TRL).
RLOO_FIELDS = (
    "learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "lr_scheduler_kwargs", "use_liger_kernel",
    "torch_empty_cache_steps", "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "disable_dropout",
    "remove_unused_columns", "num_generations", "num_generations_eval", "max_completion_length",
    "ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size",
    "steps_per_generation", "temperature", "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
    "repetition_penalty", "cache_implementation", "use_vllm", "vllm_mode", "vllm_model_impl",
    "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "beta", "num_iterations", "epsilon", "epsilon_high",
    "reward_weights", "normalize_advantages", "reward_clip_range", "mask_truncated_completions", "sync_ref_model",
    "ref_model_mixup_alpha", "ref_model_sync_steps", "log_completions", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "use_transformers_paged",
)  # fmt: skip
# RLOO's defaults where they differ from GRPO's, and its fields GRPO lacks: (type, default, help).
RLOO_OWN = {
    "num_generations": (int | None, 2, "Completions per prompt (the group, >= 2 for the leave-one-out baseline)."),
    "beta": (float, 0.05, "KL coefficient, in the reward: reward - beta * sum_t (lp_old - lp_ref); 0: no reference."),
    "normalize_advantages": (bool, False, "Normalise the generation's advantages; only False is supported."),
    "reward_clip_range": (tuple[float, float] | None, None, "Clip rewards to (min, max); only (-c, c) is supported."),
}
# The GRPO settings of an RLOO run (TRL's RLOO has none of these fields).
AS_GRPO = {
    "loss_type": "grpo", "scale_rewards": "none", "delta": None, "importance_sampling_level": "sequence_sum",
    "entropy_coef": 0.0, "vllm_importance_sampling_correction": False, "vllm_importance_sampling_cap": None,
}  # fmt: skip
HONOURED = (config_mapping.HONOURED & set(RLOO_FIELDS)) | {"normalize_advantages", "reward_clip_range"} | (
    config_mapping.TRAINING_ARGUMENTS_HONOURED
)


def _field(name: str) -> tuple:
    if name in RLOO_OWN:
        kind, default, text = RLOO_OWN[name]
        return name, kind, dataclasses.field(default=default, metadata={"help": text})
    f = GRPOConfig.__dataclass_fields__[name]
    default = {"default": f.default} if f.default is not dataclasses.MISSING else {"default_factory": f.default_factory}
    return name, f.type, dataclasses.field(**default, metadata=f.metadata)


def check_rloo_config(args) -> None:
    """Refuse what trl_lite cannot honour (``ValueError`` naming the field), then GRPO's checks and TRL's sizes."""
    refused = config_mapping.refused_fields(args, HONOURED)
    if args.normalize_advantages:
        refused.append("normalize_advantages")
    clip = args.reward_clip_range
    if clip is not None and not _symmetric(clip):
        raise ValueError(f"reward_clip_range={clip!r} is not supported by trl_lite's RLOOTrainer: only a symmetric "
                         "range (-c, c) with c > 0 (PPOConfig.score_clip), or None.")  # fmt: skip
    if refused:
        values = ", ".join(f"{name}={getattr(args, name)!r}" for name in refused)
        raise ValueError(f"trl_lite's RLOOTrainer does not support {values}: leave {'it' if len(refused) == 1 else 'them'} "
                         "at TRL's default (docs/migrating_from_trl.md lists every field).")  # fmt: skip
    config_mapping.check_common(args)


def _symmetric(clip) -> bool:
    """Whether ``clip`` is a pair ``(-c, c)`` of numbers with ``c > 0``."""
    try:
        low, high = (float(value) for value in clip)
    except (TypeError, ValueError):
        return False
    return high > 0 and low == -high


def as_grpo(args) -> types.SimpleNamespace:
    """``args`` as the ``GRPOConfig`` values of the same run (a namespace; :data:`AS_GRPO` added)."""
    return types.SimpleNamespace(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)}, **AS_GRPO)


def to_ppo_config(args, num_processes: int):
    """The ``PPOConfig`` of a (checked) ``RLOOConfig``: GRPO's mapping of :func:`as_grpo`, then RLOO's estimator,
    its KL in the reward and the reward clip."""
    clip = args.reward_clip_range
    return dataclasses.replace(
        config_mapping.to_ppo_config(as_grpo(args), num_processes), advantage_estimator="rloo", kl_in_reward=True,
        kl_penalty="kl", init_kl_coef=args.beta, score_clip=None if clip is None else float(clip[1]),
    )  # fmt: skip


def _post_init(self) -> None:
    check_rloo_config(self)  # refusals and TRL's sizes first, on the values as given
    TrainingArguments.__post_init__(self)


RLOOConfig = dataclasses.make_dataclass(
    "RLOOConfig", [_field(name) for name in RLOO_FIELDS], bases=(TrainingArguments,),
    namespace={"__post_init__": _post_init, "__module__": __name__, "__doc__": (
        "Configuration of :class:`~trl_lite.RLOOTrainer`: TRL 1.x's ``RLOOConfig`` names and defaults (a\n"
        "``TrainingArguments``; the batch sizes as in ``GRPOConfig``). What each field becomes: this module.")},
)  # fmt: skip
