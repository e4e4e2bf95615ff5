"""Time `PPOTrainer.step()` on named workloads next to the compute floor of the same work.

The floor is a hand-written PPO step on plain transformers that does only the model work no PPO
step can avoid: a policy and a reference forward without grad over the batch, then, for each of
`ppo_epochs` epochs, forward + backward + Adam step per mini-batch, with the LM head applied only
where a response token is predicted and every mini-batch padded to its own longest row. It uses
the cheapest forms of that work that stock PyTorch offers (fused Adam, a cache-sized chunked
log-softmax, glibc keeping freed memory - applied when the floor is built, where the trainer applies
`PPOConfig.keep_freed_cpu_memory` to itself), so the comparison measures overhead, not different
kernels or allocator settings.

Each (workload, method) runs in a fresh subprocess so that peak memory is measured alone:
see `benchmarks/README.md` for how time, tokens/s and peak memory are defined.

Usage:
    python benchmarks/bench_step.py [--workloads w1 w2 sweep] [--steps 3] [--warmup 1]
        [--device cpu|cuda] [--dtype fp32|bf16] [--methods step floor floor-packed] [--threads N]
        [--peak-gflops G] [--output benchmarks/RESULTS.md]
"""

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

from step_measure import REPO_ROOT, run_benchmark, worker_main
from step_methods import EXTRA_METHODS, METHODS, PACKED_FLOOR, PREFIX_METHODS
from step_workloads import (
    DTYPES, H100_BF16_PEAK_GFLOPS, WORKLOAD_GROUPS, LongWorkload, Qwen2Workload, SmolLM2Workload, Workload,
    matmul_peak_gflops,
)  # fmt: skip

sys.path.insert(0, str(REPO_ROOT / "examples" / "scripts"))
from run_record import COMMIT_AT_START  # noqa: E402  (the examples' records name their commit the same way)

# (result key, column title, number format, whether a ratio-to-floor column follows)
TABLE_COLUMNS = (
    ("median_s", "median s", ".4f", True),
    ("min_s", "min s", ".4f", True),
    ("tokens_per_s", "tokens/s", ".0f", False),
    ("gflops_per_s", "GFLOP/s", ".1f", False),
    ("tflops_per_s", "TFLOP/s", ".2f", False),
    ("peak_fraction", "MFU (x peak)", ".3f", False),
    ("peak_mb", "peak MB", ".1f", True),
    ("tensor_peak_mb", "tensor peak MB", ".1f", True),
    ("rollout_passes", "passes w/o grad per step", ".1f", False),
    ("reference_mb", "reference copy MB", ".1f", False),
    ("tokens_run", "tokens run (x all)", ".2f", False),
)


