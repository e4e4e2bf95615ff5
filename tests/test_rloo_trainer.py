"""RLOOConfig / RLOOTrainer: TRL 1.x's field names and defaults, refusals, the one mapping onto PPOConfig, the
leave-one-out advantage of one ``.train()`` iteration against a float64 reference (rewards minus ``beta`` times the
summed k1 KL, TRL's KL in the reward) with TRL's RLOO ``kl`` metric, and a TRL 1.x RLOO script that runs after
changing only its import."""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from grpo_helpers import dataset, tokenizer
from tiny_models import make_gpt2
from transformers import AutoModelForCausalLM, TrainingArguments

from trl_lite import GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_lite.trainer import RLOOConfig as TrainerRLOOConfig
from trl_lite.trainer.grpo.rloo_config import to_ppo_config

HERE = os.path.dirname(os.path.abspath(__file__))

# TRL 1.x's RLOOConfig defaults (trl/trainer/rloo_config.py and base_config.py, read from TRL's source).
TRL_DEFAULTS = {
    "learning_rate": 1e-6, "logging_steps": 10, "gradient_checkpointing": True, "bf16": None,
    "lr_scheduler_kwargs": None, "use_liger_kernel": False, "torch_empty_cache_steps": None,
    "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": 0.001, "disable_dropout": False,
    "remove_unused_columns": False, "num_generations": 2, "num_generations_eval": None, "max_completion_length": 512,
    "ds3_gather_for_generation": True, "shuffle_dataset": True, "pad_to_multiple_of": None,
    "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "generation_kwargs": None, "chat_template_kwargs": None, "repetition_penalty": 1.0,
    "cache_implementation": None, "use_vllm": False, "vllm_mode": "colocate", "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False, "vllm_structured_outputs_regex": None, "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000, "vllm_server_timeout": 240.0, "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": None, "vllm_tensor_parallel_size": 1, "beta": 0.05,
    "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "reward_weights": None, "normalize_advantages": False,
    "reward_clip_range": None, "mask_truncated_completions": False, "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512, "log_completions": False, "log_multimodal": True,
    "num_completions_to_print": None, "log_unique_prompts": False, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
}  # fmt: skip
TRAINING_ARGUMENTS_OVERRIDES = {"learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "lr_scheduler_kwargs",
                                "use_liger_kernel", "torch_empty_cache_steps", "remove_unused_columns"}  # fmt: skip


def test_every_field_has_trls_name_and_default_and_nothing_else():
    fields = {f.name: f.default for f in dataclasses.fields(RLOOConfig)}
    assert {name: fields.get(name, "missing") for name in TRL_DEFAULTS} == TRL_DEFAULTS
    own = set(fields) - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert own == set(TRL_DEFAULTS) - TRAINING_ARGUMENTS_OVERRIDES
    args = RLOOConfig(output_dir="out")
    assert isinstance(args, TrainingArguments) and TrainerRLOOConfig is RLOOConfig
    assert (args.steps_per_generation, args.generation_batch_size, args.bf16) == (1, 8, False)  # TRL's sizes; no bf16 CPU


def test_it_parses_from_the_command_line_as_trl_scripts_do():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RLOOConfig).parse_args_into_dataclasses(
        ["--output_dir", "out", "--beta", "0.1", "--num_generations", "4", "--per_device_train_batch_size", "4"]
    )
    assert (args.beta, args.num_generations, args.generation_batch_size, args.normalize_advantages) == (0.1, 4, 4, False)


@pytest.mark.parametrize("given, match", [
    ({"normalize_advantages": True}, "normalize_advantages=True"), ({"sync_ref_model": True}, "sync_ref_model=True"),
    ({"reward_clip_range": (0.0, 1.0)}, r"reward_clip_range=\(0.0, 1.0\)"), ({"reward_clip_range": "a"}, "symmetric"),
    ({"num_generations": 1}, "num_generations"),
    ({"optim": "sgd"}, "optim='sgd'"),
])  # fmt: skip
def test_what_trl_lite_cannot_honour_is_refused_naming_the_field(given, match):
    with pytest.raises(ValueError, match=match):
        RLOOConfig(output_dir="out", **given)


def test_grpo_only_names_are_unknown_as_in_trl():
    for name, value in (("loss_type", "grpo"), ("scale_rewards", "none"), ("delta", 2.0), ("no_such_field", 1)):
        with pytest.raises(TypeError, match=name):
            RLOOConfig(output_dir="out", **{name: value})
    for name in ("tools", "environment_factory", "rollout_func"):  # TRL's RLOOTrainer takes none of them
        with pytest.raises(TypeError, match=name):
            RLOOTrainer(make_gpt2(), [id_sum], args=RLOOConfig(output_dir="out"), train_dataset=dataset(), **{name: []})


def test_the_mapping_is_rloo_with_the_kl_in_the_reward():
    args = RLOOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4, beta=0.2, epsilon=0.3,
                      epsilon_high=0.4, reward_clip_range=(-5, 5), max_completion_length=16)  # fmt: skip
    config = to_ppo_config(args, 1)
    assert (config.advantage_estimator, config.num_samples_per_query, config.kl_in_reward, config.kl_penalty) == ("rloo", 4, True, "kl")
    assert (config.init_kl_coef, config.adap_kl_ctrl, config.cliprange, config.cliprange_high) == (0.2, False, 0.3, 0.4)
    # TRL's RLOO loss: one clipped ratio per completion (exp of its summed log-ratio), averaged over completions
    assert (config.loss_type, config.max_response_length, config.score_clip) == ("seq_mean_token_mean", 16, 5.0)
    assert config.importance_sampling_level == "sequence_sum" and config.importance_sampling_correction is None
    assert config.batch_size == 4 and config.mini_batch_size == 4


