"""`make gpu-check`: what a first session on a GPU machine must verify, in one command, as one table.

Runs with whatever Python has torch, transformers and accelerate (a GPU machine's own, without a package
index): ``python3 scripts/gpu_check.py`` from a checkout (the checkout is put on ``sys.path`` and on the
``PYTHONPATH`` of the processes it starts). ``--list`` prints every row with what it needs and how long it
takes. Rows (one each; ``--only`` and ``--skip`` pick them), in the order they run:

- ``device``: the GPU, the torch, CUDA and vLLM versions, and the optional packages that are missing.
- ``suite``: the test suite with the GPU visible (``pytest -m "not cpu_only"``, in parallel workers when
  pytest-xdist is there). Tests that hold only on a CPU machine are marked ``cpu_only``; tests that need a
  missing vLLM or nbformat are skipped with the reason (tests/conftest.py).
- ``bf16-step``: one ``PPOTrainer.step()`` under accelerate's ``mixed_precision="bf16"`` with fp32
  weights. Every matrix product that has the LM head's vocabulary dimension, forward and backward,
  must take bf16 operands (on a GPU: tensor-core GEMMs); the profile's GEMM kernels are listed.
- ``syncs``: the host-device synchronisations of one GAE ``step()`` and one GRPO ``step()`` (each after a
  warm-up step) under ``torch.cuda.set_sync_debug_mode("warn")``, per training mini-batch and by source line;
  more than ``SYNC_BUDGET`` per training mini-batch (the once-per-step syncs of ``sync_budget`` set aside) fails.
- ``gqa``: one varlen call with grouped key/value heads (8 query heads over 2), given the 2 heads unrepeated
  and given them repeated: equal outputs and gradients, or, where the kernel refuses unrepeated heads, the
  refusal (the trainer then repeats them, ``trl_lite.models.varlen_attention``).
- ``deepspeed``: one process under ``accelerate launch`` with DeepSpeed ZeRO-3 (``--full``: ZeRO-2 too) and
  bf16: one ``step()`` each on the batch of a plain bf16 step (its own process); the step's statistics and
  the weights' update must equal the plain step's within bf16 tolerance (``DEEPSPEED_*``).
- ``demo``: ``DEMO_STEPS`` steps of ``examples/scripts/ppo_sentiment.py`` under ``--mixed_precision bf16``
  with ``--disable_dropout True`` (every pass on the varlen kernel): seconds per PPO step (``time/ppo/total``
  plus the timed rollout phases, median after 2 warm-up steps) against ``DEMO_TARGET_S``.
- ``bench-step``, ``bench-loop``: ``benchmarks/bench_step.py --device cuda`` and ``benchmarks/bench_loop.py
  --device cuda`` on short settings (``--full``: their long ones), tables in the output directory.
- ``vllm-sleep``: a colocated vLLM engine, once with sleep mode and once without, each in a process
  of its own: the GPU memory in use during ``step()`` (``torch.cuda.mem_get_info``, sampled every
  5 ms) must drop by at least half the engine's share (``vllm_gpu_memory_utilization``) with sleep
  mode; after the step (a level-2 wake and a weight push) the engine's log-probs of its sampled
  tokens must equal the trained policy's to 1e-3 (float32). By default the engine with sleep mode only:
  the memory in use during ``step()`` above what was in use before the trainer was built must stay under
  half the engine's share.

The trainer of ``bf16-step`` and ``syncs`` is a 2-layer GPT-2 with GPT-2's dropout switched off
(``disable_dropout``): attention dropout would send every training pass row by row (the varlen kernel has
none); it is built once and shared by both rows.

A row whose optional package is missing is skipped with the reason. By default the whole run keeps
within ``--budget`` seconds (6 minutes): every row that starts a process gets the time left as its
limit, and a row with too little time left is skipped. The table is printed row by row as the checks
finish, so a run cut short still shows its rows; it is also written to ``<output-dir>/gpu_check.md``.

Exit status: 0 when no row failed, 1 when one did, 2 (one line on stderr) on a machine without a
CUDA GPU. Put the printed table in benchmarks/RESULTS.md.

Usage:
    python3 scripts/gpu_check.py [--list] [--full] [--only ROW ...] [--skip ROW ...] [--output-dir DIR]
        [--budget SECONDS] [--suite-args "-x ..."]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python3 scripts/gpu_check.py` from a checkout, without PYTHONPATH
    sys.path.insert(0, str(REPO_ROOT))

WORKER_MARKER = "GPU_CHECK_RESULT "
VOCAB_SIZE = 50257  # GPT-2's: the LM head is the largest product of the step, and no other dimension equals it
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
# Host-device synchronisations allowed per training mini-batch of a step (the row fails above).
SYNC_BUDGET = 2
# Seconds per PPO step of the demo to reach: the same demo on 2 CPU cores (2026-11-26).
DEMO_TARGET_S = 0.36
DEMO_STEPS = 10
# DeepSpeed's bf16 step against the plain bf16 step: statistics within DEEPSPEED_STATS_RTOL (relative) plus
# DEEPSPEED_STATS_ATOL, and the two weight updates pointing the same way (cosine) and of the same size.
# bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%); ZeRO also holds the module's weights in
# bf16 where plain AMP keeps them in fp32, so the two steps differ by more than one rounding.
DEEPSPEED_STATS = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "objective/entropy", "ppo/policy/approxkl")
DEEPSPEED_STATS_RTOL, DEEPSPEED_STATS_ATOL = 5e-2, 1e-2
DEEPSPEED_MIN_COSINE, DEEPSPEED_NORM_RTOL = 0.9, 0.2
DEEPSPEED_LEARNING_RATE = 1e-3  # an update well above bf16's rounding of the weights
GQA_RTOL = 1e-2  # the gqa row: unrepeated and repeated K/V calls agree to a few bf16 roundings
BASE_PACKAGES = ("torch", "transformers", "accelerate", "peft")
OPTIONAL_PACKAGES = ("vllm", "deepspeed", "datasets", "nbformat")


class Row(NamedTuple):
    """One row of the table: what it needs (importable packages) and about how long it takes on an H100
    (seconds, by default and with ``--full``)."""

    name: str
    needs: tuple[str, ...]
    seconds: int
    seconds_full: int
    what: str


ROWS = (
    Row("device", (), 1, 1, "the GPU, versions, missing optional packages"),
    Row("suite", ("pytest",), 150, 150, 'pytest -m "not cpu_only" tests, parallel workers with pytest-xdist'),
    Row("bf16-step", (), 20, 20, "one bf16 AMP step: LM-head products in bf16"),
    Row("syncs", (), 10, 10, f"host syncs of a GAE and a GRPO step, FAIL above {SYNC_BUDGET} per training mini-batch"),
    Row("gqa", (), 5, 5, "varlen with grouped K/V heads unrepeated = repeated (outputs, gradients)"),
    Row("deepspeed", ("deepspeed",), 45, 60, "ZeRO-3 (--full: and ZeRO-2), one process, bf16: one step = the plain step"),
    Row("demo", ("datasets", "matplotlib"), 25, 25,
        f"{DEMO_STEPS} steps of ppo_sentiment.py in bf16, seconds per PPO step (target < {DEMO_TARGET_S})"),
    Row("bench-step", (), 20, 300, "benchmarks/bench_step.py --device cuda (w1 short; --full: w1 w2 w3)"),
    Row("bench-loop", (), 15, 120, "benchmarks/bench_loop.py --device cuda (1 iteration; --full: 3)"),
    Row("vllm-sleep", ("vllm",), 60, 120, "colocated vLLM with sleep mode (--full: and without): memory freed, log-probs"),
)  # fmt: skip
CHECKS = tuple(row.name for row in ROWS)
ROW_BY_NAME = {row.name: row for row in ROWS}


def missing_packages(names, find_spec=None) -> list[str]:
    """The packages of ``names`` this Python cannot import (``find_spec`` is ``None``), in order."""
    find_spec = find_spec or importlib.util.find_spec
    return [name for name in names if find_spec(name) is None]


def skip_reason(row: Row, find_spec=None) -> str | None:
    """Why ``row`` cannot run in this Python (its missing packages), or ``None`` when it can."""
    missing = missing_packages(row.needs, find_spec)
    return f"needs {', '.join(missing)}, not installed in {sys.executable}" if missing else None


def format_list(full: bool = False) -> str:
    """``--list``: every row with what it needs and about how long it takes."""
    lines = [f"{'row':<11} {'needs':<20} {'about':>6}  what"]
    for row in ROWS:
        needs = ", ".join(row.needs) or "-"
        lines.append(f"{row.name:<11} {needs:<20} {row.seconds_full if full else row.seconds:>5}s  {row.what}")
    lines.append(f"every row needs a CUDA GPU and {', '.join(BASE_PACKAGES)}; times are an H100's")
    return "\n".join(lines)


class MatmulDtypes(TorchDispatchMode):
    """Records ``(op, operand dtypes)`` of every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``)
    one of whose operands has a dimension of size ``dim``, as the ops reach the kernels (after autocast)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.seen: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(a.dim() >= 2 and self.dim in a.shape for a in tensors):
                dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in tensors)
                self.seen.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))


