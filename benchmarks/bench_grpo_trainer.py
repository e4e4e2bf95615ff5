"""GRPOTrainer.train() against the hand-written loop it replaces, on the same workload: the trainer's own overhead.

Both run the same generations in the same order with the same `PPOConfig` (made by `to_ppo_config` from one
`GRPOConfig`), the same AdamW, prompts and reward function: the hand-written loop is what a `step()` user writes
(prompt ids -> `PPOTrainer.generate` -> decode -> reward -> `step`), the trainer adds the prompt order, the reward
checks, TRL's metrics, the scheduler, callbacks, logging every step and the tqdm bar. Rounds alternate the two
(each round: a fresh trainer, warm-up generations, then timed ones); per-iteration wall and CPU (process) seconds,
medians over rounds. CPU seconds are the steadier number on a shared machine.

    python benchmarks/bench_grpo_trainer.py                  # writes its section of benchmarks/RESULTS.md
    python benchmarks/bench_grpo_trainer.py --rounds 2 --iterations 3 --output /tmp/r.md
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch
from datasets import Dataset, disable_progress_bars

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from bench_step import machine_description, write_results  # noqa: E402
from tiny_models import make_gpt2, make_tokenizer  # noqa: E402

from trl_lite import GRPOConfig, GRPOTrainer, NoDatasetWarning, PPOTrainer  # noqa: E402
from trl_lite.trainer.grpo.config_mapping import to_ppo_config  # noqa: E402
from trl_lite.trainer.grpo.grpo_trainer import _adamw  # noqa: E402
from trl_lite.trainer.grpo.prompts import PromptOrder, prompt_ids  # noqa: E402

WORDS = "the a this movie film story was is very good bad great awful i loved hated it".split()
NUM_GENERATIONS, PROMPTS_PER_GENERATION, MAX_NEW = 4, 8, 16


def workload_args(output_dir: str, max_steps: int, logging_steps: int = 1) -> GRPOConfig:
    # a constant learning rate: the trainer's runs and the loop's sample the same completions, the same work
    return GRPOConfig(output_dir=output_dir, per_device_train_batch_size=16, steps_per_generation=2,
                      num_generations=NUM_GENERATIONS, max_completion_length=MAX_NEW, max_steps=max_steps,
                      learning_rate=1e-4, lr_scheduler_type="constant", beta=0.04, logging_steps=logging_steps,
                      save_strategy="no", report_to="none", gradient_checkpointing=False, seed=0)  # fmt: skip


def dataset(rows: int = 64) -> Dataset:
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=g).tolist())
               for n in torch.randint(4, 12, (rows,), generator=g)]  # fmt: skip
    return Dataset.from_dict({"prompt": prompts})


def good_words(prompts, completions, completion_ids, **kwargs):
    return [float(sum(w in ("good", "great") for w in c.split())) for c in completions]


def model():
    return make_gpt2(n_layer=2, n_embd=128, n_head=2)


def run_trainer(warmup: int, iterations: int, output_dir: str, logging_steps: int) -> list[tuple[float, float, float]]:
    """Per-iteration (wall, cpu) seconds and tokens of GRPOTrainer.train() (a generation is 2 optimizer steps)."""
    trainer = GRPOTrainer(model(), [good_words], args=workload_args(output_dir, 2 * warmup, logging_steps),
                          train_dataset=dataset(), processing_class=make_tokenizer(padding_side="left"))  # fmt: skip
    trainer.train()
    trainer.max_steps = 2 * (warmup + iterations)
    tokens = trainer.state.num_input_tokens_seen
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = (time.perf_counter() - wall) / iterations, (time.process_time() - cpu) / iterations
    return [(wall, cpu, (trainer.state.num_input_tokens_seen - tokens) / iterations)]


def run_loop(warmup: int, iterations: int, output_dir: str, logging_steps: int) -> list[tuple[float, float, float]]:
    """Per-iteration (wall, cpu) seconds and tokens of the hand-written loop a step() user writes (no logging)."""
    args = workload_args(output_dir, 2 * (warmup + iterations))
    tokenizer, lm = make_tokenizer(padding_side="left"), model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoDatasetWarning)
        ppo = PPOTrainer(to_ppo_config(args, 1), lm, tokenizer=tokenizer, optimizer=_adamw(lm, args))
    order = PromptOrder(dataset(), PROMPTS_PER_GENERATION, 0, 1, args.seed)

    tokens = []

    def iteration():
        prompts = [row["prompt"] for row in order.next_rows()]
        queries = prompt_ids(tokenizer, prompts)
        responses = ppo.generate(queries, return_prompt=False, batch_size=len(queries), do_sample=True,
                                 max_new_tokens=MAX_NEW, num_return_sequences=NUM_GENERATIONS)  # fmt: skip
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = good_words([p for p in prompts for _ in range(NUM_GENERATIONS)], texts, None)
        ppo.step([q for q in queries for _ in range(NUM_GENERATIONS)], responses, [torch.tensor(s) for s in scores])
        tokens.append(NUM_GENERATIONS * sum(len(q) for q in queries) + sum(len(r) for r in responses))

    for _ in range(warmup):
        iteration()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        iteration()
    wall, cpu = (time.perf_counter() - wall) / iterations, (time.process_time() - cpu) / iterations
    return [(wall, cpu, sum(tokens[warmup:]) / iterations)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--logging_steps", type=int, default=1, help="The trainer logs every this many optimizer steps.")
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--worker", choices=["trainer", "loop"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker:  # one measurement in a fresh process, so neither method inherits the other's heap or caches
        disable_progress_bars()
        run = run_trainer if args.worker == "trainer" else run_loop
        ((wall, cpu, tokens),) = run(args.warmup, args.iterations, f"/tmp/bench_grpo_trainer_{os.getpid()}",
                                     args.logging_steps)
        print(f"RESULT {wall} {cpu} {tokens}")
        return
    machine = machine_description("cpu")
    results, work = {"trainer": [], "loop": []}, {"trainer": set(), "loop": set()}
    for r in range(args.rounds):
        for method in ("loop", "trainer") if r % 2 else ("trainer", "loop"):
            out = subprocess.run([sys.executable, __file__, "--worker", method, "--warmup", str(args.warmup),
                                  "--iterations", str(args.iterations), "--logging_steps", str(args.logging_steps)], capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout  # fmt: skip
            wall, cpu, tokens = map(float, out.strip().splitlines()[-1].split()[1:])
            results[method].append((wall, cpu))
            work[method].add(tokens)
            print(f"round {r + 1} {method}: {wall:.4f} s wall, {cpu:.4f} s cpu, {tokens:.1f} tokens per iteration", flush=True)
    medians = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in results.items()}
    loop_wall, loop_cpu = medians["loop"]
    rows = [f"| {m} | {w:.4f} | {w / loop_wall - 1:+.1%} | {c:.4f} | {c / loop_cpu - 1:+.1%} | {sorted(work[m])} |"
            for m, (w, c) in medians.items()]  # fmt: skip
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    body = (
        f"Machine: {machine}\n\n`python benchmarks/bench_grpo_trainer.py --rounds {args.rounds} --warmup {args.warmup} "
        f"--iterations {args.iterations} --logging_steps {args.logging_steps}`; commit {commit}; {date.today()}; load average at end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"\n\nWorkload: GPT-2 2 x 128 over the tests' 58-word vocabulary, {PROMPTS_PER_GENERATION} prompts x "
        f"{NUM_GENERATIONS} completions of at most {MAX_NEW} tokens a generation (transformers engine), two "
        "optimizer steps of 16 completions each, beta 0.04 (a reference pass), constant learning rate, the trainer "
        f"logging every {args.logging_steps} "
        "optimizer step(s) (the loop does not log). "
        "Per-iteration medians over rounds (each method in its own process, alternating first).\n\n"
        "| method | wall s / iteration | vs loop | cpu s / iteration | vs loop | tokens / iteration (each round) |\n"
        "| --- | ---: | ---: | ---: | ---: | --- |\n"
        + "\n".join(rows)
    )
    print(body)
    heading = f"cpu fp32: GRPOTrainer.train() against a hand-written step() loop, logging every {args.logging_steps}, torch threads 1"
    write_results(Path(args.output), heading, body)


if __name__ == "__main__":
    main()
