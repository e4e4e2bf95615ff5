"""GRPOConfig: TRL 1.x's field names and defaults, TRL's derived batch sizes, the refusal of every field trl_lite does
not honour (a non-default value raises ValueError naming it; an unknown name is a TypeError), and the one mapping
onto PPOConfig."""

import dataclasses

import pytest
from transformers import TrainingArguments

from trl_lite import GRPOConfig, PPOConfig
from trl_lite.trainer.grpo.config_mapping import HONOURED, refused_fields, to_ppo_config

# TRL 1.x's GRPOConfig defaults (trl/trainer/grpo_config.py and base_config.py, read from TRL's source), including
# its overrides of TrainingArguments' defaults.
TRL_DEFAULTS = {
    "learning_rate": 1e-6, "logging_steps": 10, "gradient_checkpointing": True, "bf16": None,
    "remove_unused_columns": False, "model_init_kwargs": None, "trust_remote_code": False,
    "router_aux_loss_coef": 0.001, "disable_dropout": False, "cast_lm_head_to_fp32": False, "num_generations": 8,
    "num_generations_eval": None, "max_completion_length": 512, "ds3_gather_for_generation": True,
    "shuffle_dataset": True, "pad_to_multiple_of": None, "generation_batch_size": None, "steps_per_generation": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "generation_kwargs": None,
    "chat_template_kwargs": None, "repetition_penalty": 1.0, "cache_implementation": None, "use_vllm": False,
    "vllm_mode": "colocate", "vllm_model_impl": "vllm", "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None, "vllm_server_base_url": None, "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000, "vllm_server_timeout": 240.0, "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": None, "vllm_tensor_parallel_size": 1, "beta": 0.0,
    "num_iterations": 1, "epsilon": 0.2, "delta": None, "epsilon_high": None, "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0, "importance_sampling_level": "token", "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize", "scale_rewards": "group", "loss_type": "dapo",
    "mask_truncated_completions": False, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512, "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "max_tool_calling_iterations": None, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None, "off_policy_mask_threshold": None, "use_bias_correction_kl": False,
    "log_completions": False, "log_multimodal": True, "num_completions_to_print": None, "log_unique_prompts": False,
    "log_completions_hub_repo": None, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}  # fmt: skip


def test_every_field_has_trls_name_and_default():
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {name: fields.get(name, "missing") for name in TRL_DEFAULTS} == TRL_DEFAULTS
    # and TRL's fields are all there: the TrainingArguments ones plus exactly these
    own = set(fields) - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert own == set(TRL_DEFAULTS) - {"learning_rate", "logging_steps", "gradient_checkpointing", "bf16",
                                        "remove_unused_columns"}  # fmt: skip


def test_a_trl_script_default_config_builds_and_is_a_training_arguments(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path))
    assert isinstance(args, TrainingArguments)
    # TRL's rule: steps_per_generation = gradient_accumulation_steps, generation batch = per-device batch x that
    assert (args.steps_per_generation, args.generation_batch_size) == (1, 8)
    assert args.bf16 is False  # TRL's default is on where the device has bf16; not on this CPU
    assert args.scale_rewards == "group"


@pytest.mark.parametrize("name", ["max_prompt_length", "no_such_field"])
def test_an_unknown_name_is_a_type_error_as_in_trl(name):
    # TRL 1.x removed max_prompt_length (0.28): prompts are never truncated, filter the dataset instead
    with pytest.raises(TypeError, match=name):
        GRPOConfig(output_dir="out", **{name: 1})


# A non-default value of each refused field, TRL's and TrainingArguments'.
REFUSED = {
    "sync_ref_model": True, "top_entropy_quantile": 0.2, "use_adaptive_entropy": True, "cast_lm_head_to_fp32": True,
    "generation_kwargs": {"top_k": 3}, "vllm_structured_outputs_regex": "a+", "off_policy_mask_threshold": 0.5,
    "use_bias_correction_kl": True, "multi_objective_aggregation": "normalize_then_sum",
    "log_unique_prompts": True, "use_transformers_paged": True, "sapo_temperature_neg": 2.0, "pad_to_multiple_of": 8,
    "router_aux_loss_coef": 0.1, "cache_implementation": "static", "ds3_gather_for_generation": False,
    "push_to_hub": True, "torch_compile": True, "fsdp": "full_shard", "dataloader_num_workers": 2,
    "label_smoothing_factor": 0.1, "neftune_noise_alpha": 5.0, "load_best_model_at_end": True, "use_liger_kernel": True,
    "save_only_model": True, "data_seed": 3, "eval_on_start": True, "torch_empty_cache_steps": 4,
}  # fmt: skip


@pytest.mark.parametrize("name, value", REFUSED.items(), ids=list(REFUSED))
def test_a_refused_field_set_away_from_its_default_raises_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"does not support {name}="):
        GRPOConfig(output_dir="out", **{name: value})


