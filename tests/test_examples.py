"""The examples run end to end: the sentiment script, the custom rollout loop and the walkthrough notebook.

Scripts run in subprocesses with this interpreter (`sys.executable`); the notebook runs in a kernel
started from this interpreter too, through a temporary kernel spec, so no kernel needs installing.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "scripts"
METRIC_KEYS = ("env/reward_mean", "env/reward_std", "objective/kl", "objective/kl_coef", "ppo/loss/total")
# A run small enough for a test: tiny SFT and reward-model stages, batches of 8, a few steps.
SMALL_RUN = ["--sft_steps", "20", "--reward_model_steps", "20", "--batch_size", "8", "--mini_batch_size", "4"]
SMALL_RUN += ["--num_samples", "2", "--plot_every", "1"]


def example_env() -> dict:
    """The environment of example subprocesses: offline, one thread each (tests run two at a time)."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """Run `examples/scripts/<name>` with `args`; fail with its output if it exits non-zero."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, env=example_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ppo_sentiment_writes_outputs_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = run_script(
        "ppo_sentiment.py", *SMALL_RUN, "--steps", "3", "--save_every", "2", "--log_with", "tensorboard",
        "--output_dir", str(out),
    )  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert all(math.isfinite(record[key]) for key in METRIC_KEYS)
        # No score shaping is configured, so the trainer's mean score is the mean reward the script logged.
        assert record["env/reward_mean"] == pytest.approx(record["ppo/mean_scores"], rel=1e-5, abs=1e-6)
    assert records[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tensorboard_tags = set()
    for events in (out / "runs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tensorboard_tags |= set(accumulator.Tags()["scalars"])
    assert {"env/reward_mean", "objective/kl", "ppo/loss/total"} <= tensorboard_tags
    assert "before PPO (reference)" in first.stdout and "after PPO (policy)" in first.stdout

    tuned = AutoModelForCausalLMWithValueHead.from_pretrained(out / "model")
    sft = AutoModelForCausalLMWithValueHead.from_pretrained(out / "offline_models" / "sft_model")
    tuned_weights, sft_weights = tuned.pretrained_model.state_dict(), sft.pretrained_model.state_dict()
    assert tuned_weights.keys() == sft_weights.keys()
    assert any(not torch.equal(tuned_weights[k], sft_weights[k]) for k in tuned_weights), "PPO changed nothing"

    # Resume from the step-2 checkpoint and run to step 4: step 3 is trained again, exactly as before.
    run_script("ppo_sentiment.py", *SMALL_RUN, "--steps", "4", "--resume_from", str(out / "checkpoint"), "--output_dir", str(out))
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == records[:2]
    for key in ("env/reward_mean", "objective/kl", "objective/kl_coef", "ppo/loss/total"):
        assert resumed[2][key] == pytest.approx(records[2][key], rel=1e-4, abs=1e-6), key


def test_ppo_sentiment_loads_models_and_data_by_name(tmp_path):
    """The hub code path (--model_name, --reward_model, --dataset_name) on local directories."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import tiny_sentiment
    finally:
        sys.path.remove(str(SCRIPTS))
    tiny_sentiment.build_offline_models(tmp_path / "models", sft_steps=5, reward_model_steps=5)
    data_dir = tmp_path / "reviews"
    data_dir.mkdir()
    reviews = tiny_sentiment.load_reviews()[:40]
    (data_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reviews))

    out = tmp_path / "run"
    result = run_script(
        "ppo_sentiment.py", *SMALL_RUN, "--steps", "2", "--output_dir", str(out),
        "--model_name", str(tmp_path / "models" / "sft_model"),
        "--reward_model", "sentiment-analysis:" + str(tmp_path / "models" / "reward_model"),
        "--query_dataset", str(data_dir),
    )  # fmt: skip
    assert "SFT stage" not in result.stdout  # nothing was trained offline
    assert not (out / "offline_models").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_ppo_sentiment_flags_keep_ppo_configs_meaning():
    """--reward_model is PPOConfig's `task:model` (a bare name: the sentiment-analysis task); --dataset_name is
    --query_dataset's other name, and the two given differently are refused, not one silently overwritten."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import ppo_sentiment
    finally:
        sys.path.remove(str(SCRIPTS))
    assert ppo_sentiment.reward_task_and_model("sentiment-analysis:lvwerra/distilbert-imdb") == (
        "sentiment-analysis", "lvwerra/distilbert-imdb")
    assert ppo_sentiment.reward_task_and_model("text-classification:dir") == ("text-classification", "dir")
    assert ppo_sentiment.reward_task_and_model("lvwerra/distilbert-imdb") == (
        "sentiment-analysis", "lvwerra/distilbert-imdb")
    with pytest.raises(ValueError, match="reward_model must be 'task:model'"):
        ppo_sentiment.reward_task_and_model("sentiment-analysis:")
    args = ppo_sentiment.ScriptArguments(dataset_name="a")
    assert ppo_sentiment.query_dataset(args, PPOConfig(query_dataset=None)) == "a"
    assert ppo_sentiment.query_dataset(args, PPOConfig(query_dataset="a")) == "a"
    assert ppo_sentiment.query_dataset(ppo_sentiment.ScriptArguments(), PPOConfig(query_dataset="b")) == "b"
    with pytest.raises(ValueError, match="--dataset_name .* and --query_dataset .* give one of them"):
        ppo_sentiment.query_dataset(args, PPOConfig(query_dataset="b"))


def test_ppo_sentiment_trains_a_separate_critic(tmp_path):
    """--value_model: a one-label classifier over the policy's tokenizer (here the SFT model's backbone
    with a fresh score head, as a reward model would be) becomes a critic that the run trains and saves."""
    from transformers import GPT2ForSequenceClassification

    sys.path.insert(0, str(SCRIPTS))
    try:
        import tiny_sentiment
    finally:
        sys.path.remove(str(SCRIPTS))
    models = tmp_path / "models"
    tiny_sentiment.build_offline_models(models, sft_steps=5, reward_model_steps=5)
    torch.manual_seed(0)
    critic = GPT2ForSequenceClassification.from_pretrained(models / "sft_model", num_labels=1)
    critic.config.pad_token_id = critic.config.eos_token_id
    critic.save_pretrained(tmp_path / "critic")

    out = tmp_path / "run"
    run_script(
        "ppo_sentiment.py", *SMALL_RUN, "--steps", "2", "--output_dir", str(out),
        "--model_name", str(models / "sft_model"), "--reward_model", str(models / "reward_model"),
        "--value_model", str(tmp_path / "critic"),
    )  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["ppo/loss/value"]) for r in records)
    trained = GPT2ForSequenceClassification.from_pretrained(out / "model" / "value_model").state_dict()
    initial = critic.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the critic was not trained"


