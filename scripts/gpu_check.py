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
import importlib.util
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

from gpu_check_common import REPO_ROOT, WORKER_MARKER
from gpu_check_kernels import SYNC_BUDGET, check_bf16_step, check_gqa, check_syncs
from gpu_check_processes import (
    DEMO_STEPS, DEMO_TARGET_S, bench_loop_args, bench_step_args, check_deepspeed, check_demo, check_fsdp2, check_suite,
    check_vllm_sleep, step_worker, vllm_worker, _bench,
)  # fmt: skip

if str(REPO_ROOT) not in sys.path:  # `python3 scripts/gpu_check.py` from a checkout, without PYTHONPATH
    sys.path.insert(0, str(REPO_ROOT))

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
    Row("fsdp2", (), 9, 9, "accelerate's FSDP2 (fsdp2.yaml), one process, bf16: one step = deepspeed's plain step"),
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


TABLE_HEADER = "| check | result | detail |\n|---|---|---|"


def format_row(check: str, result: str, detail: str) -> str:
    """One markdown table row; a ``|`` in the detail would split the cell, so it becomes ``/``."""
    return f"| {check} | {result} | {detail.replace('|', '/')} |"


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``(check, result, detail)`` rows."""
    return "\n".join([TABLE_HEADER] + [format_row(*row) for row in rows])


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


CHECK_FUNCTIONS = {
    "device": check_device,
    "suite": check_suite,
    "bf16-step": check_bf16_step,
    "syncs": check_syncs,
    "gqa": check_gqa,
    "deepspeed": check_deepspeed,
    "fsdp2": check_fsdp2,
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
