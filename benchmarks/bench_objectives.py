"""The step-time cost of each option of docs/algorithm.md sections 13-15 on `w1`, the runs taking turns.

    python benchmarks/bench_objectives.py --rounds 6

One trainer per option (the `objectives` workloads of `bench_step.py`: `w1` with clip-higher, dual
clip, GSPO, each loss aggregation, the entropy bonus, the score shaping, TIS with engine log-probs)
and a plain `w1` trainer first and last, all in this process on the same batch; each round runs one step of every
trainer in turn, so a change of the shared machine's load reaches all of them alike. Prints, per
option, the median step time and its ratio to the plain step's median (`bench_step.py` runs its
workloads one after the other, which on a shared machine turns load drift into differences).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from step_methods import make_step_fn
from step_workloads import DTYPES, WORKLOAD_GROUPS, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per option (after one warm-up step each)")
    args = parser.parse_args()
    workloads = WORKLOAD_GROUPS["objectives"]()
    # The plain step again at the end: how much the position in a round alone moves a time.
    workloads.append(dataclasses.replace(workloads[0], name="w1 (again, last)"))
    runs = {}
    for workload in workloads:
        torch.manual_seed(workload.seed)
        runs[workload.name] = (make_step_fn("step", workload, "cpu", DTYPES["fp32"]), make_batch(workload))
    times = {name: [] for name in runs}
    for round_index in range(args.rounds + 1):
        for name, (step, batch) in runs.items():
            start = time.perf_counter()
            step(*batch)
            if round_index:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times[workloads[0].name])
    print(f"{'workload':<26} {'median s':>9} {'x w1':>6}  steps")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:<26} {median:9.3f} {median / base:6.2f}  {' '.join(f'{s:.2f}' for s in seconds)}")


if __name__ == "__main__":
    main()
