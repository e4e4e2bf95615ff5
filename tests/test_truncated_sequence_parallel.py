"""Truncated sampling under sequence parallelism (PPO_SPEC section 23): the kept sets are split with the tokens over
the group - each process makes or reads the sets of its slice's slots, and the rollout's sets are gathered whole to
every process (ids padded to the group's widest set) - so 2 processes as one group take the step of 1 process, to
float32 rounding (`tests/distributed/sequence_parallel_step.py` with `--top_k`/`--top_p`, packed passes cut across
slices, a token budget, mini-batches of 2 and 2 epochs). The kept sets a group's processes recorded while sampling
travel with the responses through the group's generate(), so every process replays the same records."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_agents import CALLS, successor_model, turn
from test_distributed import REPO, deepspeed_cpu_collectives, launch  # noqa: F401 (fixture)
from test_sequence_parallel import KL_ATOL, assert_same_training, run_alone, run_launched
from test_truncated_head import brute_kept
from test_truncated_replay import logits64, over_set, step_rederived
from test_truncated_step import CUTS, QUERIES, T, captured_step, make_lm, make_trainer
from transformers import AutoModelForCausalLM

from trl_lite.core.kept_sets import Truncation
from trl_lite.parallel.sequence_parallel import SequenceParallel

pytestmark = pytest.mark.xdist_group("distributed")


@pytest.mark.parametrize(
    "args",
    [
        ("--estimator", "gae", "--top_k", "5", "--top_p", "0.9", "--kl_penalty", "full"),
        ("--estimator", "grpo", "--model", "qwen2", "--top_p", "0.8", "--max_tokens", "40", "--lm_head_chunk_size", "5"),
    ],
)
def test_one_group_replays_the_kept_sets_of_one_process(tmp_path, args):
    (tmp_path / "sp").mkdir()
    (tmp_path / "alone").mkdir()
    parallel = run_launched("deepspeed_sequence_parallel", 2, tmp_path / "sp", *args)
    alone = run_alone(tmp_path / "alone", *args)
    assert (parallel["sp_size"], alone["sp_size"]) == (2, 1)
    assert parallel["longest_slice"] < alone["longest_slice"]  # the passes were cut
    assert all("policy/entropy_untruncated" in stats for stats in parallel["stats"])  # the truncated path ran
    assert_same_training(parallel, alone)
    # Per-slot numbers, and the slices' kept sets: token ids, as wide as the group's widest set.
    assert () in parallel["gathered_shapes"] and any(len(shape) == 1 for shape in parallel["gathered_shapes"])


def test_a_group_replays_the_kept_sets_its_processes_recorded_as_one_process_replays_them(tmp_path):
    """2 processes as one group generate (each a share, from a seed of its own) and step over the group's records: every
    process holds the same sets, nothing is re-derived, and the step equals one process's stepping the same rows over
    the same sets (passed explicitly), to float32 rounding."""
    args = ("--estimator", "grpo", "--model", "qwen2", "--top_k", "5", "--top_p", "0.9")
    (tmp_path / "sp").mkdir()
    (tmp_path / "alone").mkdir()
    parallel = run_launched("deepspeed_sequence_parallel", 2, tmp_path / "sp", *args, "--replay", "1")
    alone = run_alone(tmp_path / "alone", *args, "--replay_from", str(tmp_path / "sp" / "result.pt"))
    ours, theirs = parallel["replay"], alone["replay"]
    assert ours["same_on_every_process"] and not ours["rederived"] and not theirs["rederived"]
    assert ours["kept"] == theirs["kept"] and len(ours["kept"]) == 4
    assert parallel["generated_queries"] == [[2], [2]]  # each process sampled a share of the 4 queries
    assert ours["stats"].keys() == theirs["stats"].keys()
    for key, value in theirs["stats"].items():
        atol = KL_ATOL if "kl" in key.rsplit("/", 1)[-1] else 1e-6
        np.testing.assert_allclose(ours["stats"][key], value, rtol=1e-5, atol=atol, err_msg=key)
    assert_same_training(parallel, alone)


def test_a_groups_generate_gathers_the_kept_sets_its_processes_recorded(tmp_path):
    """The records travel with the responses through SequenceParallel.generate (its pickled all-gather, here over a
    1-process gloo group, and its broadcast for a single query): step() then replays them - nothing re-derived - and
    scores lp_old over the sampler's sets (the float64 rule's: the policy did not move)."""
    lm, cut = make_lm("qwen2"), CUTS["qwen_style"]
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        trainer.generation.sequence = SequenceParallel(dist.group.WORLD)
        torch.manual_seed(0)
        responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True)
        single = trainer.generate(QUERIES[1], return_prompt=False, max_new_tokens=6, do_sample=True)[0]
    finally:
        dist.destroy_process_group()
        trainer.generation.sequence = None
    assert len(trainer.generation.records) >= len({tuple(r.tolist()) for r in responses})
    batch = [responses[0], single, responses[2], responses[3]]
    experience, messages = step_rederived(trainer, QUERIES, batch)
    assert not messages
    for i, (query, response) in enumerate(zip(QUERIES, batch)):
        z = logits64(lm, query, response)
        sets = brute_kept(z / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z, response, sets), atol=2e-5)


def test_a_group_plays_episodes_and_steps_over_the_kept_sets_it_recorded_as_one_process(tmp_path):
    """run_episodes under sequence parallelism (issue 62's open question: its records per process?): 2 processes as one
    group, each sampling from a seed of its own, play the same multi-turn tool episodes at top-k 5 / top-p 0.9 - each
    turn's generate gives the group one sampling and gathers the sets its processes recorded with the responses - so
    both processes hold identical rows and identical kept sets, step() re-derives none, and two rounds of episodes and
    steps equal one process's steps on the same rows over the same sets, to float32 rounding. AsyncRollouts refuses
    more than one process, so it never runs in a group. Records kept per process instead would make step() refuse the
    group's rows, not train on wrong numbers (tests/distributed/episodes_sequence_parallel.py)."""
    model_dir, (sp, alone) = tmp_path / "model", (tmp_path / "sp", tmp_path / "alone")
    for path in (sp, alone):
        path.mkdir()
    # scaled so that at T 0.7 about 7 in 10 tokens follow the tool-calling map: sets of several tokens, episodes that
    # differ; noise on the head's zero rows breaks their ties (a tie at a top-p boundary is the sorter's choice)
    lm = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"), scale=0.03, seed=1)
    with torch.no_grad():
        lm.lm_head.weight.add_(0.01 * torch.randn(lm.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    lm.save_pretrained(model_dir)
    script = REPO / "tests" / "distributed" / "episodes_sequence_parallel.py"
    launch("deepspeed_sequence_parallel", script, "--base_model", str(model_dir), "--output_dir", str(sp))
    parallel = torch.load(sp / "result.pt", weights_only=False)
    result = subprocess.run([sys.executable, str(script), "--base_model", str(model_dir), "--output_dir", str(alone),
                             "--replay_from", str(sp / "result.pt")], cwd=script.parent, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    reference = torch.load(alone / "result.pt", weights_only=False)
    assert (parallel["sp_size"], parallel["num_processes"], reference["sp_size"]) == (2, 2, 1)
    assert "single process" in parallel["async_refusal"]
    for first, second in parallel["rounds"]:  # the group's processes hold the same rows and the same kept sets
        assert first == second
        assert all(kept is not None for kept in first["kept"])
        for response, mask, (offsets, _) in zip(first["responses"], first["masks"], first["kept"]):
            sizes = [b - a for a, b in zip(offsets, offsets[1:])]
            assert len(sizes) == len(response)  # one set per token: empty on the tool's, top-k 5 on the model's
            assert all((size == 0) if m == 0 else (1 <= size <= 5) for size, m in zip(sizes, mask))
    # the first round's sets are the sampler's: a float64 brute force on the initial weights
    lm, cut = AutoModelForCausalLM.from_pretrained(model_dir), Truncation(top_k=5, top_p=0.9)
    first = parallel["rounds"][0][0]
    columns = (first[key] for key in ("queries", "responses", "masks", "kept"))
    for query, response, mask, (offsets, ids) in zip(*columns):
        query, response, actions = torch.tensor(query), torch.tensor(response), torch.tensor(mask).bool()
        want = brute_kept(logits64(lm, query, response)[actions] / 0.7, cut)
        got = [sorted(ids[a:b]) for a, b, m in zip(offsets, offsets[1:], mask) if m]
        assert got == [row.nonzero().flatten().tolist() for row in want]
    played = [row for first, _ in parallel["rounds"] for row in zip(first["responses"], first["masks"], first["kept"])]
    assert any(0 in mask for _, mask, _ in played)  # some episodes read the tool's answer
    assert len({str(response) for response, _, _ in played}) > 4  # sampled: the episodes differ
    assert any(b - a > 1 for _, _, (offsets, _) in played for a, b in zip(offsets, offsets[1:]))  # sets wider than 1
    # each process sampled a share of the turns' queries (4 episodes, 2 processes): the records had to be gathered
    assert all(2 in calls for calls in parallel["engine_calls"])
    assert parallel["rederived"] == [False, False] and reference["rederived"] == [False]
    assert [r[0] for r in reference["rounds"]] == [r[0] for r in parallel["rounds"]]
    assert_same_training(parallel, reference)
    # Had each process kept only its own records, the group's kept sets would differ: step() refuses them (loudly, on
    # every process) rather than train on wrong numbers.
    (tmp_path / "own").mkdir()
    launch("deepspeed_sequence_parallel", script, "--base_model", str(model_dir), "--output_dir", str(tmp_path / "own"),
           "--own_sets_only", "1")  # fmt: skip
    refusal = torch.load(tmp_path / "own" / "result.pt", weights_only=False)["refusal"]
    assert refusal is not None and "different rows" in refusal and "kept sets" in refusal
