"""The checks of ``PPOConfig``: each field's type and range, and the rules between fields.

Kept apart from the dataclass so that ``ppo_config.py`` reads as the list of hyperparameters with their help.
The checks read the config's attributes and, for derived fields, write them.
"""

from __future__ import annotations

import math

from ..core import ADVANTAGE_ESTIMATORS, IMPORTANCE_SAMPLING_LEVELS, KL_PENALTIES, LOSS_TYPE_ALIASES, LOSS_TYPES


def validate_config(config) -> None:
    """Check every field of ``config`` (a ``PPOConfig``): raise ``ValueError``/``TypeError`` naming the first bad
    field, its value and what is accepted; then derive ``backward_batch_size`` and ``total_ppo_epochs``."""
    for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "steps"):
        _check_positive_int(name, getattr(config, name))
    for name in ("learning_rate", "target", "horizon", "target_kl", "ratio_threshold"):
        _check_positive_float(name, getattr(config, name))
    for name in ("init_kl_coef", "cliprange", "cliprange_value", "vf_coef", "ptx_coef"):
        _check_float(name, getattr(config, name), minimum=0.0)
    for name in ("gamma", "lam"):
        _check_float(name, getattr(config, name), minimum=0.0, maximum=1.0)
    if config.dataset_num_proc is not None:
        _check_positive_int("dataset_num_proc", config.dataset_num_proc)
    for name in ("max_grad_norm", "score_clip", "critic_learning_rate"):
        if getattr(config, name) is not None:
            _check_positive_float(name, getattr(config, name))
    if config.ema_decay is not None:
        _check_float("ema_decay", config.ema_decay)
        if not 0.0 < config.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be None or a number in (0, 1), got {config.ema_decay}.")
    if config.kl_penalty not in KL_PENALTIES:
        raise ValueError(f"kl_penalty must be one of {KL_PENALTIES}, got {config.kl_penalty!r}.")
    if config.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {config.advantage_estimator!r}."
        )
    _check_positive_int("num_samples_per_query", config.num_samples_per_query)
    if config.kl_in_reward is not None and not isinstance(config.kl_in_reward, bool):
        raise TypeError(f"kl_in_reward must be None, True or False, got {config.kl_in_reward!r}.")
    _check_log_with(config.log_with)
    for name in ("adap_kl_ctrl", "early_stopping", "use_score_scaling", "use_score_norm", "whiten_rewards",
                 "gradient_checkpointing", "remove_unused_columns", "optimize_device_cache", "keep_freed_cpu_memory",
                 "grpo_scale_rewards", "compute_reference_kl", "entropy_token_mean", "seq_mean_all_rows"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(config, name)!r}.")
    budget = config.max_tokens_per_minibatch
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise TypeError(f"max_tokens_per_minibatch must be None or a positive int, got {budget!r} ({type(budget).__name__}).")
    if budget is not None and budget < 1:
        raise ValueError(f"max_tokens_per_minibatch must be None or a positive int, got {budget}.")
    if config.padding_free not in (None, True, False):
        raise TypeError(f"padding_free must be None, True or False, got {config.padding_free!r}.")
    if not (config.prefix_sharing is None or isinstance(config.prefix_sharing, bool)):
        raise TypeError(f"prefix_sharing must be None (automatic), True or False, got {config.prefix_sharing!r}.")
    if not (config.shuffle_by_prompt is None or isinstance(config.shuffle_by_prompt, bool)):
        raise TypeError(f"shuffle_by_prompt must be None (automatic), True or False, got {config.shuffle_by_prompt!r}.")
    if config.mini_batch_size > config.batch_size:
        raise ValueError(
            f"mini_batch_size ({config.mini_batch_size}) must not exceed batch_size ({config.batch_size})."
        )
    backward_batch_size = config.mini_batch_size * config.gradient_accumulation_steps
    if config.batch_size % backward_batch_size != 0:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be a multiple of mini_batch_size * gradient_accumulation_steps "
            f"({config.mini_batch_size} * {config.gradient_accumulation_steps} = {backward_batch_size})."
        )
    if config.batch_size % config.num_samples_per_query != 0:
        raise ValueError(
            f"batch_size ({config.batch_size}) must be a multiple of num_samples_per_query "
            f"({config.num_samples_per_query}): a group of responses to one query must not be split across steps "
            "or processes."
        )
    if config.whiten_rewards and config.advantage_estimator in ("rloo", "grpo"):
        raise ValueError(
            f"whiten_rewards=True applies to per-token rewards ('gae', 'reinforce_pp'), not to "
            f"advantage_estimator={config.advantage_estimator!r}, whose baseline comes from the group's scores."
        )
    if config.use_score_norm and not config.use_score_scaling:
        raise ValueError("use_score_norm=True needs use_score_scaling=True (normalisation uses the running moments).")
    for name in ("tracker_kwargs", "accelerator_kwargs", "project_kwargs", "push_to_hub_if_best_kwargs"):
        if not isinstance(getattr(config, name), dict):
            raise TypeError(f"{name} must be a dict, got {type(getattr(config, name)).__name__}.")
    _validate_objective(config)
    _validate_engine(config)
    _validate_temperature(config)
    _validate_dropout(config)
    _validate_memory(config)
    config.backward_batch_size = backward_batch_size
    # Not a field (as in classic TRL): the step() calls of a script's run, which classic scripts read.
    config.total_ppo_epochs = math.ceil(config.steps / config.batch_size)