def _float64_logprob_sums(model, queries, responses) -> torch.Tensor:
    """Each response's summed log-prob under ``model`` in float64 (temperature 1). Shape ``(B,)``."""
    lm = type(model)(model.config).double().eval()
    lm.load_state_dict({name: t.double() for name, t in model.state_dict().items()})
    sums = []
    with torch.no_grad():
        for query, response in zip(queries, responses):
            row = torch.cat([query, response])
            logits = lm(input_ids=row[None]).logits[0, len(query) - 1 : -1]
            sums.append(torch.log_softmax(logits, -1).gather(1, response[:, None]).sum())
    return torch.stack(sums)


def id_sum(prompts, completions, completion_ids, **kwargs):
    """Varies within every group (the completions' token ids differ)."""
    return [sum(ids) / 50 for ids in completion_ids]


def test_one_iteration_trains_on_the_leave_one_out_advantage_of_reward_minus_beta_kl(tmp_path):
    k, beta = 4, 0.5
    args = RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=k, beta=beta,
                      max_completion_length=6, max_steps=2, learning_rate=5e-2, logging_steps=1, save_strategy="no",
                      report_to="none", disable_tqdm=True, seed=3, gradient_checkpointing=False)  # fmt: skip
    trainer = RLOOTrainer(model=make_gpt2(), reward_funcs=[id_sum], args=args, train_dataset=dataset(),
                          processing_class=tokenizer())  # fmt: skip
    reference = copy.deepcopy(trainer.model)
    maker = trainer.ppo.experience_maker
    steps, advantages = [], []
    step, critic_free = trainer.ppo.step, maker.critic_free_advantages

    def recording_step(queries, responses, scores, **kwargs):
        steps.append((queries, responses, torch.stack(scores).double(), copy.deepcopy(trainer.model)))
        return step(queries, responses, scores, **kwargs)

    def recording_advantages(*a, **kw):
        advantages.append(critic_free(*a, **kw))
        return advantages[-1]

    trainer.ppo.step, maker.critic_free_advantages = recording_step, recording_advantages
    trainer.train()
    assert len(steps) == len(advantages) == 2
    for (queries, responses, scores, policy), got, logged in zip(steps, advantages, trainer.state.log_history):
        kl = _float64_logprob_sums(policy, queries, responses) - _float64_logprob_sums(reference, queries, responses)
        rho = (scores - beta * kl).view(-1, k)
        expected = (rho - (rho.sum(1, keepdim=True) - rho) / (k - 1)).reshape(-1)
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float64)
        assert ((got != 0).sum(-1) <= lengths).all()
        # a_i on each of row i's tokens (its sum over the row is a_i times the length)
        torch.testing.assert_close(got.double().sum(-1) / lengths, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double().abs().amax(-1), expected.abs(), rtol=1e-5, atol=1e-5)
        # TRL's RLOO kl: the mean per-token lp_old - lp_ref
        token_kl = kl.sum() / sum(len(r) for r in responses)
        assert logged["kl"] == pytest.approx(float(token_kl), abs=1e-5)
    assert abs(steps[1][3].transformer.wte.weight - reference.transformer.wte.weight).max() > 0
    assert trainer.state.log_history[1]["kl"] != 0  # the second generation's policy is not the reference
    assert isinstance(trainer, GRPOTrainer) and {"reward", "entropy", "clip_ratio/region_mean"} <= set(logged)


TRL_SCRIPT = """
from datasets import Dataset
from trl_lite import RLOOConfig, RLOOTrainer  # was: from trl import RLOOConfig, RLOOTrainer

dataset = Dataset.from_dict({"prompt": ["the movie was", "i loved the", "this film is", "a story that"],
                             "solution": ["good", "good", "bad", "fine"]})

def accuracy(completions, solution, **kwargs):
    return [float(s in c.split()) for c, s in zip(completions, solution)]

training_args = RLOOConfig(output_dir=OUTPUT, per_device_train_batch_size=4, max_completion_length=8, max_steps=2,
                           logging_steps=1, save_steps=2, report_to="none")
trainer = RLOOTrainer(model=MODEL, reward_funcs=accuracy, args=training_args, train_dataset=dataset)
trainer.train()
trainer.save_model(OUTPUT)
print("LOGGED", sorted(trainer.state.log_history[-1]))
"""


def test_a_trl_1x_rloo_script_runs_after_changing_only_its_import(tmp_path):
    model_dir = tmp_path / "tiny-model"
    make_gpt2().save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    script = tmp_path / "train_rloo.py"
    script.write_text(f"OUTPUT = {str(tmp_path / 'out')!r}\nMODEL = {str(model_dir)!r}\n" + textwrap.dedent(TRL_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'rewards/accuracy/mean'" in done.stdout and "'kl'" in done.stdout
    assert "checkpoint-2" in os.listdir(tmp_path / "out")
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
