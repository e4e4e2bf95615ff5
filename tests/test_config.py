"""``PPOConfig``: defaults, derived fields, aliases and validation messages (all checks in ``validate``)."""

from dataclasses import fields

import pytest
from tiny_models import make_gpt2, make_tokenizer
from transformers import HfArgumentParser

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

NAN, INF = float("nan"), float("inf")


def test_defaults_are_the_classic_ones_and_valid():
    config = PPOConfig()
    assert (config.batch_size, config.mini_batch_size, config.gradient_accumulation_steps) == (128, 128, 1)
    assert (config.learning_rate, config.init_kl_coef, config.target, config.horizon) == (1.41e-5, 0.2, 6.0, 10000.0)
    assert (config.gamma, config.lam, config.cliprange, config.cliprange_value) == (1.0, 0.95, 0.2, 0.2)
    assert config.vf_coef == 0.1
    assert (config.ppo_epochs, config.kl_penalty, config.ratio_threshold, config.adap_kl_ctrl) == (4, "kl", 10.0, True)
    assert config.backward_batch_size == 128


def test_every_field_has_help_text():
    undocumented = [f.name for f in fields(PPOConfig) if not f.metadata.get("help")]
    assert undocumented == []


def test_backward_batch_size_and_total_ppo_epochs_are_derived():
    config = PPOConfig(batch_size=12, mini_batch_size=3, gradient_accumulation_steps=2, steps=25)
    assert config.backward_batch_size == 6
    assert config.total_ppo_epochs == 3  # ceil(25 / 12), as classic scripts count their steps
    config.steps = 24
    config.validate()
    assert config.total_ppo_epochs == 2


def test_deprecated_aliases_set_the_new_fields():
    config = PPOConfig(batch_size=8, forward_batch_size=2, optimize_cuda_cache=True)
    assert config.mini_batch_size == 2 and config.backward_batch_size == 2
    assert config.optimize_device_cache is True