def _validate_objective(config) -> None:
    """The fields of docs/algorithm.md sections 13-15; stores ``loss_type`` under its canonical name."""
    if config.loss_type in LOSS_TYPE_ALIASES:
        config.loss_type = LOSS_TYPE_ALIASES[config.loss_type]
    if config.loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {LOSS_TYPES} or TRL's {tuple(LOSS_TYPE_ALIASES)}, got {config.loss_type!r}."
        )
    if config.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {config.importance_sampling_level!r}."
        )
    if config.cliprange_high is not None:
        _check_float("cliprange_high", config.cliprange_high, minimum=0.0)
    if config.dual_clip is not None:
        _check_float("dual_clip", config.dual_clip)
        if not config.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be None or a number > 1, got {config.dual_clip}.")
    _check_float("entropy_coef", config.entropy_coef, minimum=0.0)
    _check_float("grpo_std_eps", config.grpo_std_eps, minimum=0.0)
    if config.grpo_std_scope not in ("group", "batch"):
        raise ValueError(f"grpo_std_scope must be 'group' or 'batch', got {config.grpo_std_scope!r}.")
    for name in ("max_response_length", "overlong_buffer_len", "log_completions_every"):
        if getattr(config, name) is not None:
            _check_positive_int(name, getattr(config, name))
    token = config.stop_token_id
    if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
        raise TypeError(f"stop_token_id must be None or a token id (int >= 0), got {token!r}.")
    if config.missing_eos_penalty is not None:
        _check_float("missing_eos_penalty", config.missing_eos_penalty)
    _check_float("overlong_penalty_factor", config.overlong_penalty_factor, minimum=0.0)
    if config.loss_type == "seq_mean_token_sum_norm" and config.max_response_length is None:
        raise ValueError("loss_type='seq_mean_token_sum_norm' (Dr. GRPO) needs max_response_length, got None.")
    if config.overlong_buffer_len is not None:
        if config.max_response_length is None:
            raise ValueError("overlong_buffer_len needs max_response_length (L_max of the penalty), got None.")
        if config.overlong_buffer_len > config.max_response_length:
            raise ValueError(
                f"overlong_buffer_len ({config.overlong_buffer_len}) must not exceed max_response_length "
                f"({config.max_response_length})."
            )
    if config.importance_sampling_correction not in (None, "tis"):
        raise ValueError(
            f"importance_sampling_correction must be None or 'tis', got {config.importance_sampling_correction!r}."
        )
    _check_positive_float("importance_sampling_cap", config.importance_sampling_cap)