def sync_sites(records) -> Counter:
    """Synchronisation warnings (``warnings.catch_warnings(record=True)`` entries) by ``file:line``;
    other warnings are left out."""
    return Counter(
        f"{os.path.relpath(r.filename, REPO_ROOT)}:{r.lineno}"
        for r in records
        if "synchronizing" in str(r.message).lower()
    )


def sync_verdict(total: int, minibatches: int, per_step: int = 0, budget: int = SYNC_BUDGET) -> tuple[str, float]:
    """``("PASS" or "FAIL", syncs per training mini-batch)``: the ``per_step`` syncs a step makes once
    (``trl_lite.trainer.transfer.sync_budget``) set aside, FAIL above ``budget`` per mini-batch."""
    per_minibatch = (total - per_step) / minibatches
    return ("PASS" if per_minibatch <= budget else "FAIL"), per_minibatch


def pytest_summary(output: str) -> str:
    """The counts of pytest's last summary line (``'3 failed, 510 passed'``), or ``'no summary'``."""
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", output)
    return ", ".join(f"{n} {what}" for n, what in counts) if counts else "no summary"


TABLE_HEADER = "| check | result | detail |\n|---|---|---|"


def format_row(check: str, result: str, detail: str) -> str:
    """One markdown table row; a ``|`` in the detail would split the cell, so it becomes ``/``."""
    return f"| {check} | {result} | {detail.replace('|', '/')} |"


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``(check, result, detail)`` rows."""
    return "\n".join([TABLE_HEADER] + [format_row(*row) for row in rows])


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


def check_device(args) -> tuple[str, str]:
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    props = torch.cuda.get_device_properties(0)
    missing = missing_packages(OPTIONAL_PACKAGES)
    return "INFO", (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}, "
        f"{torch.cuda.device_count()} visible; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"vLLM {vllm_version}; Python {sys.executable}; optional packages missing: {', '.join(missing) or 'none'}"
    )


def check_suite(args) -> tuple[str, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not cpu_only", "tests", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(max(1, min(12, (os.cpu_count() or 2) - 2))), "--dist", "loadgroup"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", "120"]
    command += shlex.split(args.suite_args)
    log, limit = args.output_dir / "suite.log", args.time_left()
    result = run_process(command, log, limit)
    if result is None:
        return "FAIL", f"cut after {limit:.0f} s (the time left): {pytest_summary(log.read_text())} (log: {log})"
    return ("PASS" if result.returncode == 0 else "FAIL"), f"{pytest_summary(result.stdout)} (log: {log})"


def check_bf16_step(args) -> tuple[str, str]:
    trainer = shared_trainer()
    queries, responses, scores = make_batch()
    trainer.step(queries, responses, scores)  # warm-up: one-time initialisations out of the profile
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with torch.profiler.profile(activities=activities) as profile, MatmulDtypes(VOCAB_SIZE) as matmuls:
            trainer.step(queries, responses, scores)
    kernels = Counter()
    for event in profile.key_averages():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu and re.search(r"gemm|nvjet|xmma|cutlass", event.key, re.IGNORECASE):
            kernels[event.key[:60]] += event.count
    not_bf16 = [(op, dtypes) for op, dtypes in matmuls.seen if set(dtypes) != {"bfloat16"}]
    status = "PASS" if matmuls.seen and not not_bf16 else "FAIL"
    detail = f"{len(matmuls.seen)} LM-head products, {len(not_bf16)} not in bf16"
    detail += f" (e.g. {not_bf16[0][0]} {not_bf16[0][1]})" if not_bf16 else ""
    return status, detail + "; GEMM kernels: " + ", ".join(f"{k} x{n}" for k, n in kernels.most_common(4))


class MemorySampler(threading.Thread):
    """The most GPU memory in use (``total - free`` of ``torch.cuda.mem_get_info``, every 5 ms) while running."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.005)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def vllm_worker(sleep: bool) -> dict:
    """One colocated engine with sleep mode ``sleep``: memory in use during ``step()``, and the largest
    difference between the engine's log-probs of its sampled tokens and the trained policy's, after a step."""
    in_use_before = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    trainer = make_trainer("no", sleep=sleep, use_vllm=True, vllm_dtype="float32", vllm_max_model_len=128)
    queries, _, scores = make_batch()
    responses = trainer.generate(queries, return_prompt=False, max_new_tokens=24, do_sample=True)
    sampler = MemorySampler()
    sampler.start()
    trainer.step(queries, [r if len(r) else torch.tensor([0]) for r in responses], scores)
    peak = sampler.stop()
    rows, logprobs = trainer.generate(
        queries, return_prompt=True, max_new_tokens=24, do_sample=True, return_logprobs=True
    )
    lm = trainer.accelerator.unwrap_model(trainer.model).pretrained_model.eval()
    worst = 0.0
    with torch.no_grad():
        for query, row, engine_logprobs in zip(queries, rows, logprobs):
            logits = lm(input_ids=row[None].to(lm.device)).logits[0].double().log_softmax(-1)
            response = row[len(query) :].to(lm.device)
            policy = logits[len(query) - 1 : len(row) - 1].gather(1, response[:, None])[:, 0]
            worst = max(worst, float((policy - engine_logprobs.to(lm.device).double()).abs().max()))
    total = torch.cuda.mem_get_info()[1]
    return {"peak_during_step": peak, "total": total, "worst_logprob_error": worst, "in_use_before": in_use_before,
            "utilization": trainer.config.vllm_gpu_memory_utilization}  # fmt: skip


