"""scripts/gpu_check.py (`make gpu-check`) on a machine without a GPU: it refuses in one line with
exit status 2, and the parts of its checks that need no GPU - the dtype of the LM head's matrix
products as they reach the kernels, the sync warnings by source line, pytest's summary - are right."""

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_without_a_gpu_it_refuses_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine that has one
    result = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check needs a CUDA GPU")
    assert "torch.cuda.is_available() is False" in lines[0]


def test_the_lm_head_products_are_seen_with_the_dtypes_the_kernels_get():
    torch.manual_seed(0)
    head, other = torch.nn.Linear(16, 101), torch.nn.Linear(16, 16)
    hidden = torch.randn(6, 16, requires_grad=True)
    with gpu_check.MatmulDtypes(101) as autocast_products:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(other(hidden))
        logits.float().logsumexp(-1).sum().backward()
    # Forward addmm, then the two backward products of the head (input and weight gradients);
    # the 16 x 16 layer has no dimension of 101 and is not counted.
    assert [op for op, _ in autocast_products.seen] == ["addmm", "mm", "mm"]
    assert all(set(dtypes) == {"bfloat16"} for _, dtypes in autocast_products.seen)
    with gpu_check.MatmulDtypes(101) as plain_products:
        head(hidden).sum().backward()
    assert len(plain_products.seen) == 3 and all(set(d) == {"float32"} for _, d in plain_products.seen)


def test_sync_warnings_are_counted_by_source_line_and_other_warnings_left_out():
    def record(message, path, line):
        return warnings.WarningMessage(UserWarning(message), UserWarning, str(REPO / path), line)

    records = [
        record("called a synchronizing CUDA operation", "trl_lite/trainer/learner.py", 40),
        record("called a synchronizing CUDA operation", "trl_lite/trainer/learner.py", 40),
        record("Called a synchronizing CUDA operation", "trl_lite/core/stats.py", 7),
        record("PPOTrainer got no dataset", "trl_lite/trainer/ppo_trainer.py", 1),
    ]
    assert gpu_check.sync_sites(records) == {"trl_lite/trainer/learner.py:40": 2, "trl_lite/core/stats.py:7": 1}


def test_the_summary_and_the_table():
    output = "....F.\n=== 1 failed, 512 passed, 3 deselected in 301.2s ===\n"
    assert gpu_check.pytest_summary(output) == "1 failed, 512 passed, 3 deselected"
    assert gpu_check.pytest_summary("ImportError") == "no summary"
    table = gpu_check.format_table([("syncs", "INFO", "a|b"), ("suite", "PASS", "513 passed")])
    assert table.splitlines() == [
        "| check | result | detail |", "|---|---|---|", "| syncs | INFO | a/b |", "| suite | PASS | 513 passed |",
    ]  # fmt: skip
