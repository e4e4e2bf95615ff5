"""Keeps `benchmarks/bench_step.py` working: the floor's arithmetic, its pass count, and a 1-step run."""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import trl_lite.models.packed_attention as packed_attention

BENCH_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_step.py"
sys.path.insert(0, str(BENCH_PATH.parent))  # bench_step.py and its modules import each other by name
import peak_memory  # noqa: E402
import step_floors  # noqa: E402
import step_measure  # noqa: E402
import step_methods  # noqa: E402
import step_workloads  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_step", BENCH_PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = step_workloads.Workload(
    "tiny",
    n_layer=2,
    n_embd=32,
    n_head=2,
    batch_size=4,
    mini_batch_size=2,
    ppo_epochs=2,
    query_len=(2, 5),
    response_len=(2, 7),
    vocab_size=57,
)


def test_floor_logprobs_match_full_vocabulary_forward():
    lm = step_workloads.make_lm(TINY, "cpu", torch.float32).eval()
    queries, responses, _ = step_workloads.make_batch(TINY)
    rows = [3, 0, 2]
    batch = step_floors.pack_rows(queries, responses, rows, lm.config.pad_token_id, "cpu")
    with torch.no_grad():
        logprobs, _ = step_floors.response_logprobs(lm, batch)
    with_grad, _ = step_floors.response_logprobs(lm, batch, buffer=torch.empty(40, TINY.vocab_size))  # the training path (HeadLogProb)
    assert logprobs.shape == (3, max(len(responses[i]) for i in rows))
    torch.testing.assert_close(with_grad.detach(), logprobs)
    for j, i in enumerate(rows):
        q, r = queries[i], responses[i]
        with torch.no_grad():
            full = lm(torch.cat([q, r])[None]).logits[0].double().log_softmax(-1)
        want = full[len(q) - 1 : len(q) + len(r) - 1].gather(-1, r[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[j, : len(r)].double(), want, atol=1e-5, rtol=1e-5)
        assert batch["mask"][j].sum() == len(r)


def test_floor_head_logprob_and_gradients_match_float64_autograd(monkeypatch):
    monkeypatch.setattr(step_floors, "rows_per_chunk", lambda z: 16)  # 40 rows: chunks of 16, 16 and 8
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 5, generator=g).requires_grad_(True)
    weight = (2 * torch.randn(7, 5, generator=g)).requires_grad_(True)
    target = torch.randint(0, 7, (40,), generator=g)
    weights = torch.randn(40, generator=g)
    chosen = step_floors.HeadLogProb.apply(hidden, weight, target, torch.empty(64, 7))  # more rows than needed
    (chosen * weights).sum().backward()
    hidden64, weight64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    want = (hidden64 @ weight64.T).log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(chosen.double(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), weight64.grad, rtol=0, atol=1e-5)
    no_grad = step_floors.head_logprob_no_grad(hidden.detach(), weight.detach(), target)
    torch.testing.assert_close(no_grad.double(), want.detach(), rtol=1e-6, atol=1e-6)


def test_floor_step_does_exactly_the_ppo_passes_and_updates_the_policy():
    lm = step_workloads.make_lm(TINY, "cpu", torch.float32)
    floor = step_floors.FloorPPO(lm, TINY.mini_batch_size, TINY.ppo_epochs)
    calls = {"policy_grad": 0, "policy_no_grad": 0, "ref": 0}

    def count_policy(module, args, output):
        calls["policy_grad" if torch.is_grad_enabled() else "policy_no_grad"] += 1

    def count_ref(module, args, output):
        calls["ref"] += 1

    lm.transformer.register_forward_hook(count_policy)
    floor.ref.transformer.register_forward_hook(count_ref)
    before = [p.detach().clone() for p in lm.parameters()]
    floor.step(*step_workloads.make_batch(TINY))
    chunks = TINY.batch_size // TINY.mini_batch_size
    assert calls == {"policy_grad": TINY.ppo_epochs * chunks, "policy_no_grad": chunks, "ref": chunks}
    assert all(not torch.equal(b, p) for b, p in zip(before, lm.parameters()))
    assert all(p.grad is None for p in lm.parameters())