def check_vllm_sleep(args) -> tuple[str, str]:
    results = {}
    for sleep in (True, False) if args.full else (True,):
        command = [sys.executable, __file__, "--worker", "vllm-sleep-on" if sleep else "vllm-sleep-off"]
        log = args.output_dir / f"vllm_sleep_{'on' if sleep else 'off'}.log"
        results[sleep] = worker_result(run_process(command, log, args.time_left()))
        if results[sleep] is None:
            return "FAIL", f"the engine with sleep={sleep} failed or ran out of time (log: {log})"
    on, gib = results[True], 2**30
    share = on["utilization"] * on["total"]
    error = max(r["worst_logprob_error"] for r in results.values())
    if False in results:
        off = results[False]
        freed = off["peak_during_step"] - on["peak_during_step"]
        compared = f"{off['peak_during_step'] / gib:.1f} GiB without sleep mode"
    else:  # the default run: the engine's share against what the trainer alone had in use before it was built
        freed = share - (on["peak_during_step"] - on["in_use_before"])
        compared = f"{on['in_use_before'] / gib:.1f} GiB before the trainer was built"
    status = "PASS" if freed >= 0.5 * share and error < 1e-3 else "FAIL"
    return status, (
        f"GPU memory in use during step(): {on['peak_during_step'] / gib:.1f} GiB asleep, {compared} "
        f"(engine share {share / gib:.1f} GiB); engine log-probs vs policy after a step: max error {error:.1e}"
    )


