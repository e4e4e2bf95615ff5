"""Truncated sampling under sequence parallelism (PPO_SPEC section 23): the kept sets are split with the tokens over
the group - each process makes or reads the sets of its slice's slots, and the rollout's sets are gathered whole to
every process (ids padded to the group's widest set) - so 2 processes as one group take the step of 1 process, to
float32 rounding (`tests/distributed/sequence_parallel_step.py` with `--top_k`/`--top_p`, packed passes cut across
slices, a token budget, mini-batches of 2 and 2 epochs). The kept sets a group's processes recorded while sampling
travel with the responses through the group's generate(), so every process replays the same records."""

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_distributed import deepspeed_cpu_collectives  # noqa: F401 (fixture)
from test_sequence_parallel import KL_ATOL, assert_same_training, run_alone, run_launched
from test_truncated_head import brute_kept
from test_truncated_replay import logits64, over_set, rederived
from test_truncated_step import CUTS, QUERIES, T, captured_step, make_lm, make_trainer

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, experience = captured_step(trainer, QUERIES, batch)
    assert not rederived(caught)
    for i, (query, response) in enumerate(zip(QUERIES, batch)):
        z = logits64(lm, query, response)
        sets = brute_kept(z / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z, response, sets), atol=2e-5)