def format_table(results: list) -> str:
    """A markdown table: one row per (workload, method), ratios against the floor of the same workload."""
    floors = {r["workload"]: r for r in results if r["method"] == "floor"}
    # With the packed floor measured: the median time over it too (the same attention on both sides).
    packed_floors = {r["workload"]: r for r in results if r["method"] == PACKED_FLOOR}
    titles, aligns = ["workload", "method"], ["---", "---"]
    for _, title, _, with_ratio in TABLE_COLUMNS:
        titles += [title, "x floor"] if with_ratio else [title]
        aligns += ["---:", "---:"] if with_ratio else ["---:"]
    if packed_floors:
        titles, aligns = titles + ["median x floor-packed"], aligns + ["---:"]
    # With prefix sharing off measured: time and tensor peak over it (docs/prefix_sharing.md).
    unshared = {r["workload"]: r for r in results if r["method"] == "step-prefix-off"}
    if unshared:
        titles, aligns = titles + ["median x prefix-off", "tensor peak x prefix-off"], aligns + ["---:", "---:"]
    lines = ["| " + " | ".join(titles) + " |", "| " + " | ".join(aligns) + " |"]
    for r in results:
        floor = floors.get(r["workload"])
        cells = [r["workload"], r["method"]]
        for key, _, fmt, with_ratio in TABLE_COLUMNS:
            cells.append(format(r[key], fmt) if key in r else "-")
            if with_ratio:
                cells.append(f"{r[key] / floor[key]:.2f}" if floor and floor.get(key) and key in r else "-")
        if packed_floors:
            packed = packed_floors.get(r["workload"])
            cells.append(f"{r['median_s'] / packed['median_s']:.2f}" if packed else "-")
        if unshared:
            off = unshared.get(r["workload"])
            cells += [f"{r[k] / off[k]:.2f}" if off and off.get(k) and k in r else "-" for k in ("median_s", "tensor_peak_mb")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe_workloads(workloads: list) -> str:
    """One markdown bullet per workload with its shapes."""
    def model(w: Workload) -> str:
        if isinstance(w, SmolLM2Workload):
            return f"{w.pretrained}, real weights ({w.n_layer} x {w.n_embd}, {w.n_head} heads over {w.n_kv_head} key/value heads)"
        if isinstance(w, Qwen2Workload):
            return (f"Qwen2 {w.n_layer} x {w.n_embd} ({w.n_head} heads over {w.n_kv_head} key/value heads, "
                    f"MLP {w.intermediate_size}, tied embeddings)")  # fmt: skip
        return f"GPT-2 {w.n_layer} x {w.n_embd} ({w.n_head} heads)"

    return "\n".join(
        f"- `{w.name}`: {model(w)}, vocabulary {w.vocab_size}, "
        f"batch {w.batch_size}, mini-batch {w.mini_batch_size}, {w.ppo_epochs} PPO epochs, "
        f"queries {w.query_len[0]}-{w.query_len[1]}, responses {w.response_len[0]}-{w.response_len[1]} tokens"
        + (f", {w.long_rows} of {w.long_len[0]}-{w.long_len[1]}" if isinstance(w, LongWorkload) else "")
        + (f" ({w.response_spread})" if isinstance(w, Qwen2Workload) else "")
        + (f", {w.options}" if w.options != "{}" else "")
        for w in workloads
    )


def machine_description(device: str) -> str:
    """CPU model, core count, torch threads and library versions (and the GPU when on CUDA)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    parts = [
        f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "load average at start " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
    ]
    if device == "cuda":
        parts.insert(0, f"GPU {torch.cuda.get_device_name()}")
    return "; ".join(parts)


def write_results(path: Path, heading: str, body: str) -> None:
    """Replace the `## heading` section of the markdown file at `path` with `body`, keeping the file's header and
    every other section as they are (indented lines included)."""
    header = "# trl_lite benchmark results\n"
    sections = {}
    if path.exists():
        header, *chunks = path.read_text().split("\n## ")
        for chunk in chunks:
            name, _, rest = chunk.partition("\n")
            sections[name.strip()] = rest.strip("\n")
    sections[heading] = body.strip("\n")
    text = header.rstrip("\n") + "\n" + "".join(f"\n## {name}\n\n{content}\n" for name, content in sections.items())
    path.write_text(text)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["w1", "w2", "sweep"], choices=sorted(WORKLOAD_GROUPS))
    parser.add_argument(
        "--methods", nargs="+", default=None, choices=(*METHODS, PACKED_FLOOR, *EXTRA_METHODS, *PREFIX_METHODS),
        help=f"default: {' '.join(METHODS)}, and {PACKED_FLOOR} on cuda",
    )  # fmt: skip
    parser.add_argument("--steps", type=_int_at_least(1), default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed steps before timing")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument(
        "--threads", type=_int_at_least(1), default=None, help="torch intra-op threads (default: torch's own)"
    )
    parser.add_argument(
        "--peak-gflops", type=float, default=None,
        help="the machine's matrix-product peak for the MFU ('x peak') column (default: measured at start on CPU "
        "in fp32; on cuda the dense bf16 peak of an H100 SXM, 989 TFLOP/s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-tensor-peak", action="store_true",
        help="skip the profiled first step per method (its tensor peak): one step less per method, for slow workloads",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.worker and not torch.cuda.is_available():
        parser.error("--device cuda was given but torch.cuda.is_available() is False")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.methods = args.methods or [*METHODS, *([PACKED_FLOOR] if args.device == "cuda" else [])]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return
    if args.threads is not None:
        # The workers inherit the environment; torch reads OMP_NUM_THREADS when it starts.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    workloads = [w for group in args.workloads for w in WORKLOAD_GROUPS[group]()]
    machine = machine_description(args.device)
    peak = args.peak_gflops
    source = "given"
    if peak is None and args.device == "cpu" and args.dtype == "fp32":
        peak, source = matmul_peak_gflops(), "measured at start: best 1536^3 fp32 product"
    elif peak is None and args.device == "cuda":
        peak, source = H100_BF16_PEAK_GFLOPS, "dense bf16 peak of an H100 SXM, the default on cuda"
    if peak:
        machine += f"; matmul peak {peak:.0f} GFLOP/s ({source})"
    print(f"machine: {machine}", flush=True)
    results = run_benchmark(workloads, args.methods, args.steps, args.warmup, args.device, args.dtype, peak, not args.no_tensor_peak)
    table = format_table(results)
    print(table)
    settings = (
        f"{args.steps} timed steps after {args.warmup} warm-up; load average at end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"; {time.strftime('%Y-%m-%d')}; commit {COMMIT_AT_START}"
    )
    command = "    python benchmarks/bench_step.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    body = f"{command.rstrip()}\n\nMachine: {machine}\n\n{settings}\n\n{describe_workloads(workloads)}\n\n{table}"
    heading = f"{args.device} {args.dtype}: {' '.join(args.workloads)}"
    if args.threads is not None:
        heading += f", torch threads {args.threads}"
    write_results(args.output, heading, body)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
