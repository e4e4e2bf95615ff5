"""Per-process tensor peak and time of a PPO step on long rows: 1 process against 2 processes of one
sequence-parallel group (Ulysses, docs/sequence_parallel.md), on the CPU.

The workload: a GPT-2 shape (``--layers`` layers, ``--width`` wide, ``--heads`` heads, a 512-token
vocabulary, random weights, fp32) with a value head; one batch of rows of ``--lengths`` tokens (64 of query
each), one row per mini-batch, 1 PPO epoch, SGD, packed passes. Each run does 3 steps on the same batch:
the first timed, the next two under ``torch.profiler`` with ``profile_memory=True``, the larger of whose
tensor peaks is reported. A step's tensor peak is the highest sum of live CPU tensor bytes counted from
the step's start (``peak_memory.tensor_peak_mb``: weights, and buffers made once in the first step, do not
count; the training pass of the longest row is the step's largest). It replays the allocations by address,
because under several processes gloo's worker threads drop the last reference to many of the collectives'
buffers and the profiler does not record frees on those threads: counted from the records alone, those
buffers would stay alive to the end of the step.

Three runs: 1 process plain (the trainer's own optimizer step); 1 process under the same DeepSpeed ZeRO-2
configuration as the group, without sequence parallelism (its engine allocates the parameters' gradients in
every backward, as the group's does); and the 2 processes of one group. DeepSpeed's gradient bucket
(``reduce_bucket_size``, by default 5e8 elements: a 2 GB buffer allocated in every backward whatever the
model) is sized to the model's parameters, as one would for a model this small: the DeepSpeed runs use a
copy of ``accelerate_configs/deepspeed_sequence_parallel.yaml`` whose DeepSpeed settings come from a JSON
file with that bucket size. The 1-process runs use all ``--threads`` torch threads; each of the 2 processes
gets half. ``--gradient_checkpointing`` runs every case with the layers' activations recomputed.

Each run also reports the growth of its peak resident size (``VmHWM``, reset before the step) over the resident
size before each of the first two (unprofiled) steps, and how much of the first step's growth is file-backed
pages (``RssFile``: library code run for the first time), the memory glibc's malloc holds free in its heaps after
the first step (``mallinfo2``'s ``fordblks``: freed blocks kept for reuse, resident, counted in the growth but not
in the tensor peak) and the first and second steps' CPU seconds (user + system, of this process) and minor page
faults (``ru_minflt``: pages the kernel mapped in, for malloc fresh zeroed ones);
``--no_tensor_peak`` skips the profiled steps. By default the trainer sets glibc's malloc itself
(``PPOConfig.keep_freed_cpu_memory``: blocks up to 32 MiB kept on 1 process, a lower mmap threshold and one arena
on a process of the group, lifted to 32 MiB during the rollout; trl_lite/trainer/memory/cpu_memory.py).
``--return_freed_cpu_memory`` runs every case with ``PPOConfig(keep_freed_cpu_memory=False)`` (glibc's own malloc
settings); ``--mmap_threshold BYTES`` starts every process with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_``, which turns its dynamic threshold off; ``MALLOC_TRIM_THRESHOLD_=2147483647``), which
the trainer then leaves alone: every block above it is mapped on its own and returned when freed; 33554432 gives
every process the 1-process setting (docs/sequence_parallel.md, "Resident memory").

Usage:
    python benchmarks/bench_sequence_parallel.py [--lengths 8192 16384] [--layers 2] [--width 256] [--heads 4]
        [--gradient_checkpointing] [--return_freed_cpu_memory] [--mmap_threshold 1048576] [--no_tensor_peak]
"""

import argparse
import ctypes
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peak_memory import tensor_peak_mb

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "BENCH_RESULT "


