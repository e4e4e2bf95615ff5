"""GRPOTrainer's checkpoints resume exactly: N optimizer steps straight, and k steps then a new trainer resuming
from ``checkpoint-k`` (in this process, and in a new process after a SIGKILL right after a save or half way through
one), end with the same weights bit for bit and the same logs - on GPT-2 and on a tiny rotary GQA model (Qwen2)."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback
from grpo_helpers import count_good, length_reward, trainer, weights
from test_grpo_trainer_tools import environment_trainer
from tiny_models import make_gpt2, make_qwen2

HERE = os.path.dirname(os.path.abspath(__file__))
REWARDS = (count_good, length_reward)


def assert_same_weights(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("model", ["gpt2", "qwen2"])
def test_resume_from_a_checkpoint_ends_bit_identical_to_the_straight_run(tmp_path, model):
    # beta > 0 (a reference pass), two iterations and two passes per generation, a scheduler with warmup
    overrides = dict(max_steps=6, beta=0.1, num_iterations=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     lr_scheduler_type="cosine", warmup_steps=2, save_strategy="steps", save_steps=2, weight_decay=0.1)  # fmt: skip
    straight = trainer(tmp_path / "straight", model=model, reward_funcs=REWARDS, **overrides)
    straight.train()
    assert straight.state.global_step == 6

    first = trainer(tmp_path / "resumed", model=model, reward_funcs=REWARDS, **{**overrides, "max_steps": 6})
    class StopAt(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    first.add_callback(StopAt())
    first.train()
    assert first.state.global_step == 2
    assert sorted(os.listdir(tmp_path / "resumed")) == ["checkpoint-2"]

    resumed = trainer(tmp_path / "resumed", model=model, reward_funcs=REWARDS, **overrides)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert resumed.state.global_step == 6
    assert_same_weights(weights(resumed), weights(straight))
    assert resumed.state.log_history == straight.state.log_history
    assert resumed.lr_scheduler.state_dict()["last_epoch"] == straight.lr_scheduler.state_dict()["last_epoch"]


def test_a_resumed_run_with_tools_and_environments_ends_bit_identical_to_the_straight_run(tmp_path):
    # multi-turn completions (environment_factory): tool tokens out of the loss, one environment per completion
    straight = environment_trainer(tmp_path / "straight")
    straight.train()
    first = environment_trainer(tmp_path / "resumed")

    class StopAt(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 1

    first.add_callback(StopAt())
    first.train()
    resumed = environment_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-1"))
    assert resumed.state.global_step == straight.state.global_step == 3
    assert_same_weights(weights(resumed), weights(straight))
    assert resumed.state.log_history == straight.state.log_history
    assert any(log["tools/call_frequency"] > 0 for log in straight.state.log_history)
    assert any(log["frac_reward_zero_std"] < 1 for log in straight.state.log_history)  # the weights moved


def _driver(tmp_path, model_dir, out, result, *flags):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    return subprocess.run([sys.executable, os.path.join(HERE, "grpo_resume_driver.py"), "--out", str(out), "--model",
                           str(model_dir), "--result", str(result), *flags], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.mark.parametrize("kill", [["--kill-after-save", "2"], ["--kill-in-save", "3"], ["--kill-after-save", "2", "--tools"]],
                         ids=["after_save", "inside_save", "tools_after_save"])  # fmt: skip
def test_a_run_killed_with_sigkill_resumes_in_a_new_process_bit_identical(tmp_path, kill):
    model_dir = tmp_path / "model"
    make_qwen2().save_pretrained(model_dir)
    tools = [flag for flag in kill if flag == "--tools"]
    done = _driver(tmp_path, model_dir, tmp_path / "straight", tmp_path / "straight.pt", *tools)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _driver(tmp_path, model_dir, tmp_path / "run", tmp_path / "killed.pt", *kill)
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = sorted(os.listdir(tmp_path / "run"))
    # killed inside the save of checkpoint-3: only its temporary folder exists, and resume takes checkpoint-2
    assert left == (["checkpoint-1", "checkpoint-2"] if kill[0] == "--kill-after-save" else ["checkpoint-1", "checkpoint-2", "checkpoint-3.tmp"])
    resumed = _driver(tmp_path, model_dir, tmp_path / "run", tmp_path / "resumed.pt", "--resume", *tools)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert_same_weights(got["weights"], want["weights"])
    assert got["log_history"] == want["log_history"]


def test_resume_true_takes_the_newest_whole_checkpoint_and_save_total_limit_keeps_the_newest(tmp_path):
    run = trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    run.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]
    again = trainer(tmp_path, max_steps=5, save_strategy="no")
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 5 and len(again.state.log_history) == 5


def test_resume_true_without_a_checkpoint_and_a_path_that_is_none_raise(tmp_path):
    run = trainer(tmp_path / "out")
    with pytest.raises(ValueError, match="holds no valid checkpoint"):
        run.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="is not a GRPOTrainer checkpoint"):
        run.train(resume_from_checkpoint=str(tmp_path))


def test_the_checkpoint_holds_a_model_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    run = trainer(tmp_path, model=make_gpt2(), max_steps=2, save_strategy="steps", save_steps=2)
    run.train()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    assert_same_weights({k: v for k, v in loaded.state_dict().items()},
                        {k: v for k, v in weights(run).items() if k in loaded.state_dict()})  # fmt: skip
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()