# (kwargs, error type, substrings: the field, the value given and what is accepted)
BAD_CONFIGS = [
    (dict(batch_size=4, mini_batch_size=8), ValueError, ["mini_batch_size (8)", "batch_size (4)", "must not exceed"]),
    (dict(batch_size=4, forward_batch_size=8), ValueError, ["mini_batch_size (8)", "batch_size (4)"]),
    (dict(batch_size=6, mini_batch_size=2, gradient_accumulation_steps=2), ValueError,
     ["batch_size (6)", "multiple of mini_batch_size * gradient_accumulation_steps", "2 * 2 = 4"]),
    (dict(kl_penalty="kld"), ValueError, ["kl_penalty", "'kld'", "'kl'", "'abs'", "'mse'", "'full'"]),
    (dict(learning_rate=0.0), ValueError, ["learning_rate", "positive", "got 0.0"]),
    (dict(learning_rate=-1e-5), ValueError, ["learning_rate", "positive", "got -1e-05"]),
    (dict(learning_rate=NAN), ValueError, ["learning_rate", "finite", "nan"]),
    (dict(learning_rate="1e-5"), TypeError, ["learning_rate", "number", "'1e-5'", "str"]),
    (dict(use_score_norm=True), ValueError, ["use_score_norm", "use_score_scaling"]),
    (dict(batch_size=0), ValueError, ["batch_size", "positive int", "got 0"]),
    (dict(batch_size=4.0, mini_batch_size=4), TypeError, ["batch_size", "int", "4.0", "float"]),
    (dict(mini_batch_size=True), TypeError, ["mini_batch_size", "int", "True", "bool"]),
    (dict(gradient_accumulation_steps=0), ValueError, ["gradient_accumulation_steps", "positive int", "got 0"]),
    (dict(ppo_epochs=-1), ValueError, ["ppo_epochs", "positive int", "got -1"]),
    (dict(steps=0), ValueError, ["steps", "positive int", "got 0"]),
    (dict(dataset_num_proc=0), ValueError, ["dataset_num_proc", "positive int", "got 0"]),
    (dict(gamma=1.5), ValueError, ["gamma", "[0.0, 1.0]", "got 1.5"]),
    (dict(lam=-0.1), ValueError, ["lam", "[0.0, 1.0]", "got -0.1"]),
    (dict(cliprange=-0.2), ValueError, ["cliprange", ">= 0.0", "got -0.2"]),
    (dict(cliprange_value=INF), ValueError, ["cliprange_value", "finite", "inf"]),
    (dict(vf_coef=None), TypeError, ["vf_coef", "number", "None"]),
    (dict(init_kl_coef=-0.1), ValueError, ["init_kl_coef", ">= 0.0", "got -0.1"]),
    (dict(target=0), ValueError, ["target", "positive", "got 0"]),
    (dict(horizon=-1.0), ValueError, ["horizon", "positive", "got -1.0"]),
    (dict(target_kl=0.0), ValueError, ["target_kl", "positive", "got 0.0"]),
    (dict(ratio_threshold=0), ValueError, ["ratio_threshold", "positive", "got 0"]),
    (dict(max_grad_norm=0.0), ValueError, ["max_grad_norm", "positive", "got 0.0"]),
    (dict(score_clip=-1.0), ValueError, ["score_clip", "positive", "got -1.0"]),
    (dict(log_with="tensorbored"), ValueError, ["log_with", "'tensorbored'", "'tensorboard'", "None"]),
    (dict(tracker_kwargs=["a"]), TypeError, ["tracker_kwargs", "dict", "list"]),
    (dict(accelerator_kwargs=None), TypeError, ["accelerator_kwargs", "dict", "NoneType"]),
    (dict(keep_freed_cpu_memory="yes"), TypeError, ["keep_freed_cpu_memory", "True or False", "'yes'"]),
    (dict(max_tokens_per_minibatch=0), ValueError, ["max_tokens_per_minibatch", "None or a positive int", "got 0"]),
    (dict(max_tokens_per_minibatch=512.0), TypeError, ["max_tokens_per_minibatch", "None or a positive int", "512.0"]),
    (dict(max_tokens_per_minibatch=True), TypeError, ["max_tokens_per_minibatch", "positive int", "True", "bool"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,error,substrings", BAD_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c[0].items()) for c in BAD_CONFIGS]
)
def test_bad_config_is_rejected_with_a_precise_message(kwargs, error, substrings):
    with pytest.raises(error) as raised:
        PPOConfig(**kwargs)
    message = str(raised.value)
    for substring in substrings:
        assert substring in message, f"{substring!r} not in {message!r}"


@pytest.mark.parametrize("kwargs,error,substrings", BAD_CONFIGS[:3], ids=["mini>batch", "alias", "divisible"])
def test_command_line_configs_go_through_the_same_validation(kwargs, error, substrings):
    argv = [f"--{key}={value}" for key, value in kwargs.items()]
    with pytest.raises(error) as raised:
        HfArgumentParser(PPOConfig).parse_args_into_dataclasses(argv)
    assert substrings[0] in str(raised.value)


def test_good_edge_values_are_accepted():
    config = PPOConfig(
        batch_size=1, mini_batch_size=1, gamma=0.0, lam=1.0, cliprange=0.0, init_kl_coef=0.0, vf_coef=0.0,
        learning_rate=1, kl_penalty="full", log_with="tensorboard", use_score_scaling=True, use_score_norm=True,
    )  # fmt: skip
    assert config.backward_batch_size == 1
    assert PPOConfig().max_tokens_per_minibatch is None
    assert PPOConfig(max_tokens_per_minibatch=1).max_tokens_per_minibatch == 1


def test_validate_catches_fields_changed_after_construction():
    config = PPOConfig(batch_size=4, mini_batch_size=2)
    config.validate()
    config.mini_batch_size = 8
    with pytest.raises(ValueError, match=r"mini_batch_size \(8\) must not exceed batch_size \(4\)"):
        config.validate()


def test_trainer_revalidates_the_config():
    config = PPOConfig(batch_size=4, mini_batch_size=2)
    config.kl_penalty = "kld"
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        PPOTrainer(config, model, None, make_tokenizer())


def test_sleep_mode_field_is_checked():
    with pytest.raises(TypeError, match="vllm_enable_sleep_mode must be None, True or False, got 'yes'"):
        PPOConfig(vllm_enable_sleep_mode="yes")
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True applies to colocated engines"):
        PPOConfig(use_vllm=True, vllm_mode="server", vllm_enable_sleep_mode=True)
    assert PPOConfig().vllm_enable_sleep_mode is None