def worker(args) -> None:
    """One process of a run: build the trainer, profile one step, time the next; print a result line."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
    from trl_lite.parallel import sequence_parallel_size

    set_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=max(args.lengths), n_embd=args.width, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(GPT2LMHeadModel(config))
    ppo_config = PPOConfig(batch_size=len(args.lengths), mini_batch_size=1, ppo_epochs=1, padding_free=True, seed=0,
                           gradient_checkpointing=args.gradient_checkpointing,
                           keep_freed_cpu_memory=not args.return_freed_cpu_memory)  # fmt: skip
    trainer = PPOTrainer(ppo_config, model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    queries = [torch.randint(3, 512, (64,), generator=g) for _ in args.lengths]
    responses = [torch.randint(3, 512, (n - 64,), generator=g) for n in args.lengths]
    scores = [torch.randn((), generator=g) for _ in args.lengths]
    growth = []  # per unprofiled step: peak resident growth and growth of file-backed pages (the code run first)
    for _ in range(2):
        before, file_before = resident_mb("VmRSS"), resident_mb("RssFile")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size (VmHWM) starts again from the current one
        start, cpu_start, faults_start = time.perf_counter(), cpu_seconds(), minor_faults()
        stats = trainer.step(queries, responses, scores)
        if not growth:
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start  # the first step's times
            heap_free, faults = malloc_free_mb(), minor_faults() - faults_start
        else:
            second_cpu, second_faults = cpu_seconds() - cpu_start, minor_faults() - faults_start
        growth.append((resident_mb("VmHWM") - before, resident_mb("RssFile") - file_before))
    peaks = []
    for _ in range(0 if args.no_tensor_peak else 2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.step(queries, responses, scores)
        peaks.append(tensor_peak_mb(prof))
        del prof
    peak = max(peaks, default=None)
    result = {
        "rank": trainer.accelerator.process_index, "processes": trainer.accelerator.num_processes,
        "deepspeed": trainer.is_deepspeed_enabled,
        "sp_size": sequence_parallel_size(trainer.accelerator), "threads": torch.get_num_threads(),
        "tensor_peak_mb": peak, "tensor_peaks_mb": peaks, "step_seconds": seconds, "loss": stats["ppo/loss/total"],
        "resident_growth_mb": growth[0][0], "file_growth_mb": growth[0][1], "second_growth_mb": growth[1][0],
        "heap_free_mb": heap_free, "cpu_seconds": cpu, "second_cpu_seconds": second_cpu,
        "faults": faults, "second_faults": second_faults,
    }  # fmt: skip
    print(RESULT_MARKER + json.dumps(result), flush=True)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # destroys the process group: the interpreter then exits normally


def resident_mb(field: str) -> float:
    """This process's ``VmRSS`` (resident now) or ``VmHWM`` (its peak) from /proc/self/status, in MB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024 / 1e6


def cpu_seconds() -> float:
    """This process's user + system CPU time so far, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def minor_faults() -> int:
    """This process's minor page faults so far (the kernel mapping a page in: for malloc, a fresh zeroed page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33): sums over all of malloc's arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def malloc_free_mb() -> float | None:
    """Bytes glibc's malloc holds free in its heaps (``fordblks``), in MB; None without glibc's ``mallinfo2``."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().fordblks / 1e6


def group_config(args, directory: Path, sequence_parallel: bool = True) -> Path:
    """The sequence-parallel accelerate config with DeepSpeed's settings in a JSON file: ZeRO-2, gradient
    buckets of the model's parameter count; without ``sequence_parallel`` its ``parallelism_config`` left out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=max(args.lengths), n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads)  # fmt: skip
    parameters = sum(p.numel() for p in GPT2LMHeadModel(config).parameters()) + args.width + 1  # and the value head
    bucket = -(-parameters // 1024) * 1024  # DeepSpeed wants a multiple of its alignment
    deepspeed = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    }  # fmt: skip
    (directory / "deepspeed.json").write_text(json.dumps(deepspeed))
    lines = []
    source = (REPO_ROOT / "accelerate_configs" / "deepspeed_sequence_parallel.yaml").read_text().splitlines()
    for line in source:
        if line.strip().startswith(("offload_", "zero3_init_flag", "zero_stage", "mixed_precision")):
            continue
        if not sequence_parallel and line.strip().startswith("parallelism_config"):
            continue
        lines.append(line)
        if line.startswith("deepspeed_config:"):
            lines.append(f"  deepspeed_config_file: {directory / 'deepspeed.json'}")
    (directory / "config.yaml").write_text("\n".join(lines) + "\n")
    return directory / "config.yaml"


