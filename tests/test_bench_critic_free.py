"""Keeps the critic-free block of `benchmarks/bench_step.py` working: the GRPO floor's passes and
advantages, and a 1-step run of the trainer and the floor on a tiny grouped workload."""

import dataclasses
import math

import torch
from test_bench_floor import TINY, bench, step_floors, step_measure, step_methods, step_workloads

TINY_GRPO = step_workloads.CriticFreeWorkload(**{**dataclasses.asdict(TINY), "name": "tiny-grpo", "num_samples_per_query": 2})


def test_grouped_batch_shares_queries_within_groups():
    queries, responses, _ = step_workloads.make_batch(TINY_GRPO)
    assert len(queries) == TINY.batch_size
    for i in range(0, len(queries), 2):
        assert torch.equal(queries[i], queries[i + 1])
    assert not torch.equal(queries[0], queries[2])


def test_critic_free_floor_runs_no_value_head_and_uses_grpo_advantages():
    lm = step_workloads.make_lm(TINY_GRPO, "cpu", torch.float32)
    floor = step_floors.CriticFreeFloor(lm, TINY.mini_batch_size, TINY.ppo_epochs, num_samples_per_query=2)
    assert floor.v_head is None
    assert {id(p) for g in floor.optimizer.param_groups for p in g["params"]} == {id(p) for p in lm.parameters()}
    queries, responses, scores = step_workloads.make_batch(TINY_GRPO)
    old = floor._rollout(queries, responses, scores)
    for i, r in enumerate(responses):
        group = [float(scores[j]) for j in (i - i % 2, i - i % 2 + 1)]
        mean = sum(group) / 2
        std = math.sqrt(sum((x - mean) ** 2 for x in group))  # unbiased: divided by 2 - 1
        expected = (float(scores[i]) - mean) / (std + 1e-6)
        torch.testing.assert_close(old["advantages"][i, : len(r)], torch.full((len(r),), expected), rtol=1e-5, atol=1e-6)
        assert old["advantages"][i, len(r) :].abs().sum() == 0
    before = [p.detach().clone() for p in lm.parameters()]
    floor.step(queries, responses, scores)
    assert any(not torch.equal(b, p) for b, p in zip(before, lm.parameters()))


def test_one_step_critic_free_benchmark_reports_step_and_floor():
    results = step_measure.run_benchmark([TINY_GRPO], steps=1, warmup=0)
    assert [(r["workload"], r["method"]) for r in results] == [("tiny-grpo", m) for m in step_methods.METHODS]
    for r in results:
        assert math.isfinite(r["median_s"]) and r["median_s"] > 0
    assert "| tiny-grpo | floor |" in bench.format_table(results)