def test_ppo_sentiment_on_vllm_passes_the_engine_logprobs_to_step(tmp_path):
    """--use_vllm: a colocated engine (in the script's process) generates, and its log-probs reach
    step(): the logged gap to the policy's is that of one fp32 model read by two implementations."""
    out = tmp_path / "run"
    run_script("ppo_sentiment.py", *SMALL_RUN, "--steps", "2", "--use_vllm", "--vllm_kv_cache_gb", "1",
               "--output_dir", str(out))  # fmt: skip
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(math.isfinite(record[key]) for key in METRIC_KEYS)
        # Present only when step() got generation_logprobs; the engine samples from the current policy.
        assert 0 <= record["rollout/logprob_diff/mean"] <= record["rollout/logprob_diff/max"] < 1e-3


@pytest.mark.parametrize("flags", [[], ["--use_vllm"]], ids=["transformers", "vllm"])
def test_custom_rollout_loop_learns_its_reward(flags):
    result = run_script("custom_rollout_loop.py", *flags)
    assert "No dataset is provided" not in result.stderr  # it batches its own prompts and says so to warnings
    rewards = [float(x) for x in re.findall(r"mean reward ([-\d.]+)", result.stdout)]
    assert len(rewards) == 30
    # The share of "yes" starts near chance (1/16 of the vocabulary) and must clearly grow.
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3


def test_walkthrough_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # A kernel spec that starts this interpreter, found first through JUPYTER_PATH: works in a fresh
    # virtual environment with no kernel installed, and never picks another Python.
    spec_dir = tmp_path / "kernels" / "trl-lite-test"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps({**spec, "display_name": "trl_lite tests"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    for key, value in example_env().items():
        monkeypatch.setenv(key, value)

    path = ROOT / "examples" / "notebooks" / "ppo_sentiment_walkthrough.ipynb"
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="trl-lite-test", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    stdout = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    first, last = map(float, re.search(r"first 5 steps: ([-\d.]+) - last 5 steps: ([-\d.]+)", stdout).groups())
    assert last > first + 1.0, f"mean reward did not climb: {first} -> {last}"
