"""The add-on examples run end to end: the offline PPO calculator (``TextEnvironment`` + ``step`` with
response masks) and best-of-n sampling (``BestOfNSampler``)."""

import json
import subprocess
import sys
from pathlib import Path

from test_examples import example_env

ROOT = Path(__file__).resolve().parents[1]


def test_ppo_calculator_tool_runs_and_writes_its_metrics(tmp_path):
    args = ["--sft_steps", "40", "--ppo_steps", "3", "--batch_size", "8", "--mini_batch_size", "4", "--output_dir", str(tmp_path)]
    result = subprocess.run([sys.executable, str(ROOT / "examples/scripts/ppo_calculator_tool.py"), *args],
                            cwd=ROOT, env=example_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["env/reward_mean"] <= 1.0 and 0.0 <= r["env/tool_use"] <= 1.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["window"] == 1
    assert summary["first_reward"] == records[0]["env/reward_mean"] and summary["last_reward"] == records[-1]["env/reward_mean"]
    assert "mean reward: first 1 steps" in result.stdout


def test_best_of_n_sentiment_runs_and_reports_its_means(tmp_path):
    out = tmp_path / "means.json"
    args = ["--sft_steps", "20", "--reward_model_steps", "20", "--num_prompts", "6", "--offline_models_dir", str(tmp_path / "models"),
            "--output_json", str(out)]
    result = subprocess.run([sys.executable, str(ROOT / "examples/scripts/best_of_n_sentiment.py"), *args],
                            cwd=ROOT, env=example_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    means = json.loads(out.read_text())
    assert set(means) == {"base model", "best of 4"}
    assert "best of 4: mean reward" in result.stdout and "over 6 prompts" in result.stdout
