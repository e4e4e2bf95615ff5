"""The out-of-memory back-off on 2 processes (CPU, gloo), the error injected on rank 1 only (docs/out_of_memory.md).

A failure before a backward batch's synchronising pass - a forward under DDP (even the forward of the pass whose
backward reduces the gradients), the backward of a pass under ``no_sync``, the first forward of a backward batch
under ZeRO-2 - is agreed on by both processes, which redo the backward batch with the same halved budget and
take the step of the run without the failure. A failure that cannot be redone (inside the gradient-reducing
backward under DDP, after a ZeRO-2 backward of the same backward batch, any forward of a sequence-parallel
group or under FSDP2) ends both processes with an error, not a hang; a plain error there is reported as it is, not as a lack of
memory. After a back-off, the classic batched_forward_pass runs on one process alone. Script:
tests/distributed/oom_backoff_step.py.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.xdist_group("distributed")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "distributed" / "oom_backoff_step.py"


@pytest.fixture(scope="module", autouse=True)
def deepspeed_cpu_collectives():
    """DeepSpeed's CPU collective op, built once before any launch (see tests/test_distributed.py)."""
    if not torch.cuda.is_available():
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


def _launch(config: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out.mkdir()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "2", "--main_process_port", str(port),
        str(SCRIPT), "--output_dir", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    # Generous: only a hang should run into it (a fatal run ends as soon as the failed process has exited).
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _result(config: str, out: Path, *args: str) -> dict:
    run = _launch(config, out, *args)
    assert run.returncode == 0, f"{config} {args} failed:\n{run.stdout[-3000:]}\n{run.stderr[-8000:]}"
    return torch.load(out / "result.pt")


def test_a_failure_on_one_process_is_redone_by_both_with_the_same_step(tmp_path):
    clean = _result("multi_gpu", tmp_path / "clean")
    assert clean["budgets"] == [0.0, 0.0] and clean["stats"]["memory/oom_retries"] == 0
    runs = {
        # Then rank 0 alone runs the classic batched_forward_pass under the budget the back-off left.
        "ddp_synchronising_forward": ("multi_gpu", "--inject", "forward", "--call", "1", "--classic_alone", "1"),
        "ddp_no_sync_backward": ("multi_gpu", "--inject", "backward", "--call", "0"),
        "zero2_first_forward": ("deepspeed_zero2", "--inject", "forward", "--call", "0"),
    }
    want = clean["named_parameters"]
    for name, (config, *args) in runs.items():
        got = _result(config, tmp_path / name, *args)
        budget = got["budgets"][0]
        assert got["budgets"] == [budget, budget] and budget > 0, (name, got["budgets"])
        assert got["stats"]["memory/oom_retries"] == 1 and got["stats"]["memory/max_tokens_per_minibatch"] == budget
        assert got["stats"]["ppo/minibatches"] > clean["stats"]["ppo/minibatches"], name
        assert got["stats"]["ppo/loss/policy"] == pytest.approx(clean["stats"]["ppo/loss/policy"], rel=1e-5, abs=1e-6)
        max_diff = max((got["named_parameters"][k] - want[k]).abs().max().item() for k in want)
        assert max_diff <= 1e-6, f"{name}: max abs weight difference {max_diff:.3g}"
    # Alone, it split its rows by itself (no collective to wait in): a log-prob (< 0) at every response token.
    classic = torch.load(tmp_path / "ddp_synchronising_forward" / "result.pt")
    assert classic["classic_budget"] == classic["budgets"][0] > 0
    logprobs, masks = classic["classic"]
    assert masks.sum() == classic["response_tokens"] > 0
    assert torch.isfinite(logprobs).all() and (logprobs[masks.bool()] < 0).all()


@pytest.mark.parametrize(
    "config, args, rank0_says, restart_with",
    [
        ("multi_gpu", ("--inject", "backward", "--call", "1"), "Process 0 failed inside a collective of a training backward",
         6),
        ("deepspeed_zero2", ("--inject", "forward", "--call", "1"), "cannot be redone", 6),
        # FSDP2: every forward gathers the blocks' shards, every backward reduce-scatters (as ZeRO-3).
        ("fsdp2", ("--inject", "forward", "--call", "0"), "Process 0 failed inside a collective of a training forward", 9),
        # Sequence parallelism: every forward exchanges attention inputs within the group (of 2 processes that
        # share the 8 rows: the failed first pass held 18 tokens).
        ("deepspeed_sequence_parallel", ("--inject", "forward", "--call", "0", "--sp_size", "2"),
         "Process 0 failed inside a collective of a training forward", 9),
    ],
)  # fmt: skip
def test_a_failure_that_cannot_be_redone_ends_both_processes_with_an_error(tmp_path, config, args, rank0_says,
                                                                          restart_with):  # fmt: skip
    """Inside DDP's gradient-reducing backward, after a ZeRO-2 backward of the backward batch, or in any forward of a
    sequence-parallel group: both processes end with an error naming the cause (a hang would run into the launch's
    timeout)."""
    run = _launch(config, tmp_path / "run", *args)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "[rank1]: torch.OutOfMemoryError:" in output and f"max_tokens_per_minibatch={restart_with} or lower" in output
    # Rank 0 names the broken collective - unless the launcher, seeing rank 1 gone, stopped it first (on a loaded
    # machine it can run before rank 0's socket reports the closed connection): then torchrun says so.
    stopped_by_launcher = "Signal 15 (SIGTERM) received by PID" in output
    assert rank0_says in output or stopped_by_launcher, output[-3000:]
    assert not (tmp_path / "run" / "result.pt").exists()


def test_a_plain_error_in_a_collective_forward_is_not_called_out_of_memory(tmp_path):
    """A bug (a plain RuntimeError) in a forward of a sequence-parallel group on rank 1: rank 1 reports it as it is;
    rank 0, whose attention exchange the failure broke, says it failed inside a collective."""
    run = _launch("deepspeed_sequence_parallel", tmp_path / "run", "--inject", "bug", "--call", "0", "--sp_size", "2")
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "[rank1]: RuntimeError: Injected: mat1 and mat2 shapes cannot be multiplied" in output
    assert "Process 1 failed inside a collective" not in output and "OutOfMemoryError" not in output
    assert "Process 0 failed inside a collective of a training forward" in output
