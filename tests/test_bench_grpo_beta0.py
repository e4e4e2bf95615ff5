"""Keeps the `grpo-beta0` block of `benchmarks/bench_step.py` working: its floor takes the trainer's update,
and a 1-step run reports the passes without grad per step and the reference copy's size of both paths."""

import copy
import dataclasses
import json
import math

import torch
from test_bench_floor import TINY, bench, step_floors, step_measure, step_workloads

from trl_lite import PPOConfig, PPOTrainer

# Named grpo-beta0*: stepped like grpo-beta0 (KL 0, mini-batches of 2 accumulated into one update).
TINY_BETA0 = step_workloads.CriticFreeWorkload(**{
    **dataclasses.asdict(step_workloads.GRPO_BETA0), **{k: getattr(TINY, k) for k in ("n_embd", "query_len", "response_len", "vocab_size")},
    "name": "grpo-beta0-tiny", "batch_size": 4, "mini_batch_size": 2, "num_samples_per_query": 2,
    "options": json.dumps({"gradient_accumulation_steps": 2, "init_kl_coef": 0.0, "adap_kl_ctrl": False}),
})  # fmt: skip


def test_on_policy_floor_takes_the_trainers_update():
    """Both with SGD: the floor's forward + backward per mini-batch with lp_old = lp detached, gradients
    accumulated into one step, equals the trainer's step without passes."""
    lm = step_workloads.make_lm(TINY_BETA0, "cpu", torch.float32)
    start = copy.deepcopy(lm.state_dict())
    config = PPOConfig(batch_size=4, mini_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=1, learning_rate=1.0,
                       init_kl_coef=0.0, advantage_estimator="grpo", num_samples_per_query=2, seed=0)  # fmt: skip
    model = copy.deepcopy(lm)
    trainer = PPOTrainer(config, model, tokenizer=None, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    floor = step_floors.OnPolicyFloor(lm, 2, 1, num_samples_per_query=2)
    floor.optimizer = torch.optim.SGD(lm.parameters(), lr=1.0)
    batch = step_workloads.make_batch(TINY_BETA0)
    for step in (trainer.step, floor.step):
        torch.manual_seed(0)  # one permutation: token_mean averages per mini-batch
        step(*batch)
    moved = 0.0
    for key, value in lm.state_dict().items():
        update = (value - start[key]).norm()
        assert (model.state_dict()[key] - value).norm() <= 1e-4 * update + 1e-6, key
        moved = max(moved, float(update))
    assert moved > 1e-3


def test_one_step_grpo_beta0_benchmark_reports_passes_and_reference_size():
    methods = ["step", "step-every-pass", "floor"]
    results = step_measure.run_benchmark([TINY_BETA0], methods=methods, steps=1, warmup=0, tensor_peak=False)
    by_method = {r["method"]: r for r in results}
    assert sorted(by_method) == sorted(methods) and all(math.isfinite(r["median_s"]) for r in results)
    assert by_method["step"]["rollout_passes"] == 0 and by_method["step"]["reference_mb"] == 0
    assert by_method["step-every-pass"]["rollout_passes"] == 2
    params = sum(p.numel() for p in step_workloads.make_lm(TINY_BETA0, "cpu", torch.float32).parameters())
    # A float32 copy of every parameter (and of the wrapper's 1-output value head).
    assert 0 < by_method["step-every-pass"]["reference_mb"] - params * 4 / 2**20 < 1e-3
    assert "| grpo-beta0-tiny | step-every-pass |" in bench.format_table(results)
