"""``GRPOConfig``: TRL 1.x's GRPO configuration, field for field, as a ``transformers.TrainingArguments``.

Every field keeps TRL 1.x's name and default (TRL's overrides of ``TrainingArguments`` included:
``learning_rate=1e-6``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16=None``,
``remove_unused_columns=False``). What each field becomes in trl_lite is decided in one place,
:mod:`.config_mapping`: a field trl_lite honours maps onto a ``PPOConfig`` field or a part of the loop; a
field it does not honour, set to anything but its default, raises ``ValueError`` naming it (docs/migrating_from_trl.md
has the table). An unknown name is a ``TypeError``, as in TRL (dataclass ``__init__``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .config_mapping import check_grpo_config


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class GRPOConfig(TrainingArguments):
    """Configuration of :class:`~trl_lite.GRPOTrainer`: TRL 1.x's ``GRPOConfig`` names and defaults.

    Batch sizes as in TRL: ``generation_batch_size`` completions (all processes) per generation, of
    ``num_generations`` per prompt; ``per_device_train_batch_size`` completions per forward/backward pass,
    ``gradient_accumulation_steps`` passes per optimizer step; ``num_iterations`` passes over each generation.
    ``state.global_step`` counts optimizer steps, as in TRL.
    """

    # TRL's overrides of TrainingArguments' defaults
    learning_rate: float = field(default=1e-6, metadata=_help("AdamW learning rate."))
    logging_steps: float = field(default=10, metadata=_help("Log every this many optimizer steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Gradient checkpointing of the policy."))
    bf16: bool | None = field(
        default=None,
        metadata=_help("bfloat16 mixed precision. None: TRL's default, on unless fp16 - on a device that has bf16 "
                       "(CUDA with bf16); off on the CPU (where TRL's own default raises)."),
    )
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata=_help("kwargs of the scheduler."))
    use_liger_kernel: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    torch_empty_cache_steps: int | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    remove_unused_columns: bool | None = field(
        default=False, metadata=_help("False (TRL's GRPO default): every dataset column reaches the reward functions.")
    )
    # Model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_help("kwargs of from_pretrained when `model` is a path or name.")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Passed to from_pretrained."))
    router_aux_loss_coef: float = field(default=0.001, metadata=_help("MoE auxiliary loss; not supported."))
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout of the policy to 0."))
    cast_lm_head_to_fp32: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    # Data and generation
    num_generations: int | None = field(default=8, metadata=_help("Completions per prompt (the group)."))
    num_generations_eval: int | None = field(default=None, metadata=_help("Completions per prompt in evaluate()."))
    max_completion_length: int | None = field(default=512, metadata=_help("Longest completion, in tokens."))
    ds3_gather_for_generation: bool = field(default=True, metadata=_help("Only True is supported."))
    shuffle_dataset: bool | None = field(default=True, metadata=_help("Shuffle the prompts with `seed` each epoch."))
    pad_to_multiple_of: int | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    generation_batch_size: int | None = field(default=None, metadata=_help("Completions per generation, all processes."))
    steps_per_generation: int | None = field(default=None, metadata=_help("Passes per generation (per process)."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature (also of the log-probs)."))
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling."))
    top_k: int = field(default=0, metadata=_help("Top-k sampling; 0: off."))
    min_p: float | None = field(default=None, metadata=_help("Min-p sampling; None: off."))
    generation_kwargs: dict | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    chat_template_kwargs: dict | None = field(default=None, metadata=_help("kwargs of apply_chat_template."))
    repetition_penalty: float = field(default=1.0, metadata=_help("Repetition penalty; 1.0: off."))
    cache_implementation: str | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    # vLLM
    use_vllm: bool = field(default=False, metadata=_help("Generate with vLLM."))
    vllm_mode: str = field(default="colocate", metadata=_help("'colocate' or 'server'."))
    vllm_model_impl: str = field(default="vllm", metadata=_help("Only 'vllm' is supported."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_help("Sleep the colocated engine between generations."))
    vllm_structured_outputs_regex: str | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    vllm_server_base_url: str | None = field(default=None, metadata=_help("Server URL; None: host and port."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_help("Server host (without base URL)."))
    vllm_server_port: int = field(default=8000, metadata=_help("Server port (without base URL)."))
    vllm_server_timeout: float = field(default=240.0, metadata=_help("Seconds to wait for the server."))
    vllm_group_port: int = field(default=51216, metadata=_help("Not used by trl_lite's server; only the default."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_help("GPU memory share of the colocated engine."))
    vllm_max_model_length: int | None = field(default=None, metadata=_help("Longest prompt + completion of the engine."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_help("Processes per colocated engine."))
    # The loss
    beta: float = field(default=0.0, metadata=_help("KL coefficient (k3 in the loss); 0: no reference model."))
    num_iterations: int = field(default=1, metadata=_help("Passes over each generation batch (PPO epochs)."))
    epsilon: float = field(default=0.2, metadata=_help("Lower clip range of the ratio."))
    delta: float | None = field(default=None, metadata=_help("Two-sided GRPO's upper bound of the ratio."))
    epsilon_high: float | None = field(default=None, metadata=_help("Upper clip range; None: epsilon."))
    sapo_temperature_neg: float = field(default=1.05, metadata=_help("Only for loss_type='sapo' (not supported)."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_help("Only for loss_type='sapo' (not supported)."))
    vespo_k_pos: float = field(default=2.0, metadata=_help("Only for loss_type='vespo' (not supported)."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_help("Only for loss_type='vespo' (not supported)."))
    vespo_k_neg: float = field(default=3.0, metadata=_help("Only for loss_type='vespo' (not supported)."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_help("Only for loss_type='vespo' (not supported)."))
    importance_sampling_level: str = field(default="token", metadata=_help("'token' or 'sequence' (GSPO)."))
    reward_weights: list[float] | None = field(default=None, metadata=_help("One weight per reward function."))
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata=_help("Only 'sum_then_normalize' is supported.")
    )
    scale_rewards: str = field(default="group", metadata=_help("'group' (True), 'batch' or 'none' (False)."))
    loss_type: str = field(default="dapo", metadata=_help("'dapo', 'grpo', 'dr_grpo' or 'bnpo'."))
    mask_truncated_completions: bool = field(default=False, metadata=_help("Truncated completions out of the loss."))
    sync_ref_model: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_help("Only with sync_ref_model (not supported)."))
    ref_model_sync_steps: int = field(default=512, metadata=_help("Only with sync_ref_model (not supported)."))
    top_entropy_quantile: float = field(default=1.0, metadata=_help("Only 1.0 is supported."))
    entropy_coef: float = field(default=0.0, metadata=_help("Entropy bonus."))
    use_adaptive_entropy: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    entropy_coef_min: float = field(default=0.0, metadata=_help("Only with use_adaptive_entropy (not supported)."))
    entropy_coef_max: float = field(default=1.0, metadata=_help("Only with use_adaptive_entropy (not supported)."))
    entropy_coef_delta: float = field(default=0.005, metadata=_help("Only with use_adaptive_entropy (not supported)."))
    entropy_target: float = field(default=0.2, metadata=_help("Only with use_adaptive_entropy (not supported)."))
    max_tool_calling_iterations: int | None = field(
        default=None, metadata=_help("Tool-calling rounds per completion at most (None: until max_completion_length).")
    )
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata=_help("With vLLM: TIS (needs vllm_importance_sampling_mode='token_truncate').")
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata=_help("Only 'token_truncate' is supported (trl_lite's TIS).")
    )
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata=_help("Cap of the TIS weight."))
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    off_policy_mask_threshold: float | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    use_bias_correction_kl: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    # Logging
    log_completions: bool = field(default=False, metadata=_help("Print a table of completions at each log."))
    log_multimodal: bool = field(default=True, metadata=_help("Images are not supported; no effect."))
    num_completions_to_print: int | None = field(default=None, metadata=_help("Rows of that table; None: all."))
    log_unique_prompts: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    log_completions_hub_repo: str | None = field(default=None, metadata=_help("Not supported by trl_lite."))
    use_transformers_continuous_batching: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    transformers_continuous_batching_config: dict | None = field(default=None, metadata=_help("Not supported."))
    use_transformers_paged: bool = field(default=False, metadata=_help("Not supported by trl_lite."))
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata=_help("Deprecated alias of vllm_importance_sampling_clip_max.")
    )

    def __post_init__(self):
        # Refusals and TRL's derived sizes first, on the values as given (TrainingArguments turns strings into enums).
        check_grpo_config(self)
        super().__post_init__()