# The CPU run's numbers: its tensor peak is read from the profiler's CPU memory events, which a trainer on a
# visible GPU does not produce (the H100 run of 2026-11-26 saw 0.0006 MiB); scripts/gpu_check.py times
# bench_step.py on the GPU itself.
@pytest.mark.cpu_only
def test_one_step_benchmark_reports_step_and_floor(tmp_path):
    weights_mb = sum(p.numel() * 4 for p in step_workloads.make_lm(TINY, "cpu", torch.float32).parameters()) / 2**20
    results = step_measure.run_benchmark([TINY], steps=1, warmup=1)
    assert [(r["workload"], r["method"]) for r in results] == [("tiny", m) for m in ("step", "step-padded", "floor")]
    for r in results:
        assert math.isfinite(r["median_s"]) and r["median_s"] > 0
        assert math.isfinite(r["peak_mb"]) and math.isfinite(r["tokens_per_s"])
        # At least the gradients of every weight are alive at the peak of the first step.
        assert r["tensor_peak_mb"] >= weights_mb
    table = bench.format_table(results)
    assert "| tiny | step |" in table and "| tiny | step-padded |" in table and "| tiny | floor | " in table
    output = tmp_path / "RESULTS.md"
    header = "# results\n\nWhat this file holds, in the maintainers' words.\n"
    output.write_text(header + "\n## example: run.py\n\n    python run.py\n\nMachine: m\n")
    bench.write_results(output, "cpu fp32: other", "kept")
    bench.write_results(output, "cpu fp32: tiny", table)
    bench.write_results(output, "cpu fp32: other", "replaced")
    text = output.read_text()
    assert text.startswith(header)  # the header and other writers' sections stay as they were, indentation included
    assert "\n## example: run.py\n\n    python run.py\n\nMachine: m\n" in text
    assert "## cpu fp32: other\n\nreplaced\n" in text and "kept" not in text and "| tiny | step |" in text


# w4 shrunken: a Qwen2 with w4's head grouping (14 query heads over 2 key/value heads), tied embeddings
# and spread of response lengths, small enough for the CPU.
TINY_W4 = dataclasses.replace(
    step_workloads.W4, name="tiny-w4", n_layer=2, n_embd=56, intermediate_size=64, vocab_size=97, batch_size=4,
    mini_batch_size=2, ppo_epochs=2, query_len=(4, 8), response_len=(4, 16),
)  # fmt: skip


@pytest.mark.parametrize("workload", [TINY, TINY_W4], ids=["gpt2", "qwen2"])
def test_needed_flops_match_torch_flop_counter_on_each_row_alone(workload):
    # torch's FlopCounterMode counts the matrix products of a forward + backward of each row alone
    # (eager attention: the full T x T scores, where the needed work is the causal half).
    from torch.utils.flop_counter import FlopCounterMode

    lm = step_workloads.make_lm(workload, "cpu", torch.float32)
    lm.set_attn_implementation("eager")
    v_head = torch.nn.Linear(workload.n_embd, 1)
    d, layers, epochs = workload.n_embd, workload.n_layer, workload.ppo_epochs
    expected = 0.0
    for q, r in zip(*step_workloads.make_batch(workload)[:2]):
        ids, t = torch.cat((q, r)).unsqueeze(0), len(q) + len(r)
        with FlopCounterMode(display=False) as counter:
            hidden = lm.base_model(input_ids=ids, use_cache=False).last_hidden_state
            logits = lm.lm_head(hidden[0, len(q) - 1 : t - 1])
            (logits.sum() + v_head(hidden).sum()).backward()
        forward = counter.get_total_flops() / 3  # a backward is two forwards' products
        forward -= layers * (4 * d * t * t - 2 * d * t * (t + 1))  # full scores -> causal half
        expected += (2 + 3 * epochs) * forward  # policy + reference rollout, epochs x (forward + backward)
    assert step_workloads.needed_flops(workload) == pytest.approx(expected, rel=1e-9)


def test_w4_is_the_qwen2_half_billion_shape_with_rlhf_lengths():
    # Built on the meta device: the shape only. Qwen2-0.5B has 494,032,768 parameters (embeddings tied).
    with torch.device("meta"):
        lm = step_workloads.make_lm(step_workloads.W4, "meta", torch.bfloat16)
    assert sum(p.numel() for p in lm.parameters()) == 494_032_768
    config = lm.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (14, 2, True)
    assert step_workloads.W4.batch_size == 64 and step_workloads.W4.mini_batch_size == 16 and step_workloads.W4.ppo_epochs == 2
    queries, responses, _ = step_workloads.make_batch(step_workloads.W4)
    q_lens, r_lens = [len(q) for q in queries], sorted(len(r) for r in responses)
    assert 64 <= min(q_lens) and max(q_lens) <= 256 and 64 <= r_lens[0] and r_lens[-1] <= 1024
    # Log-uniform: about as many responses below 256 tokens (the geometric middle) as above.
    assert 20 <= sum(n < 256 for n in r_lens) <= 44 and r_lens[-1] > 700


