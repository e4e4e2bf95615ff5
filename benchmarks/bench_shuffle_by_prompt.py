"""The tokens the training passes save with `PPOConfig.shuffle_by_prompt`, on bench_step.py's `shared-prefix` batch.

    python benchmarks/bench_shuffle_by_prompt.py [--mini_batch_sizes 8 16] [--steps 2] [--threads 1]

`shared-prefix` (4 prompts of 512 tokens, G = 8, responses of 32-96, GRPO, GPT-2 of 4 layers, 256 wide) trains
in mini-batches of the whole batch there, where every training pass holds whole groups anyway; here the
mini-batches are smaller. Per mini-batch size, `prefix_sharing=True` with the row shuffle (`False`) and the
prompt shuffle (`True`): the share of the training passes' prompt + response tokens not run (averaged over the
steps; the rollout passes' count is left out), and the median step time. docs/prefix_sharing.md has results.
"""

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_floors import KL_COEF, LEARNING_RATE  # noqa: E402
from step_methods import quiet_trainer  # noqa: E402
from step_workloads import SHARED_PREFIX, grouped_batch, make_lm  # noqa: E402


def measure(workload, by_prompt: bool, steps: int) -> tuple[float, float]:
    """On the grouped (critic-free) ``workload``: the training passes' saved token share (mean over ``steps``)
    and the median step seconds."""
    from trl_lite import PPOConfig

    mini_batch_size = workload.mini_batch_size
    lm = make_lm(workload, "cpu", torch.float32)
    config = PPOConfig(
        batch_size=workload.batch_size, mini_batch_size=mini_batch_size, ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE, init_kl_coef=KL_COEF, adap_kl_ctrl=False, advantage_estimator="grpo",
        num_samples_per_query=workload.num_samples_per_query, seed=workload.seed, prefix_sharing=True,
        shuffle_by_prompt=by_prompt,
    )  # fmt: skip
    trainer = quiet_trainer(config, lm, copy.deepcopy(lm), tokenizer=None)
    prefix, train, saved = trainer.forward.prefix, trainer.learner.train, []

    def counted(experience):
        prefix.take_saving()  # the rollout passes' count, left out
        result = train(experience)
        saved.append(prefix.take_saving())
        return result

    trainer.learner.train = counted
    batch = grouped_batch(workload)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        trainer.step(*batch)
        times.append(time.perf_counter() - start)
    return statistics.mean(saved[1:]), statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mini_batch_sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| mini_batch_size | shuffle_by_prompt | training tokens saved | step (s) |")
    print("| ---: | --- | ---: | ---: |")
    for size in args.mini_batch_sizes:
        for by_prompt in (False, True):
            workload = dataclasses.replace(SHARED_PREFIX, mini_batch_size=size)
            saved, seconds = measure(workload, by_prompt, args.steps)
            print(f"| {size} | {by_prompt} | {saved:.3f} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
