"""Truncated sampling under sequence parallelism (PPO_SPEC section 23): the kept sets are split with the tokens over
the group - each process makes or reads the sets of its slice's slots, and the rollout's sets are gathered whole to
every process (ids padded to the group's widest set) - so 2 processes as one group take the step of 1 process, to
float32 rounding (`tests/distributed/sequence_parallel_step.py` with `--top_k`/`--top_p`, packed passes cut across
slices, a token budget, mini-batches of 2 and 2 epochs)."""

import pytest
from test_distributed import deepspeed_cpu_collectives  # noqa: F401 (fixture)
from test_sequence_parallel import assert_same_training, run_alone, run_launched

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
