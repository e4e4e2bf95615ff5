"""Keeps the `shared_prefix` block of `benchmarks/bench_step.py` working: its workloads' groups, a 1-step
run of the three prefix-sharing methods on a tiny grouped workload, and the share of tokens each reports."""

import dataclasses

import pytest
import torch
from test_bench_floor import TINY, bench, step_measure, step_methods, step_workloads

TINY_SHARED = dataclasses.replace(
    step_workloads.SHARED_PREFIX, name="tiny-shared", n_layer=2, n_embd=32, n_head=2, batch_size=8, mini_batch_size=8,
    ppo_epochs=1, query_len=(12, 12), response_len=(2, 5), vocab_size=57, num_samples_per_query=4,
)  # fmt: skip


def test_shared_prefix_workloads_hold_groups_of_equal_prompts():
    for workload, group, prompt in ((step_workloads.SHARED_PREFIX, 8, 512), (step_workloads.SHORT_PAIRS, 2, 16)):
        queries, responses, _ = step_workloads.make_batch(workload)
        assert len(queries) == 32 and {len(q) for q in queries} == {prompt}
        assert all(32 <= len(r) <= 96 for r in responses)
        for i in range(len(queries)):
            assert torch.equal(queries[i], queries[i - i % group])
        assert not torch.equal(queries[0], queries[group])


def test_prefix_methods_report_the_tokens_their_passes_ran():
    methods = list(step_methods.PREFIX_METHODS)
    results = step_measure.run_benchmark([TINY_SHARED], methods, steps=1, warmup=0, tensor_peak=False)
    assert [r["method"] for r in results] == methods
    queries, responses, _ = step_workloads.make_batch(TINY_SHARED)
    total = sum(len(q) + len(r) for q, r in zip(queries, responses))
    # Every pass holds the whole batch (mini_batch_size = batch_size): each group's prompt runs once.
    shared = 12 * 8 // 4 + sum(len(r) for r in responses)
    run = {r["method"]: r["tokens_run"] for r in results}
    # The automatic rule shares too: the groups save 72 of about 124 tokens, over its 25%.
    assert run == pytest.approx({"step-prefix-on": shared / total, "step-prefix-off": 1.0, "step-prefix-auto": shared / total})
    table = bench.format_table(results)
    assert "median x prefix-off" in table
    off_row = next(line for line in table.splitlines() if "| step-prefix-off |" in line)
    assert off_row.endswith("| 1.00 | - |")  # its own time over itself; no tensor peak measured


def test_prefix_methods_refuse_a_workload_without_groups():
    with pytest.raises(ValueError, match="step-prefix-on"):
        step_methods.make_step_fn("step-prefix-on", TINY, "cpu", torch.float32)


def test_shuffle_by_prompt_bench_counts_the_training_passes_saving():
    import importlib.util

    from test_bench_floor import BENCH_PATH

    spec = importlib.util.spec_from_file_location("bench_shuffle_by_prompt", BENCH_PATH.parent / "bench_shuffle_by_prompt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    workload = dataclasses.replace(TINY_SHARED, mini_batch_size=4, ppo_epochs=2)
    queries, responses, _ = step_workloads.make_batch(workload)
    total = sum(len(q) + len(r) for q, r in zip(queries, responses))
    torch.manual_seed(0)
    by_rows, _ = script.measure(workload, False, steps=1)
    by_prompt, _ = script.measure(workload, True, steps=1)
    assert by_prompt == pytest.approx(12 * 6 / total)  # every training pass: one group of 4, its prompt once
    assert by_rows < by_prompt


def test_the_automatic_rule_shares_shared_prefix_and_not_short_pairs():
    # The rule on the benchmark's own batches, through a trainer with prefix_sharing=None (no pass runs).
    from test_prefix_sharing import make_trainer

    trainer = make_trainer(None, batch_size=32, mini_batch_size=32)
    for workload, shares in ((step_workloads.SHARED_PREFIX, True), (step_workloads.SHORT_PAIRS, False)):
        queries, responses, _ = step_workloads.make_batch(workload)
        rows = trainer.forward.make_rows(queries, responses)
        assert (rows.prompt_ids is not None) == shares, workload.name
