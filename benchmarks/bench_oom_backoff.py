"""What the out-of-memory back-off costs (docs/out_of_memory.md): a step with ``oom_backoff`` off and on, a
step after a back-off (half the budget: more, smaller passes) and a step in which a pass fails and its
backward batch is redone.

The trainers take turns step by step in one process, on the same batch at each step, so that the load of a
shared machine falls on all of them alike. The failure is injected on the CPU (``tests/oom_injection.py``) in
the middle training pass; for the "failing step" trainer the budget is set back before each step, so that
every timed step fails once.

Usage:
    python benchmarks/bench_oom_backoff.py [--steps 6] [--warmup 1] [--threads 2] [--output benchmarks/RESULTS.md]
"""

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT))

from oom_injection import InjectedOutOfMemory  # noqa: E402

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer  # noqa: E402

BATCH, MINI_BATCH, ACCUMULATION, EPOCHS = 16, 4, 2, 2
VARIANTS = ("off", "on", "after back-off", "failing step")


def make_trainer(backoff: bool) -> PPOTrainer:
    """The w1 shape of bench_step.py (GPT-2, 2 layers, 128 wide, GPT-2's vocabulary), no budget."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=50257, n_positions=128))
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(model)
    config = PPOConfig(batch_size=BATCH, mini_batch_size=MINI_BATCH, gradient_accumulation_steps=ACCUMULATION,
                       ppo_epochs=EPOCHS, oom_backoff=backoff, seed=0)  # fmt: skip
    return PPOTrainer(config, policy)


def make_batch(seed: int):
    """Queries of 8-16 tokens, responses of 16-32 (the classic comparison of docs/speed.md)."""
    g = torch.Generator().manual_seed(seed)
    queries = [torch.randint(3, 50257, (int(torch.randint(8, 17, (1,), generator=g)),), generator=g) for _ in range(BATCH)]
    responses = [torch.randint(3, 50257, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g) for _ in range(BATCH)]
    return queries, responses, [torch.randn((), generator=g) for _ in range(BATCH)]


def timed_step(trainer, batch, fail: bool) -> tuple[float, dict]:
    """Seconds of one step (with one failure in its middle training pass when ``fail``) and its statistics."""
    passes = EPOCHS * BATCH // MINI_BATCH
    with warnings.catch_warnings(), InjectedOutOfMemory(trainer.model, calls=(passes // 2,) if fail else ()):
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        stats = trainer.step(*batch)
        return time.perf_counter() - start, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="append a section to this Markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    trainers = {"off": make_trainer(False), "on": make_trainer(True), "after back-off": make_trainer(True),
                "failing step": make_trainer(True)}  # fmt: skip
    # One failure puts "after back-off" on half the failed pass's tokens for the rest of its run.
    timed_step(trainers["after back-off"], make_batch(0), fail=True)
    times = {name: [] for name in VARIANTS}
    stats = {}
    for step in range(args.warmup + args.steps):
        batch = make_batch(step + 1)
        for name, trainer in trainers.items():
            if name == "failing step":
                trainer.forward.memory.budget, trainer.forward.memory.backed_off = None, False
            seconds, stats[name] = timed_step(trainer, batch, fail=name == "failing step")
            if step >= args.warmup:
                times[name].append(seconds)
    base = statistics.median(times["off"])
    rows = []
    for name in VARIANTS:
        median = statistics.median(times[name])
        rows.append(f"| {name} | {median:.3f} | {median / base:.3f} | {int(stats[name]['ppo/minibatches'])} | "
                    f"{int(stats[name]['memory/oom_retries'])} | {int(stats[name]['memory/max_tokens_per_minibatch'])} |")  # fmt: skip
    load_end = os.getloadavg()
    lines = [
        "## cpu fp32: the out-of-memory back-off (oom_backoff)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in load_start)}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        "",
        f"`python benchmarks/bench_oom_backoff.py --steps {args.steps} --warmup {args.warmup}`: w1 shape (GPT-2, 2 x 128, "
        f"vocabulary 50257), batch {BATCH}, mini-batch {MINI_BATCH} x {ACCUMULATION} accumulation steps, {EPOCHS} epochs, "
        "no budget; the trainers take turns step by step; median of the timed steps; load average at end "
        f"{' '.join(f'{x:.2f}' for x in load_end)}",
        "",
        "| trainer | step s | / off | passes | oom retries | budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