def _validate_engine(config) -> None:
    """The generation-engine fields (``use_vllm`` and ``vllm_*``)."""
    for name in ("use_vllm", "vllm_enforce_eager"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(config, name)!r}.")
    if config.vllm_mode not in ("colocate", "server"):
        raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {config.vllm_mode!r}.")
    if not isinstance(config.vllm_server_url, str) or not config.vllm_server_url.startswith(("http://", "https://")):
        raise ValueError(f"vllm_server_url must be an http(s) URL, got {config.vllm_server_url!r}.")
    _check_positive_float("vllm_server_timeout", config.vllm_server_timeout)
    _check_float("vllm_gpu_memory_utilization", config.vllm_gpu_memory_utilization, minimum=0.0, maximum=1.0)
    if config.vllm_gpu_memory_utilization == 0.0:
        raise ValueError("vllm_gpu_memory_utilization must be in (0, 1], got 0.0.")
    if config.vllm_kv_cache_gb is not None:
        _check_positive_float("vllm_kv_cache_gb", config.vllm_kv_cache_gb)
    if config.vllm_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(
            f"vllm_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {config.vllm_dtype!r}."
        )
    if config.vllm_max_model_len is not None:
        _check_positive_int("vllm_max_model_len", config.vllm_max_model_len)
    _check_positive_int("vllm_tensor_parallel_size", config.vllm_tensor_parallel_size)
    if config.vllm_lora_sync is not None and not isinstance(config.vllm_lora_sync, bool):
        raise TypeError(f"vllm_lora_sync must be None, True or False, got {config.vllm_lora_sync!r}.")
    if config.vllm_enable_sleep_mode not in (None, True, False):
        raise TypeError(f"vllm_enable_sleep_mode must be None, True or False, got {config.vllm_enable_sleep_mode!r}.")
    if config.vllm_enable_sleep_mode and config.vllm_mode == "server":
        raise ValueError(
            "vllm_enable_sleep_mode=True applies to colocated engines (vllm_mode='colocate'); a vLLM server "
            "manages its own memory (see python -m trl_lite.vllm_server --help)."
        )


def _validate_temperature(config) -> None:
    """``temperature``: the sampling and scoring temperature; ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``: the rest of the sampling distribution (docs/temperature.md)."""
    _check_positive_float("temperature", config.temperature)
    _check_positive_float("repetition_penalty", config.repetition_penalty)
    if isinstance(config.top_k, bool) or not isinstance(config.top_k, int) or config.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off), got {config.top_k!r}.")
    _check_float("top_p", config.top_p, minimum=0.0, maximum=1.0)
    _check_float("min_p", config.min_p, minimum=0.0, maximum=1.0)
    if config.top_p == 0.0:
        raise ValueError(f"top_p must be a number in (0, 1] (1.0: off), got {config.top_p!r}.")


def _validate_dropout(config) -> None:
    """``disable_dropout``: a bool."""
    if not isinstance(config.disable_dropout, bool):
        raise TypeError(f"disable_dropout must be True or False, got {config.disable_dropout!r}.")


def _validate_memory(config) -> None:
    """The memory fields: ``oom_backoff`` (docs/out_of_memory.md) and ``lm_head_chunk_size`` - None (automatic),
    0 (one buffer) or a positive number of tokens per chunk (docs/memory.md)."""
    if not isinstance(config.oom_backoff, bool):
        raise TypeError(f"oom_backoff must be True or False, got {config.oom_backoff!r} ({type(config.oom_backoff).__name__}).")
    chunk = config.lm_head_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
        raise TypeError(
            f"lm_head_chunk_size must be None (automatic), 0 (one buffer) or a positive int (tokens per chunk), "
            f"got {chunk!r} ({type(chunk).__name__})."
        )
    if chunk is not None and chunk < 0:
        raise ValueError(
            f"lm_head_chunk_size must be None (automatic), 0 (one buffer) or a positive int (tokens per chunk), "
            f"got {chunk}."
        )


def _check_log_with(value) -> None:
    if value not in (None, "wandb", "tensorboard", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "all"):
        raise ValueError(
            f"log_with must be None or an accelerate tracker name ('wandb', 'tensorboard', 'all', ...), got {value!r}."
        )


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}.")


def _check_float(name: str, value, minimum: float | None = None, maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    low_ok = minimum is None or value >= minimum
    high_ok = maximum is None or value <= maximum
    if not math.isfinite(value) or not (low_ok and high_ok):
        accepted = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be a finite number {accepted}, got {value}.")


def _check_positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {value!r} ({type(value).__name__}).")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}.")
