"""`make gpu-check`: what a first session on a GPU machine must verify, in one command, as one table.

Checks (one row each; ``--only`` and ``--skip`` pick them):

- ``device``: the GPU and the torch, CUDA and vLLM versions.
- ``suite``: the test suite with the GPU visible (``pytest -m "not cpu_only"``: tests that hold only
  on a CPU machine are marked ``cpu_only``).
- ``bf16-step``: one ``PPOTrainer.step()`` under accelerate's ``mixed_precision="bf16"`` with fp32
  weights. Every matrix product that has the LM head's vocabulary dimension, forward and backward,
  must take bf16 operands (on a GPU: tensor-core GEMMs); the profile's GEMM kernels are listed.
- ``vllm-sleep``: a colocated vLLM engine, once with sleep mode and once without, each in a process
  of its own: the GPU memory in use during ``step()`` (``torch.cuda.mem_get_info``, sampled every
  5 ms) must drop by at least half the engine's share (``vllm_gpu_memory_utilization``) with sleep
  mode; after the step (a level-2 wake and a weight push) the engine's log-probs of its sampled
  tokens must equal the trained policy's to 1e-3 (float32).
- ``syncs``: the host-device synchronisations of one ``step()`` (after a warm-up step) under
  ``torch.cuda.set_sync_debug_mode("warn")``, counted per mini-batch and by source line.
- ``bench-step``, ``bench-loop``: ``benchmarks/bench_step.py --device cuda --workloads w1`` and
  ``benchmarks/bench_loop.py --device cuda``, their tables written to the output directory.

Exit status: 0 when no check failed, 1 when one did, 2 (one line on stderr) on a machine without a
CUDA GPU. Put the printed table in benchmarks/RESULTS.md.

Usage:
    python scripts/gpu_check.py [--only CHECK ...] [--skip CHECK ...] [--output-dir DIR]
        [--suite-args "-x ..."] [--suite-timeout 3600]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("device", "suite", "bf16-step", "vllm-sleep", "syncs", "bench-step", "bench-loop")
WORKER_MARKER = "GPU_CHECK_RESULT "
VOCAB_SIZE = 50257  # GPT-2's: the LM head is the largest product of the step, and no other dimension equals it
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


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


def pytest_summary(output: str) -> str:
    """The counts of pytest's last summary line (``'3 failed, 510 passed'``), or ``'no summary'``."""
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", output)
    return ", ".join(f"{n} {what}" for n, what in counts) if counts else "no summary"


def format_table(rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``(check, result, detail)`` rows."""
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {check} | {result} | {detail.replace('|', '/')} |" for check, result, detail in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The trainer the checks run: a 2-layer GPT-2 with GPT-2's vocabulary, on the GPU.
# ----------------------------------------------------------------------------------------------
def make_trainer(mixed_precision: str = "bf16", sleep: bool | None = None, **config):
    from transformers import GPT2Config, GPT2LMHeadModel

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=256, n_embd=256, n_layer=2, n_head=4))
    ppo_config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=1, seed=0,
                           accelerator_kwargs={"mixed_precision": mixed_precision}, **config)  # fmt: skip
    if sleep is not None:
        ppo_config.vllm_enable_sleep_mode = sleep
    return PPOTrainer(ppo_config, AutoModelForCausalLMWithValueHead.from_pretrained(lm), tokenizer=None)


def make_batch(n: int = 8, seed: int = 0):
    """``n`` queries (8-15 tokens), responses (16-31 tokens) and scores."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 16, (n,), generator=g).tolist(), torch.randint(16, 32, (n,), generator=g).tolist()
    queries = [torch.randint(0, VOCAB_SIZE - 1, (k,), generator=g) for k in lengths[0]]
    responses = [torch.randint(0, VOCAB_SIZE - 1, (k,), generator=g) for k in lengths[1]]
    return queries, responses, [torch.randn((), generator=g) for _ in range(n)]


def check_device(args) -> tuple[str, str]:
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    props = torch.cuda.get_device_properties(0)
    return "INFO", (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}, "
        f"{torch.cuda.device_count()} visible; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"vLLM {vllm_version}"
    )


def check_suite(args) -> tuple[str, str]:
    import importlib.util

    command = [sys.executable, "-m", "pytest", "-q", "-m", "not cpu_only", "tests"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(min(8, os.cpu_count() or 1)), "--dist", "loadgroup"]
    command += shlex.split(args.suite_args)
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=args.suite_timeout)
    log = args.output_dir / "suite.log"
    log.write_text(result.stdout + result.stderr)
    return ("PASS" if result.returncode == 0 else "FAIL"), f"{pytest_summary(result.stdout)} (log: {log})"


