"""The tool-use examples run end to end: the offline PPO calculator (``TextEnvironment`` + ``step`` with response masks)."""

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