def step_syncs(trainer, batch) -> Counter:
    """The synchronisation warnings of one ``trainer.step(*batch)`` after a warm-up step, by source line."""
    trainer.step(*batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sync_sites(records)


def check_syncs(args) -> tuple[str, str]:
    from trl_lite.trainer.transfer import sync_budget

    runs = {
        "GAE": (shared_trainer(), make_batch()),
        "GRPO": (make_trainer("bf16", advantage_estimator="grpo", num_samples_per_query=2), make_batch(group_size=2)),
    }
    details, failed = [], False
    for name, (trainer, batch) in runs.items():
        sites = step_syncs(trainer, batch)
        budget = sync_budget(trainer.config)  # the syncs trl_lite lists for this config, host inputs
        total = sum(sites.values())
        status, per_minibatch = sync_verdict(total, budget["minibatches"], budget["per_step"])
        failed |= status == "FAIL"
        where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(8))
        details.append(
            f"{name}: {per_minibatch:.1f} per training mini-batch (budget {SYNC_BUDGET}): {total} in one step of "
            f"{budget['minibatches']} mini-batches, {budget['per_step']} of them once per step (listed: "
            f"{budget['total']}); {where or 'none'}"
        )
    return ("FAIL" if failed else "PASS"), "; ".join(details)