def check_bf16_step(args) -> tuple[str, str]:
    trainer = make_trainer("bf16")
    queries, responses, scores = make_batch()
    trainer.step(queries, responses, scores)  # warm-up: one-time initialisations out of the profile
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
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
    return {"peak_during_step": peak, "total": total, "worst_logprob_error": worst,
            "utilization": trainer.config.vllm_gpu_memory_utilization}  # fmt: skip


def check_vllm_sleep(args) -> tuple[str, str]:
    results = {}
    for sleep in (True, False):
        command = [sys.executable, __file__, "--worker", "vllm-sleep-on" if sleep else "vllm-sleep-off"]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
        (args.output_dir / f"vllm_sleep_{'on' if sleep else 'off'}.log").write_text(result.stdout + result.stderr)
        lines = [line for line in result.stdout.splitlines() if line.startswith(WORKER_MARKER)]
        if result.returncode != 0 or not lines:
            return "FAIL", f"the engine with sleep={sleep} failed (log in {args.output_dir})"
        results[sleep] = json.loads(lines[-1][len(WORKER_MARKER) :])
    on, off = results[True], results[False]
    share = on["utilization"] * on["total"]
    freed = off["peak_during_step"] - on["peak_during_step"]
    error = max(on["worst_logprob_error"], off["worst_logprob_error"])
    status = "PASS" if freed >= 0.5 * share and error < 1e-3 else "FAIL"
    gib = 2**30
    return status, (
        f"GPU memory in use during step(): {on['peak_during_step'] / gib:.1f} GiB asleep, "
        f"{off['peak_during_step'] / gib:.1f} GiB without sleep mode (engine share {share / gib:.1f} GiB); "
        f"engine log-probs vs policy after a step: max error {error:.1e}"
    )


def check_syncs(args) -> tuple[str, str]:
    trainer = make_trainer("bf16")
    queries, responses, scores = make_batch()
    trainer.step(queries, responses, scores)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(queries, responses, scores)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = sync_sites(records)
    minibatches = trainer.config.ppo_epochs * (trainer.config.batch_size // trainer.config.mini_batch_size)
    total = sum(sites.values())
    where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(8))
    return "INFO", f"{total} in one step ({minibatches} mini-batches, {total / minibatches:.1f} each): {where}"


def _bench(script: str, extra: list[str], args) -> tuple[str, str]:
    output = args.output_dir / f"{Path(script).stem}.md"
    command = [sys.executable, script, "--device", "cuda", *extra, "--output", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
    (args.output_dir / f"{Path(script).stem}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        return "FAIL", f"{' '.join(command[1:])} exited {result.returncode} (log in {args.output_dir})"
    return "PASS", f"table in {output}"


CHECK_FUNCTIONS = {
    "device": check_device,
    "suite": check_suite,
    "bf16-step": check_bf16_step,
    "vllm-sleep": check_vllm_sleep,
    "syncs": check_syncs,
    "bench-step": lambda args: _bench("benchmarks/bench_step.py", ["--workloads", "w1"], args),
    "bench-loop": lambda args: _bench("benchmarks/bench_loop.py", [], args),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run these checks only")
    parser.add_argument("--skip", nargs="+", choices=CHECKS, default=[], help="leave these checks out")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="logs and benchmark tables (default: a new temporary directory)"
    )
    parser.add_argument("--suite-args", default="", help="more pytest arguments for the suite check")
    parser.add_argument("--suite-timeout", type=int, default=3600, help="seconds the suite may run")
    parser.add_argument("--worker", choices=["vllm-sleep-on", "vllm-sleep-off"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none here "
            f"(torch.cuda.is_available() is False): run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    if args.worker is not None:
        print(WORKER_MARKER + json.dumps(vllm_worker(sleep=args.worker == "vllm-sleep-on")), flush=True)
        return 0
    args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for check in args.only or CHECKS:
        if check in args.skip:
            continue
        start = time.perf_counter()
        try:
            result, detail = CHECK_FUNCTIONS[check](args)
        except Exception as error:  # a check that crashes is a failed row; the others still run
            (args.output_dir / f"{check}.traceback").write_text(traceback.format_exc())
            result, detail = "FAIL", f"{type(error).__name__}: {str(error)[:200]}"
        rows.append((check, result, f"{detail} ({time.perf_counter() - start:.0f} s)"))
        print(f"{check}: {result}", flush=True)
    table = format_table(rows)
    print(table)
    (args.output_dir / "gpu_check.md").write_text(table + "\n")
    print(f"logs and tables in {args.output_dir}")
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
