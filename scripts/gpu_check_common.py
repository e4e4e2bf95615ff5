"""What every row of `gpu_check.py` uses: the processes it starts (their environment, their time limit, the
result a ``--worker`` prints) and the trainer and batch the in-process checks run."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import warnings
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_MARKER = "GPU_CHECK_RESULT "
VOCAB_SIZE = 50257  # GPT-2's: the LM head is the largest product of the step, and no other dimension equals it


def child_env() -> dict:
    """The environment of the processes the checks start: the checkout first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else "")}


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def run_process(command: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess | None:
    """Run ``command`` in the checkout with :func:`child_env`, its output (stdout and stderr) in ``log``.

    Past ``timeout`` seconds the process and everything it started (launchers start workers in sessions of
    their own) are killed and ``None`` is returned: a row cut short must not leave processes on the GPU.
    """
    with subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:  # fmt: skip
        try:
            output, _ = process.communicate(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(process.pid), process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            output, _ = process.communicate()
            log.write_text(output)
            return None
    log.write_text(output)
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def worker_result(result: subprocess.CompletedProcess | None) -> dict | None:
    """The JSON a ``--worker`` process printed after ``WORKER_MARKER`` (its last such line), or ``None``."""
    if result is None or result.returncode != 0:
        return None
    lines = [line for line in result.stdout.splitlines() if line.startswith(WORKER_MARKER)]
    return json.loads(lines[-1][len(WORKER_MARKER) :]) if lines else None


# ----------------------------------------------------------------------------------------------
# The trainer the checks run: a 2-layer GPT-2 with GPT-2's vocabulary, on the GPU.
# ----------------------------------------------------------------------------------------------
def make_trainer(mixed_precision: str = "bf16", sleep: bool | None = None, **config):
    from transformers import GPT2Config, GPT2LMHeadModel

    from trl_lite import AutoModelForCausalLMWithValueHead, NoDatasetWarning, PPOConfig, PPOTrainer

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=256, n_embd=256, n_layer=2, n_head=4))
    config.setdefault("disable_dropout", True)  # GPT-2's attention dropout keeps training passes off the kernel
    ppo_config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=1, seed=0,
                           accelerator_kwargs={"mixed_precision": mixed_precision}, **config)  # fmt: skip
    if sleep is not None:
        ppo_config.vllm_enable_sleep_mode = sleep
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoDatasetWarning)  # the checks pass their own batches
        return PPOTrainer(ppo_config, AutoModelForCausalLMWithValueHead.from_pretrained(lm), tokenizer=None)


@functools.lru_cache(maxsize=1)
def shared_trainer():
    """The bf16 trainer of ``bf16-step`` and ``syncs``, built once for both."""
    return make_trainer("bf16")


def make_batch(n: int = 8, seed: int = 0, group_size: int = 1):
    """``n`` queries (8-15 tokens), responses (16-31 tokens) and scores; ``group_size`` consecutive rows share
    their query (the groups of GRPO)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 16, (n,), generator=g).tolist(), torch.randint(16, 32, (n,), generator=g).tolist()
    lengths = [lengths[0][i - i % group_size] for i in range(n)], lengths[1]
    queries = [torch.randint(0, VOCAB_SIZE - 1, (k,), generator=g) for k in lengths[0]]
    queries = [queries[i - i % group_size] for i in range(n)]
    responses = [torch.randint(0, VOCAB_SIZE - 1, (k,), generator=g) for k in lengths[1]]
    return queries, responses, [torch.randn((), generator=g) for _ in range(n)]