def gqa_agreement(device: str = "cuda") -> list[float] | str:
    """One varlen call of 8 query heads over 2 key/value heads (bf16) with the 2 heads unrepeated and with them
    repeated: the largest difference of the output and of the gradients of q, k, v, each relative to the
    largest entry of the repeated call's; or, where the kernel refuses unrepeated heads, its error."""
    from trl_lite.models.varlen_attention import KERNEL, _keywords, packed_rows

    g = torch.Generator(device=device).manual_seed(0)
    rows = packed_rows((37, 5, 64, 19), device)
    shapes = ((rows.total, 8, 64), (rows.total, 2, 64), (rows.total, 2, 64))
    q, k, v = (torch.randn(s, generator=g, device=device, dtype=torch.bfloat16).requires_grad_() for s in shapes)
    keywords = _keywords(KERNEL.function)
    causal = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    offsets = (rows.cu_seqlens, rows.cu_seqlens, rows.max_length, rows.max_length)

    def call(repeat: bool):
        key, value = (t.repeat_interleave(4, dim=1) if repeat else t for t in (k, v))
        grouped = {"enable_gqa": True} if not repeat and "enable_gqa" in keywords else {}
        out = KERNEL.function(q, key, value, *offsets, **causal, **grouped)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    repeated = call(True)
    try:
        unrepeated = call(False)
    except RuntimeError as error:
        return str(error)
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(unrepeated, repeated)]


def check_gqa(args) -> tuple[str, str]:
    from trl_lite.models.varlen_attention import KERNEL

    if KERNEL.function is None:
        return "SKIP", f"torch {torch.__version__} has no varlen_attn"
    diffs = gqa_agreement()
    if isinstance(diffs, str):
        return "INFO", f"the kernel refuses unrepeated K/V ({diffs[:120]}): the trainer repeats them"
    # bf16 rounding, and the K/V gradients sum a group's 4 query heads in another order.
    status = "PASS" if max(diffs) <= GQA_RTOL else "FAIL"
    names = ("output", "grad q", "grad k", "grad v")
    return status, f"unrepeated vs repeated K/V, max |difference| / max |entry| (PASS <= {GQA_RTOL}): " + ", ".join(
        f"{n} {d:.1e}" for n, d in zip(names, diffs)
    )