def run(args, processes: int, deepspeed: bool = True) -> list[dict]:
    """The worker alone (1 process, no launcher) without ``deepspeed``, or launched under DeepSpeed ZeRO-2: as one
    sequence-parallel group of ``processes``, or as 1 process without sequence parallelism."""
    worker_args = [str(Path(__file__).resolve()), "--worker", "--lengths", *map(str, args.lengths), "--layers",
                   str(args.layers), "--width", str(args.width), "--heads", str(args.heads)]  # fmt: skip
    for flag in ("gradient_checkpointing", "return_freed_cpu_memory", "no_tensor_peak"):
        if getattr(args, flag):
            worker_args.append(f"--{flag}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(max(args.threads // processes, 1))}
    if args.mmap_threshold is not None:
        env.update(MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold), MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
    if not deepspeed:
        cmd = [sys.executable, *worker_args]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        directory = Path(tempfile.mkdtemp())
        config = group_config(args, directory, sequence_parallel=processes > 1)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(processes), "--main_process_port", str(port), *worker_args]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    # The processes of a group share one stdout: two results can land on one line, so each is read where its marker
    # starts, up to the end of its JSON object.
    decoder, text = json.JSONDecoder(), out.stdout
    starts = [i + len(RESULT_MARKER) for i in range(len(text)) if text.startswith(RESULT_MARKER, i)]
    return sorted((decoder.raw_decode(text, start)[0] for start in starts), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--return_freed_cpu_memory", action="store_true",
                        help="PPOConfig(keep_freed_cpu_memory=False): glibc's own malloc settings")
    parser.add_argument("--mmap_threshold", type=int, default=None,
                        help="bytes: glibc maps every block above it on its own (the trainer leaves it alone)")
    parser.add_argument("--no_tensor_peak", action="store_true",
                        help="skip the two profiled steps (no tensor peak; the resident growth and times only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    alone = run(args, 1, deepspeed=False)[0]
    alone_deepspeed = run(args, 1)[0]
    group = run(args, 2)
    checkpointing = ", gradient checkpointing" if args.gradient_checkpointing else ""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    malloc = "" if args.mmap_threshold is None else f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
    malloc += ", keep_freed_cpu_memory=False" if args.return_freed_cpu_memory else ""
    print(f"load average {load}; rows {args.lengths} tokens; {args.layers} x {args.width}, {args.heads} "
          f"heads{checkpointing}{malloc}")  # fmt: skip
    print("| processes | DeepSpeed | sp_size | threads each | tensor peak per process (MB) | of 1 process | "
          "of 1 DeepSpeed process | 2 peaks (MB) | resident growth, first step (MB) | of 1 process | of it file-backed "
          "(MB) | malloc's free heap (MB) | resident growth, second step (MB) | of 1 process | step (s) | "
          "step CPU (s) | second step CPU (s) | page faults, first step | second step |")  # fmt: skip
    print("| ---: | --- |" + " ---: |" * 17)
    for r in [alone, alone_deepspeed, *group]:
        if args.no_tensor_peak:
            peak = ratio = ratio_deepspeed = both = "-"
        else:
            peak = f"{r['tensor_peak_mb']:.0f}"
            ratio = f"{r['tensor_peak_mb'] / alone['tensor_peak_mb']:.2f}"
            ratio_deepspeed = f"{r['tensor_peak_mb'] / alone_deepspeed['tensor_peak_mb']:.2f}"
            both = " / ".join(f"{p:.0f}" for p in r["tensor_peaks_mb"])
        resident = r["resident_growth_mb"] / alone["resident_growth_mb"]
        # the 1 process's second step often grows by nothing (its first step's heap serves it): no ratio then
        second = f"{r['second_growth_mb'] / alone['second_growth_mb']:.2f}" if alone["second_growth_mb"] >= 1 else "-"
        heap_free = "-" if r["heap_free_mb"] is None else f"{r['heap_free_mb']:.0f}"
        print(f"| {r['processes']} (rank {r['rank']}) | {'ZeRO-2' if r['deepspeed'] else 'no'} | {r['sp_size']} | "
              f"{r['threads']} | {peak} | {ratio} | {ratio_deepspeed} | {both} | "
              f"{r['resident_growth_mb']:.0f} | {resident:.2f} | {r['file_growth_mb']:.0f} | {heap_free} | "
              f"{r['second_growth_mb']:.0f} | {second} | {r['step_seconds']:.1f} | "
              f"{r['cpu_seconds']:.2f} | {r['second_cpu_seconds']:.2f} | {r['faults'] / 1e3:.0f}k | "
              f"{r['second_faults'] / 1e3:.0f}k |")  # fmt: skip
    print(f"loss: 1 process {alone['loss']:.6f}, 1 DeepSpeed process {alone_deepspeed['loss']:.6f}, "
          f"sequence-parallel {group[0]['loss']:.6f}")  # fmt: skip


if __name__ == "__main__":
    main()