def test_the_packed_floor_gives_the_padded_floors_logprobs_and_values():
    lm = step_workloads.make_lm(TINY_W4, "cpu", torch.float32)
    padded, packed = step_floors.FloorPPO(lm, 2, 1), step_floors.PackedFloorPPO(lm, 2, 1)
    queries, responses, _ = step_workloads.make_batch(TINY_W4)
    rows = [2, 0, 3]
    with torch.no_grad():
        want = step_floors.response_logprobs(lm, padded._pack(queries, responses, rows), padded.v_head)
        with packed_attention.attend_per_row([lm]):
            got = step_floors.response_logprobs(lm, packed._pack(queries, responses, rows), padded.v_head)
    mask = padded._pack(queries, responses, rows)["mask"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a * mask, b * mask, rtol=1e-5, atol=1e-5)


def test_one_step_of_shrunken_w4_with_every_method():
    methods = (*step_methods.METHODS, step_methods.PACKED_FLOOR)
    results = step_measure.run_benchmark([TINY_W4], methods, steps=1, warmup=0, peak_gflops=1.0, tensor_peak=False)
    assert [r["method"] for r in results] == list(methods)
    for r in results:
        assert math.isfinite(r["median_s"]) and r["median_s"] > 0 and r["tflops_per_s"] > 0
        assert r["peak_fraction"] == pytest.approx(r["gflops_per_s"] / 1.0)
    table = bench.format_table(results)
    assert "median x floor-packed" in table and "| tiny-w4 | floor-packed |" in table and "MFU (x peak)" in table
    assert "Qwen2 2 x 56 (14 heads over 2 key/value heads" in bench.describe_workloads([TINY_W4])


def test_critic_floor_trains_policy_and_critic_apart():
    """The separate-critic floor: values from the critic's score head at the response positions, and
    each model changed by its own update only."""
    lm = step_workloads.make_lm(TINY, "cpu", torch.float32)
    critic = step_workloads.make_critic(lm, "cpu", torch.float32)
    floor = step_floors.FloorCriticPPO(lm, critic, TINY.mini_batch_size, TINY.ppo_epochs)
    queries, responses, scores = step_workloads.make_batch(TINY)
    batch = step_floors.pack_rows(queries, responses, [1, 2], lm.config.pad_token_id, "cpu")
    with torch.no_grad():
        values = floor._values(batch, None)
        for j, i in enumerate([1, 2]):
            q, r = queries[i], responses[i]
            hidden = critic.transformer(torch.cat([q, r])[None]).last_hidden_state[0]
            want = critic.score(hidden[len(q) - 1 : len(q) + len(r) - 1]).squeeze(-1)
            torch.testing.assert_close(values[j, : len(r)], want, rtol=1e-5, atol=1e-6)
    policy_before, critic_before = lm.lm_head.weight.detach().clone(), critic.score.weight.detach().clone()
    floor.step(queries, responses, scores)
    assert not torch.equal(critic_before, critic.score.weight)
    assert not torch.equal(policy_before, lm.lm_head.weight)
    assert all(p.grad is None for p in [*lm.parameters(), *critic.parameters()])


def test_greedy_loop_benchmark_gives_both_loops_the_same_work(monkeypatch):
    # bench_loop imports bench_step by name from benchmarks/.
    monkeypatch.syspath_prepend(str(BENCH_PATH.parent))
    spec = importlib.util.spec_from_file_location("bench_loop", BENCH_PATH.parent / "bench_loop.py")
    bench_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_loop)
    loop = bench_loop.LoopWorkload("loop-test", TINY, generation_batch_size=3, new_tokens=(4, 9))
    generated = {}
    for cls in (bench_loop.TrlLoop, bench_loop.PlainLoop):
        original = cls.iteration

        def recording(self, queries, original=original, name=cls.__name__):
            times = original(self, queries)
            generated.setdefault(name, []).append(times["new_tokens"])
            return times

        monkeypatch.setattr(cls, "iteration", recording)
    times = bench_loop.run_loops(loop, iterations=2, warmup=0, greedy=True)
    # Greedy decoding to a fixed length: the same number of new tokens per iteration in both loops
    # (EOS may end rows early, at the same place in both).
    assert generated["TrlLoop"] == generated["PlainLoop"] and len(generated["TrlLoop"]) == 2
    assert all(len(times[name]) == 2 for name in ("trl_lite", "plain"))
    table = bench_loop.format_loop_table("loop-test", times)
    assert table.count("\n") == 3 and "| loop-test | plain |" in table


