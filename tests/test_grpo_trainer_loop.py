"""GRPOTrainer.train()'s loop: the prompts in TRL's order (shuffled with seed, whole groups), completions within
max_completion_length, mask_truncated_completions, TRL's metric names in state.log_history, transformers' callbacks,
epochs, evaluate(), save_model(), LoRA through peft_config, and a TRL 1.x script that runs after changing its import."""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from grpo_helpers import PROMPTS, config, count_good, dataset, length_reward, tokenizer, trainer, weights
from tiny_models import make_gpt2
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_lite import GRPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


class Spy:
    """A reward function that records what it is given."""

    def __init__(self):
        self.__name__ = "spy"
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append({"prompts": prompts, "completion_ids": completion_ids, **kwargs})
        return [0.1 * len(ids) for ids in completion_ids]


def test_prompts_come_shuffled_with_the_seed_in_whole_groups_each_epoch(tmp_path):
    spy = Spy()
    run = trainer(tmp_path, reward_funcs=(spy,), max_steps=-1, num_train_epochs=2, seed=5)
    run.train()
    assert run.state.global_step == 8  # 8 prompts, 2 per generation, 2 epochs
    prompts = [p for call in spy.calls for p in call["prompts"]]
    groups = [prompts[i : i + 4] for i in range(0, len(prompts), 4)]
    assert all(len(set(g)) == 1 for g in groups)  # each prompt's 4 completions side by side
    order = [g[0] for g in groups]
    want = [PROMPTS[i] for e in (0, 1) for i in torch.randperm(8, generator=torch.Generator().manual_seed(5 + e)).tolist()]
    assert order == want
    assert run.state.epoch == 2.0
    in_order = Spy()
    trainer(tmp_path, reward_funcs=(in_order,), max_steps=4, shuffle_dataset=False).train()
    assert [c["prompts"][0] for c in in_order.calls] == [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[6]]


def test_completions_stay_within_max_completion_length_and_truncated_ones_can_be_masked(tmp_path):
    spy = Spy()
    run = trainer(tmp_path, reward_funcs=(spy,), max_completion_length=3, mask_truncated_completions=True, max_steps=1)
    run.train()
    assert max(len(ids) for ids in spy.calls[0]["completion_ids"]) <= 3
    generation = run.rollout.run(run.prompts.next_rows())
    eos = run.processing_class.eos_token_id
    for response, mask in zip(generation.responses, generation.response_masks or [None] * 8):
        truncated = int(response[-1]) != eos
        assert mask is None or bool(mask.any()) == (not truncated)
    (metrics,) = run.rollout.metrics([generation.metric_rows], 4)
    assert metrics["completions/clipped_ratio"] == sum(int(r[-1]) != eos for r in generation.responses) / 8


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, dict(logs)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))


TRL_METRICS = {
    "num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
    "completions/max_terminated_length", "rewards/count_good/mean", "rewards/count_good/std", "reward", "reward_std",
    "frac_reward_zero_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "loss",
    "learning_rate", "epoch", "kl",
}  # fmt: skip


def test_logs_have_trls_names_and_callbacks_see_steps_logs_and_saves(tmp_path):
    recorder = Recorder()
    run = trainer(tmp_path, max_steps=4, logging_steps=2, save_strategy="steps", save_steps=2, beta=0.05,
                  gradient_accumulation_steps=2, per_device_train_batch_size=4)  # fmt: skip
    run.add_callback(recorder)
    output = run.train()
    assert output.global_step == 4
    assert [e[0] for e in recorder.events] == ["step_end", "step_end", "log", "save"] * 2
    assert [entry["step"] for entry in run.state.log_history] == [2, 4]
    assert set(run.state.log_history[0]) == TRL_METRICS | {"step"}
    logged = recorder.events[2][2]
    assert logged == {k: v for k, v in run.state.log_history[0].items() if k != "step"}
    # the window's mean: 2 generations per log here (each one optimizer step)
    assert logged["num_tokens"] > 0 and 0.0 <= logged["completions/clipped_ratio"] <= 1.0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]


def test_the_learning_rate_follows_transformers_scheduler(tmp_path):
    run = trainer(tmp_path, max_steps=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1)
    run.train()
    # linear with 1 warmup step over 4: after steps 1..4 the rate is 1, 2/3, 1/3, 0 of the peak
    rates = [entry["learning_rate"] for entry in run.state.log_history]
    assert rates == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3, 0.0])


def test_evaluate_reports_eval_metrics_without_changing_weights(tmp_path):
    run = trainer(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    run.eval_dataset = dataset(4)
    run.train()
    assert any("eval_reward" in entry for entry in run.state.log_history)
    before = weights(run)
    results = run.evaluate()
    assert {"eval_reward", "eval_reward_std", "eval_rewards/count_good/mean", "eval_completions/mean_length"} <= set(results)
    assert all(torch.equal(before[k], v) for k, v in weights(run).items())
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval_dataset"):
        trainer(tmp_path / "no_eval").evaluate()


def test_save_model_writes_a_model_from_pretrained_loads(tmp_path):
    run = trainer(tmp_path, max_steps=1)
    run.train()
    run.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    trained = weights(run)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_a_lora_policy_from_peft_config_trains_only_its_adapter(tmp_path):
    from peft import LoraConfig

    base = make_gpt2()
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    run = GRPOTrainer(
        model=base, reward_funcs=[count_good, length_reward], train_dataset=dataset(), processing_class=tokenizer(),
        args=config(tmp_path, max_steps=2, beta=0.1, learning_rate=5e-2, save_strategy="steps", save_steps=2),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0),
    )  # fmt: skip
    run.train()
    state = run.model.state_dict()
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and any(bool(v.abs().sum() > 0) for v in lora_b)  # B starts at zero: it trained
    base_now = run.model.get_base_model().state_dict()
    for name, value in frozen.items():
        key = name.replace("c_attn.weight", "c_attn.base_layer.weight").replace("c_attn.bias", "c_attn.base_layer.bias")
        assert torch.equal(base_now[key], value), name
    assert os.path.isfile(tmp_path / "checkpoint-2" / "adapter_config.json")