def test_every_field_is_honoured_or_refused_and_the_refusal_sees_all_the_others():
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    args = GRPOConfig(output_dir="out")
    assert refused_fields(args) == []
    refused = names - HONOURED
    assert set(REFUSED) <= refused and HONOURED <= names
    for name in sorted(refused)[:40]:  # flipping any of them is seen
        field = next(f for f in dataclasses.fields(GRPOConfig) if f.name == name)
        object.__setattr__(args, name, object())
        assert refused_fields(args) == [name], name
        setattr(args, name, field.default if field.default is not dataclasses.MISSING else field.default_factory())


@pytest.mark.parametrize("name, value, accepted", [
    ("loss_type", "cispo", "dapo"), ("loss_type", "sapo", "grpo"), ("scale_rewards", "max", "batch"),
    ("optim", "sgd", "adamw_torch"), ("save_strategy", "epoch", "steps"), ("eval_strategy", "epoch", "no"),
    ("remove_unused_columns", True, "False"),
])  # fmt: skip
def test_an_honoured_field_with_a_value_trl_lite_lacks_raises_with_the_accepted_ones(name, value, accepted):
    with pytest.raises(ValueError, match=rf"{name}=.*accepted: .*{accepted}"):
        GRPOConfig(output_dir="out", **{name: value})


def test_vllm_importance_sampling_needs_the_token_level_mode_trl_lite_has():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence_mask' is not supported"):
        GRPOConfig(output_dir="out", use_vllm=True)
    args = GRPOConfig(output_dir="out", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=2.5)  # fmt: skip
    ppo = to_ppo_config(args, 1)
    assert (ppo.importance_sampling_correction, ppo.importance_sampling_cap) == ("tis", 2.5)
    assert to_ppo_config(GRPOConfig(output_dir="out", use_vllm=True, vllm_importance_sampling_correction=False), 1
                         ).importance_sampling_correction is None  # fmt: skip


@pytest.mark.parametrize("kwargs, message", [
    ({"num_generations": 1}, "num_generations must be an int >= 2"),
    ({"max_completion_length": None}, "max_completion_length must be an int >= 1"),
    ({"per_device_train_batch_size": 6, "num_generations": 4}, "must be a multiple of num_generations"),
    ({"generation_batch_size": 12, "per_device_train_batch_size": 8}, "must be divisible by the global batch size"),
    ({"generation_batch_size": 16, "steps_per_generation": 2}, "can not be both configured"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "multiple of gradient_accumulation_steps"),
    ({"delta": 1.1}, "delta must be None or > 1 \\+ epsilon_high"),
])  # fmt: skip
def test_bad_sizes_raise_naming_the_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir="out", **kwargs)


def test_the_mapping_onto_ppo_config():
    args = GRPOConfig(
        output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
        num_generations=4, num_iterations=3, beta=0.04, epsilon=0.1, epsilon_high=0.28, delta=1.5, loss_type="dr_grpo",
        scale_rewards=False, importance_sampling_level="sequence", max_completion_length=32, entropy_coef=0.01,
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, learning_rate=3e-5, max_grad_norm=0.5,
        seed=11, disable_dropout=True, gradient_checkpointing=False, vllm_server_host="10.0.0.1", vllm_server_port=9000,
    )  # fmt: skip
    assert args.generation_batch_size == 16
    ppo = to_ppo_config(args, num_processes=2)
    assert isinstance(ppo, PPOConfig)
    want = dict(
        batch_size=8, mini_batch_size=4, gradient_accumulation_steps=2, ppo_epochs=3, advantage_estimator="grpo",
        num_samples_per_query=4, init_kl_coef=0.04, adap_kl_ctrl=False, kl_in_reward=False, cliprange=0.1,
        cliprange_high=0.28, dual_clip=1.5, loss_type="seq_mean_token_sum_norm", grpo_scale_rewards=False,
        importance_sampling_level="sequence", max_response_length=32, entropy_coef=0.01, temperature=0.7, top_p=0.9,
        top_k=5, min_p=0.05, repetition_penalty=1.1, learning_rate=3e-5, max_grad_norm=0.5, seed=11,
        disable_dropout=True, gradient_checkpointing=False, vllm_server_url="http://10.0.0.1:9000",
        accelerator_kwargs={"mixed_precision": "no"},
    )  # fmt: skip
    assert {name: getattr(ppo, name) for name in want} == want
    assert to_ppo_config(GRPOConfig(output_dir="out", loss_type="bnpo"), 1).loss_type == "token_mean"
    by_batch = to_ppo_config(GRPOConfig(output_dir="out", scale_rewards="batch"), 1)
    assert (by_batch.grpo_scale_rewards, by_batch.grpo_std_scope, by_batch.grpo_std_eps) == (True, "batch", 1e-4)
    assert (ppo.grpo_std_scope, ppo.seq_mean_all_rows, ppo.entropy_token_mean) == ("group", True, True)
    assert to_ppo_config(GRPOConfig(output_dir="out", bf16=True, use_cpu=True), 1).accelerator_kwargs == {
        "mixed_precision": "bf16", "cpu": True}