# ----------------------------------------------------------------------------------------------
# deepspeed: one bf16 step under ZeRO-2 and ZeRO-3 (one process each) against the plain bf16 step.
# ----------------------------------------------------------------------------------------------
def _full_weights(trainer) -> dict[str, torch.Tensor]:
    """The policy's weights (and value head) as float32 CPU tensors; under ZeRO-3 gathered first."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    gathered = None
    if trainer.accelerator.distributed_type.name == "DEEPSPEED":
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))  # a no-op below ZeRO-3
    with gathered if gathered is not None else torch.no_grad():
        return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def step_worker(weights_path: Path) -> dict:
    """One bf16 step on the checks' batch: the compared statistics, and the weights before and after
    (written to ``weights_path``). Plain or DeepSpeed, as the launcher set up accelerate."""
    trainer = make_trainer("bf16", learning_rate=DEEPSPEED_LEARNING_RATE, max_grad_norm=1.0)
    before = _full_weights(trainer)
    stats = trainer.step(*make_batch())
    torch.save({"before": before, "after": _full_weights(trainer)}, weights_path)
    return {"stats": {key: float(stats[key]) for key in DEEPSPEED_STATS},
            "distributed_type": trainer.accelerator.distributed_type.name}  # fmt: skip


def update_agreement(plain: dict, other: dict) -> tuple[float, float]:
    """``(cosine, norm ratio)`` of two steps' weight updates (``after - before`` over every tensor at once),
    from dicts ``{"before": {name: tensor}, "after": {name: tensor}}`` with the same names."""
    names = sorted(plain["after"])
    plain_update = torch.cat([(plain["after"][n] - plain["before"][n]).double().flatten() for n in names])
    other_update = torch.cat([(other["after"][n] - other["before"][n]).double().flatten() for n in names])
    cosine = float(torch.nn.functional.cosine_similarity(plain_update, other_update, dim=0))
    return cosine, float(other_update.norm() / plain_update.norm().clamp(min=1e-30))


def compare_steps(plain_stats: dict, stats: dict, cosine: float, norm_ratio: float) -> list[str]:
    """What differs beyond bf16 tolerance between a step and the plain step (empty when they agree)."""
    problems = [
        f"{key} {stats[key]:.4g} vs {plain_stats[key]:.4g}"
        for key in DEEPSPEED_STATS
        if not abs(stats[key] - plain_stats[key]) <= DEEPSPEED_STATS_ATOL + DEEPSPEED_STATS_RTOL * abs(plain_stats[key])
    ]
    if not cosine >= DEEPSPEED_MIN_COSINE:
        problems.append(f"update cosine {cosine:.3f} < {DEEPSPEED_MIN_COSINE}")
    if not abs(norm_ratio - 1) <= DEEPSPEED_NORM_RTOL:
        problems.append(f"update norm ratio {norm_ratio:.3f}")
    return problems


def check_deepspeed(args) -> tuple[str, str]:
    runs = {}
    for name in ("plain", *(("deepspeed_zero2",) if args.full else ()), "deepspeed_zero3"):
        weights = args.output_dir / f"step_{name}.pt"
        command = [sys.executable, __file__, "--worker", "step", "--worker-output", str(weights)]
        if name != "plain":
            launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                        "--config_file", str(REPO_ROOT / "accelerate_configs" / f"{name}.yaml"),
                        "--mixed_precision", "bf16"]  # fmt: skip
            command = launcher + command[1:]
        log = args.output_dir / f"step_{name}.log"
        result = worker_result(run_process(command, log, args.time_left()))
        if result is None:
            return "FAIL", f"the {name} step failed or ran out of time (log: {log})"
        if name != "plain" and result["distributed_type"] != "DEEPSPEED":
            return "FAIL", f"the {name} run was not under DeepSpeed ({result['distributed_type']}; log: {log})"
        runs[name] = (result["stats"], torch.load(weights))
    plain_stats, plain_weights = runs.pop("plain")
    details, failed = [], False
    for name, (stats, weights) in runs.items():
        cosine, ratio = update_agreement(plain_weights, weights)
        problems = compare_steps(plain_stats, stats, cosine, ratio)
        failed |= bool(problems)
        summary = f"loss/total {stats['ppo/loss/total']:.4f} (plain {plain_stats['ppo/loss/total']:.4f}), "
        summary += f"update cosine {cosine:.3f}, norm ratio {ratio:.3f}"
        details.append(f"{name.removeprefix('deepspeed_')}: {summary}" + (f"; {'; '.join(problems)}" if problems else ""))
    return ("FAIL" if failed else "PASS"), "; ".join(details)


# ----------------------------------------------------------------------------------------------
# demo, benchmarks
# ----------------------------------------------------------------------------------------------
def demo_seconds_per_step(records: list[dict], warmup: int = 2) -> float:
    """Median seconds per PPO step of the demo's ``metrics.jsonl`` records after ``warmup`` steps:
    ``time/ppo/total`` (the step) plus every timed rollout phase (``time/rollout/*``: generation, ...)."""
    seconds = [
        record["time/ppo/total"] + sum(v for k, v in record.items() if k.startswith("time/rollout/"))
        for record in records[warmup:]
    ]
    if not seconds:
        raise ValueError(f"the demo wrote {len(records)} steps, more than warmup={warmup} are needed")
    return statistics.median(seconds)


def check_demo(args) -> tuple[str, str]:
    output = args.output_dir / "demo"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
               "--config_file", str(REPO_ROOT / "accelerate_configs" / "single_gpu.yaml"), "--mixed_precision", "bf16",
               "examples/scripts/ppo_sentiment.py", "--steps", str(DEMO_STEPS), "--output_dir", str(output),
               "--disable_dropout", "True"]  # fmt: skip
    log = args.output_dir / "demo.log"
    result = run_process(command, log, args.time_left())
    metrics = output / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if result is None or result.returncode != 0 or len(records) < DEMO_STEPS:
        return "FAIL", f"the demo failed or ran out of time after {len(records)} steps (log: {log})"
    seconds = demo_seconds_per_step(records)
    rewards = [round(r["env/reward_mean"], 2) for r in records if "env/reward_mean" in r]
    status = "PASS" if seconds < DEMO_TARGET_S else "FAIL"
    return status, (
        f"{seconds:.3f} s per PPO step (target < {DEMO_TARGET_S}); reward mean first/last 3 steps "
        f"{rewards[:3]} / {rewards[-3:]} (metrics: {metrics})"
    )


def _bench(script: str, extra: list[str], args) -> tuple[str, str]:
    output = args.output_dir / f"{Path(script).stem}.md"
    command = [sys.executable, script, "--device", "cuda", *extra, "--output", str(output)]
    log = args.output_dir / f"{Path(script).stem}.log"
    result = run_process(command, log, args.time_left())
    if result is None or result.returncode != 0:
        code = "ran out of time" if result is None else f"exited {result.returncode}"
        return "FAIL", f"{' '.join(command[1:])} {code} (log: {log})"
    return "PASS", f"{' '.join(command[1:])}: table in {output}"


def bench_step_args(full: bool) -> list[str]:
    return ["--workloads", "w1", "w2", "w3", "--steps", "5", "--warmup", "2"] if full else [
        "--workloads", "w1", "--steps", "1", "--warmup", "1"]  # fmt: skip


def bench_loop_args(full: bool) -> list[str]:
    return ["--iterations", "3", "--warmup", "1"] if full else ["--iterations", "1", "--warmup", "1"]


CHECK_FUNCTIONS = {
    "device": check_device,
    "suite": check_suite,
    "bf16-step": check_bf16_step,
    "syncs": check_syncs,
    "gqa": check_gqa,
    "deepspeed": check_deepspeed,
    "demo": check_demo,
    "bench-step": lambda args: _bench("benchmarks/bench_step.py", bench_step_args(args.full), args),
    "bench-loop": lambda args: _bench("benchmarks/bench_loop.py", bench_loop_args(args.full), args),
    "vllm-sleep": check_vllm_sleep,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every row, what it needs and how long it takes")
    parser.add_argument("--full", action="store_true",
                        help="the benchmarks' long settings, and no time budget (unless --budget is given)")  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run these rows only")
    parser.add_argument("--skip", nargs="+", choices=CHECKS, default=[], help="leave these rows out")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="logs and benchmark tables (default: a new temporary directory)"
    )
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the whole run may take (default 360; none with --full)")  # fmt: skip
    parser.add_argument("--suite-args", default="", help="more pytest arguments for the suite row")
    parser.add_argument("--worker", choices=["vllm-sleep-on", "vllm-sleep-off", "step"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget is None and not args.full:
        args.budget = 360.0
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    return args


# A row is not started with less time left than this: it could not finish.
MIN_ROW_SECONDS = 10.0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(format_list(args.full))
        return 0
    if not torch.cuda.is_available():
        print(
            f"gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none here "
            f"(torch.cuda.is_available() is False): run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    if args.worker == "step":
        print(WORKER_MARKER + json.dumps(step_worker(args.worker_output)), flush=True)
        return 0
    if args.worker is not None:
        print(WORKER_MARKER + json.dumps(vllm_worker(sleep=args.worker == "vllm-sleep-on")), flush=True)
        return 0
    args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget if args.budget is not None else math.inf
    args.time_left = lambda: min(deadline - time.monotonic(), 24 * 3600.0)
    print(TABLE_HEADER, flush=True)
    rows = []
    for check in args.only or CHECKS:
        if check in args.skip:
            continue
        start = time.perf_counter()
        reason = skip_reason(ROW_BY_NAME[check])
        if reason is not None:
            result, detail = "SKIP", reason
        elif args.time_left() < MIN_ROW_SECONDS:
            result, detail = "SKIP", f"the time budget of {args.budget:.0f} s is spent (--budget, --only)"
        else:
            try:
                result, detail = CHECK_FUNCTIONS[check](args)
            except Exception as error:  # a check that crashes is a failed row; the others still run
                (args.output_dir / f"{check}.traceback").write_text(traceback.format_exc())
                result, detail = "FAIL", f"{type(error).__name__}: {str(error)[:200]}"
        rows.append((check, result, f"{detail} ({time.perf_counter() - start:.0f} s)"))
        print(format_row(*rows[-1]), flush=True)
    (args.output_dir / "gpu_check.md").write_text(format_table(rows) + "\n")
    print(f"logs and tables in {args.output_dir}", flush=True)
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
