"""How `bench_step.py` measures: each (workload, method) in a fresh worker process (`WorkerProcess`,
`worker_main`), the methods of a workload taking turns step by step (`measure_workload`), every workload
(`run_benchmark`)."""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from peak_memory import PeakMemory, tensor_peak_mb
from step_methods import METHODS, make_step_fn, methods_for
from step_workloads import (
    DTYPES, CriticFreeWorkload, LongWorkload, Qwen2Workload, SmolLM2Workload, Workload, make_batch, needed_flops,
)  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "BENCH_RESULT "
# A worker is this command line's hidden `--worker` path (`bench_step.main` -> `worker_main`).
BENCH_STEP = Path(__file__).resolve().with_name("bench_step.py")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class StepRunner:
    """One method on one workload in this process: built once, then run one step at a time."""

    def __init__(self, workload: Workload, method: str, device: str, dtype: str):
        self.device = device
        self.step_fn = make_step_fn(method, workload, device, DTYPES[dtype])
        self.batch = make_batch(workload)
        torch.manual_seed(workload.seed)
        self.memory = PeakMemory(device)
        self.memory.start()

    def run_one(self) -> float:
        """Wall-clock seconds of one step on the workload's batch."""
        _sync(self.device)
        t0 = time.perf_counter()
        self.step_fn(*self.batch)
        _sync(self.device)
        return time.perf_counter() - t0

    def finish(self) -> dict:
        """Peak memory growth since the models were built (MB), the torch thread count and what the step
        function reports of itself (its `extras()`, e.g. `grpo-beta0`'s passes per step)."""
        extras = self.step_fn.extras() if hasattr(self.step_fn, "extras") else {}
        return {"peak_mb": self.memory.peak_mb(), "threads": torch.get_num_threads(), **extras}

    def first_step_tensor_peak_mb(self) -> float:
        """Run the first step, untimed; return the live tensor memory at its peak, counted from its start.

        CPU: torch's memory profiler, whose own records take resident memory: so this runs in a
        process of its own, never in one whose resident peak is read. CUDA: the allocator's peak,
        which counts tensors only.
        """
        if self.device == "cuda":
            self.step_fn(*self.batch)
            return self.memory.peak_mb()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step_fn(*self.batch)
        return tensor_peak_mb(prof)


class WorkerProcess:
    """A `StepRunner` in a fresh Python process, driven line by line over its stdin.

    Protocol: the worker prints one marked line when built, then one per command: `step` (its
    time), `profile` (the first step's tensor peak) or `finish` (peak memory, then it exits). Its
    stderr goes to a temporary file so that a chatty library cannot fill a pipe and block it.
    """

    def __init__(self, workload: Workload, method: str, device: str, dtype: str):
        self.label = f"{workload.name}/{method}"
        spec = dict(workload=dataclasses.asdict(workload), method=method, device=device, dtype=dtype)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, str(BENCH_STEP), "--worker", json.dumps(spec)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )

    def request(self, command: str = None) -> dict:
        """Send `command` (if any) and return the worker's next marked reply."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARKER):
                return json.loads(line[len(RESULT_MARKER) :])
        self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(
            f"benchmark worker {self.label} failed (exit {self.proc.returncode}):\n{self.stderr.read()[-4000:]}"
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            stream.close()


def worker_main(spec_json: str) -> None:
    """Entry point of a measuring subprocess: build, then answer `step`, `profile`, `finish` lines."""
    spec = json.loads(spec_json)
    fields = spec.pop("workload")
    kind = (
        CriticFreeWorkload if "advantage_estimator" in fields else LongWorkload if "long_rows" in fields
        else SmolLM2Workload if "pretrained" in fields else Qwen2Workload if "n_kv_head" in fields else Workload
    )  # fmt: skip
    workload = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    runner = StepRunner(workload, **spec)
    print(RESULT_MARKER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            reply = {"time_s": runner.run_one()}
        elif command == "profile":
            reply = {"tensor_peak_mb": runner.first_step_tensor_peak_mb()}
        elif command == "finish":
            print(RESULT_MARKER + json.dumps(runner.finish()), flush=True)
            return
        else:
            raise ValueError(f"unknown worker command {command!r}; expected 'step', 'profile' or 'finish'")
        print(RESULT_MARKER + json.dumps(reply), flush=True)


def first_step_tensor_peak(workload: Workload, method: str, device: str, dtype: str) -> float:
    """The tensor peak (MB) of the first step of `method`, in a process used for nothing else."""
    worker = WorkerProcess(workload, method, device, dtype)
    try:
        worker.request()
        return worker.request("profile")["tensor_peak_mb"]
    finally:
        worker.close()


def measure_workload(
    workload: Workload, methods, steps: int, warmup: int, device: str, dtype: str, tensor_peak: bool = True
) -> list:
    """Time every method on `workload`, one process each, taking turns step by step.

    Taking turns (and swapping who goes first every round) lets every method see the same machine
    load, which matters on a shared machine. The tensor peaks come from separate processes first.
    Returns one result dict per method.
    """
    tensor_peaks = {method: first_step_tensor_peak(workload, method, device, dtype) for method in methods if tensor_peak}
    workers = {method: WorkerProcess(workload, method, device, dtype) for method in methods}
    try:
        for worker in workers.values():
            worker.request()
        times = {method: [] for method in methods}
        for i in range(warmup + steps):
            for method in methods if i % 2 == 0 else reversed(methods):
                seconds = workers[method].request("step")["time_s"]
                if i >= warmup:
                    times[method].append(seconds)
        finals = {method: worker.request("finish") for method, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    queries, responses, _ = make_batch(workload)
    tokens = sum(len(q) + len(r) for q, r in zip(queries, responses))
    flops = needed_flops(workload)
    results = []
    for method in methods:
        median = statistics.median(times[method])
        result = {"workload": workload.name, "method": method, "times_s": times[method], "median_s": median}
        result.update(min_s=min(times[method]), tokens_per_s=tokens / median)
        if method in tensor_peaks:
            result["tensor_peak_mb"] = tensor_peaks[method]
        result["gflops_per_s"] = flops / min(times[method]) / 1e9
        result["tflops_per_s"] = result["gflops_per_s"] / 1e3
        results.append({**result, **finals[method]})
    return results


def run_benchmark(
    workloads: list, methods=METHODS, steps: int = 3, warmup: int = 1, device="cpu", dtype="fp32", peak_gflops=None,
    tensor_peak: bool = True,
):  # fmt: skip
    """Measure every workload with every method; returns the result dicts in order.

    With ``peak_gflops`` each result also gets ``peak_fraction``: its achieved FLOP/s over that peak.
    """
    results = []
    for workload in workloads:
        for result in measure_workload(workload, methods_for(workload, methods), steps, warmup, device, dtype, tensor_peak):
            if peak_gflops:
                result["peak_fraction"] = result["gflops_per_s"] / peak_gflops
            print(
                f"{workload.name:>10} {result['method']:>11}: median {result['median_s']:.4f} s "
                f"(steps {', '.join(f'{t:.3f}' for t in result['times_s'])}), peak {result['peak_mb']:.1f} MB, "
                f"tensor peak {result.get('tensor_peak_mb', float('nan')):.1f} MB",
                flush=True,
            )
            results.append(result)
    return results