def test_the_adapter_of_peft_config_is_drawn_from_args_seed(tmp_path):
    from peft import LoraConfig

    def initial_adapter(seed):
        base = make_gpt2()  # seeds torch itself: the generator is set at random below, as a fresh process finds it
        torch.seed()
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
        run = GRPOTrainer(model=base, reward_funcs=[count_good], train_dataset=dataset(), processing_class=tokenizer(),
                          args=config(tmp_path, seed=seed), peft_config=lora)  # fmt: skip
        return {k: v.clone() for k, v in run.model.state_dict().items() if "lora_A" in k}

    first, again, other = initial_adapter(3), initial_adapter(3), initial_adapter(4)
    assert first and first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first)


TRL_SCRIPT = """
from datasets import Dataset
from trl_lite import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

dataset = Dataset.from_dict({"prompt": ["the movie was", "i loved the", "this film is", "a story that"],
                             "solution": ["good", "good", "bad", "fine"]})

def accuracy(completions, solution, **kwargs):
    return [float(s in c.split()) for c, s in zip(completions, solution)]

def brevity(completions, **kwargs):
    return [-len(c.split()) / 10 for c in completions]

training_args = GRPOConfig(output_dir=OUTPUT, num_generations=4, per_device_train_batch_size=4,
                           max_completion_length=8, max_steps=2, logging_steps=1, save_steps=2, report_to="none")
trainer = GRPOTrainer(model=MODEL, reward_funcs=[accuracy, brevity], args=training_args, train_dataset=dataset)
trainer.train()
trainer.save_model(OUTPUT)
print("LOGGED", sorted(trainer.state.log_history[-1]))
"""


def test_a_trl_1x_script_runs_after_changing_only_its_import(tmp_path):
    model_dir = tmp_path / "tiny-model"
    make_gpt2().save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    script = tmp_path / "train_grpo.py"
    script.write_text(f"OUTPUT = {str(tmp_path / 'out')!r}\nMODEL = {str(model_dir)!r}\n" + textwrap.dedent(TRL_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'rewards/accuracy/mean'" in done.stdout and "'rewards/brevity/mean'" in done.stdout
    assert "checkpoint-2" in os.listdir(tmp_path / "out")
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_the_logged_generation_metrics_match_a_float64_recount(tmp_path):
    spy = Spy()

    def maybe(prompts, completions, completion_ids, **kwargs):
        return [None if len(ids) % 3 == 0 else float(ids[0] % 5) for ids in completion_ids]

    run = trainer(tmp_path, reward_funcs=(spy, maybe), max_steps=1, reward_weights=[2.0, 0.5],
                  max_completion_length=4, log_completions=True)  # fmt: skip
    run.train()
    logged = run.state.log_history[0]
    ids = spy.calls[0]["completion_ids"]
    eos = run.processing_class.eos_token_id
    lengths = np.array([len(i) for i in ids], dtype=np.float64)
    truncated = np.array([i[-1] != eos for i in ids])
    first = np.array([0.1 * len(i) for i in ids])
    second = np.array([math.nan if len(i) % 3 == 0 else float(i[0] % 5) for i in ids])
    total = 2.0 * first + np.where(np.isnan(second), 0.0, 0.5 * second)  # NaN counts as absent
    want = {
        "completions/mean_length": lengths.mean(), "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.mean(), "rewards/spy/mean": first.mean(),
        "rewards/spy/std": first.std(ddof=1), "reward": total.mean(), "reward_std": total.std(ddof=1),
        "frac_reward_zero_std": np.mean([np.std(g) < 1e-8 for g in total.reshape(-1, 4)]),
        "num_tokens": float(sum(len(run.processing_class(p)["input_ids"]) for p in spy.calls[0]["prompts"]) + lengths.sum()),
    }  # fmt: skip
    present = second[~np.isnan(second)]
    if len(present) > 1:
        want["rewards/maybe/mean"], want["rewards/maybe/std"] = present.mean(), present.std(ddof=1)
    assert {k: logged[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
    # log_completions: the table of the last generation, with every function's rewards
    assert run._last_table["completion"] and set(run._last_table) == {"prompt", "completion", "spy", "maybe"}


def test_an_iterable_dataset_is_read_in_order_and_needs_max_steps(tmp_path):
    from datasets import IterableDataset

    def rows():
        for prompt in PROMPTS[:6]:
            yield {"prompt": prompt}

    spy = Spy()
    run = trainer(tmp_path, reward_funcs=(spy,), train_dataset=IterableDataset.from_generator(rows), max_steps=4)
    run.train()
    # 3 generations of 2 prompts per pass over the 6 rows, then the next pass from the start
    assert [c["prompts"][0] for c in spy.calls] == [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[0]]
    assert [c["prompts"][4] for c in spy.calls] == [PROMPTS[1], PROMPTS[3], PROMPTS[5], PROMPTS[1]]
    with pytest.raises(ValueError, match="max_steps must be set"):
        trainer(tmp_path, train_dataset=IterableDataset.from_generator(rows), max_steps=-1)