def test_long_workloads_hold_a_few_long_rows_and_a_budget_of_the_longest():
    """`long` (issue 36): 16 rows of which 4 are long, the row splits of 4 and 1 rows, the budget run whose passes
    hold the longest possible row, and a one-row step of exactly the budget's tokens (its peak reference)."""
    rows4, rows1, budget, one_pass = step_workloads.long_workloads()
    queries, responses, _ = step_workloads.make_batch(budget)
    lengths = [len(r) for r in responses]
    assert len(lengths) == 16 and sum(n >= 4096 for n in lengths) == 4 and min(lengths) >= 256 and max(lengths) <= 8192
    options = json.loads(budget.options)
    assert options["max_tokens_per_minibatch"] == 64 + 8192 and options["gradient_accumulation_steps"] == 4
    assert json.loads(rows1.options)["gradient_accumulation_steps"] == 16 and rows1.mini_batch_size == 1
    assert step_workloads.make_batch(rows4)[1][3].tolist() == responses[3].tolist()  # the same batch for every variant
    (q,), (r,), _ = step_workloads.make_batch(one_pass)
    assert len(q) + len(r) == options["max_tokens_per_minibatch"]
    small = step_workloads.WORKLOAD_GROUPS["long-small"]()
    assert [w.n_layer for w in small] == [2] * 4 and json.loads(small[2].options)["max_tokens_per_minibatch"] == 4 + 512


def test_the_packed_floor_is_left_out_where_it_does_not_exist():
    methods = (*step_methods.METHODS, step_methods.PACKED_FLOOR)
    assert step_methods.methods_for(TINY_W4, methods) == list(methods)
    assert step_methods.methods_for(step_workloads.GRPO_W1, methods) == list(step_methods.METHODS)
    assert step_methods.methods_for(step_workloads.CRITIC_WORKLOADS["critic"], methods) == list(step_methods.METHODS)
    with pytest.raises(ValueError, match="'floor-packed' exists for the value-head workloads, not 'grpo-w1'"):
        step_methods.make_step_fn(step_methods.PACKED_FLOOR, step_workloads.GRPO_W1, "cpu", torch.float32)
    assert bench.parse_args(["--device", "cpu"]).methods == list(step_methods.METHODS)


def _profile_of(allocations):
    """A stand-in for a finished ``torch.profiler.profile`` whose event tree holds these CPU allocation records
    ``(time, address, bytes)`` (negative bytes: a free), nested one level under an op as the profiler nests them."""
    allocation = torch._C._profiler._EventType.Allocation
    cpu = torch.device("cpu")

    def record(time, ptr, nbytes):
        fields = type("Fields", (), {"device": cpu, "ptr": ptr, "alloc_size": nbytes})()
        return type("Event", (), {"tag": allocation, "extra_fields": fields, "start_time_ns": time, "children": []})()

    op = type("Event", (), {"tag": None, "children": [record(*a) for a in allocations[1:]]})()
    roots = [record(*allocations[0]), op]
    results = type("Results", (), {"experimental_event_tree": lambda self: roots})()
    return type("Profile", (), {"profiler": type("Profiler", (), {"kineto_results": results})()})()


def test_tensor_peak_replays_allocations_by_address():
    mb = 2**20
    # Plain records: 3 MB live at most; freeing a tensor made before the region (address 9) counts down.
    plain = [(0, 1, 2 * mb), (1, 2, mb), (2, 1, -2 * mb), (3, 9, -4 * mb), (4, 3, 5 * mb)]
    assert peak_memory.tensor_peak_mb(_profile_of(plain)) == 3
    # Address 1 freed on a thread the profiler does not follow (no record), then reused: the first tensor
    # stops counting at the reuse. The sum of the records alone would report 2 + 2 + 2 = 6 MB.
    unrecorded = [(0, 1, 2 * mb), (1, 1, 2 * mb), (2, 1, -2 * mb), (3, 1, 2 * mb)]
    assert peak_memory.tensor_peak_mb(_profile_of(unrecorded)) == 2
