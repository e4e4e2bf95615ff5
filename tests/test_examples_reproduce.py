"""Examples print the same results from the same seed: each runs twice, each time in a fresh process (torch's
default generator seeded at random, as in any process) with a different Python hash seed, and the trained weights
and the printed numbers must match exactly. grpo_trainer_smollm2.py's check is in tests/test_grpo_trainer_example.py."""

import json
import subprocess
import sys

from test_examples import ROOT, SCRIPTS, example_env

ARITHMETIC = ["--sft_steps", "20", "--steps", "2", "--num_grpo", "64", "--num_heldout", "64", "--eval_every", "1"]


def run_twice(name: str, *args: str, output_dirs=(None, None)) -> list[str]:
    """stdout of two runs of `examples/scripts/<name> args` (hash seeds 1 and 2), each exiting 0; `output_dirs`: the
    `--output_dir` of each run, or None for none."""
    outputs = []
    for hash_seed, output_dir in zip(("1", "2"), output_dirs):
        flags = [*args, "--output_dir", str(output_dir)] if output_dir is not None else list(args)
        done = subprocess.run([sys.executable, str(SCRIPTS / name), *flags], cwd=ROOT, capture_output=True, text=True,
                              env={**example_env(), "PYTHONHASHSEED": hash_seed}, timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        outputs.append(done.stdout)
    return outputs


def test_custom_rollout_loop_prints_the_same_rewards_from_its_seed():
    first, again = run_twice("custom_rollout_loop.py")
    assert first.count("mean reward") == 30
    assert again == first


def test_grpo_arithmetic_trains_the_same_weights_from_its_seed(tmp_path):
    dirs = (tmp_path / "first", tmp_path / "again")
    run_twice("grpo_arithmetic.py", *ARITHMETIC, output_dirs=dirs)
    for model in ("sft_model", "model"):
        first, again = (directory / model / "model.safetensors" for directory in dirs)
        assert again.read_bytes() == first.read_bytes(), model

    def results(directory):  # metrics.json less the times
        metrics = json.loads((directory / "metrics.json").read_text())
        records = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in metrics.pop("records")]
        return records, {k: v for k, v in metrics.items() if not k.endswith("_seconds")}

    assert results(dirs[1]) == results(dirs[0])
    assert results(dirs[0])[0]
