"""Prefix sharing on 2 processes (CPU, gloo): DDP, ZeRO-2 and ZeRO-3 steps equal the unshared ones, on GPT-2 and
on a tiny rotary grouped-query Qwen2.

Each launch of `tests/distributed/prefix_sharing_step.py` takes two GRPO steps with `prefix_sharing=False`
and then `True` in the same two processes (groups of 4 responses per prompt, prompts of different lengths
on each process). The shared run must give the unshared run's statistics and updated weights (float32,
relative 1e-5), hold the same weights on both processes, and report the same
`prefix_sharing/tokens_saved_fraction` on both: the share of the two processes' tokens together.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from test_distributed import SCRIPTS, base_model_dir, deepspeed_cpu_collectives, launch  # noqa: F401 (fixtures)
from tiny_models import make_qwen2

pytestmark = pytest.mark.xdist_group("distributed")

COMPARED = ("objective/kl", "objective/entropy", "objective/logprobs", "objective/ref_logprobs", "ppo/loss/policy",
            "ppo/loss/total", "ppo/policy/entropy", "ppo/policy/approxkl", "ppo/policy/policykl",
            "ppo/policy/clipfrac", "ppo/policy/advantages_mean", "ppo/mean_scores")  # fmt: skip
WRAPPER = {"deepspeed_zero2": "DeepSpeedEngine", "deepspeed_zero3": "DeepSpeedEngine", "multi_gpu": "DistributedDataParallel"}


def expected_saving(rows: dict, step: int) -> float:
    """The share of both processes' tokens of step ``step`` that shared prompts save: every pass holds the
    whole batch of its process, and a group of g rows runs its prompt once instead of g times."""
    saved = total = 0
    for per_step in rows.values():
        queries, responses = per_step[step]
        total += sum(len(q) + len(r) for q, r in zip(queries, responses))
        first = {}
        for q in queries:
            key = tuple(q.tolist())
            saved += len(q) if key in first else 0
            first[key] = True
    return saved / total


@pytest.fixture(scope="module")
def qwen2_model_dir(tmp_path_factory):
    """A tiny Qwen2 (rotary positions, 4 query heads sharing 2 key/value heads) saved for the launches."""
    path = tmp_path_factory.mktemp("base_qwen2")
    make_qwen2(seed=0, heads=4, kv_heads=2).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_shared_prompts_give_the_unshared_steps_on_two_processes(base_model_dir, qwen2_model_dir, tmp_path, arch):
    base_model_dir = base_model_dir if arch == "gpt2" else qwen2_model_dir
    # The three launches of one test run one after the other (one multi-process run at a time).
    for config in WRAPPER:
        out = tmp_path / config
        out.mkdir()
        launch(config, SCRIPTS / "prefix_sharing_step.py", "--base_model", str(base_model_dir), "--output_dir", str(out))
        report = torch.load(out / "result.pt", weights_only=False)
        assert report["world_size"] == 2
        shared, plain = report["results"][True], report["results"][False]
        assert shared["model_class"] == plain["model_class"] == WRAPPER[config]

        for run in (shared, plain):  # one group: both processes end with the same weights
            assert torch.equal(run["weights_per_rank"][0], run["weights_per_rank"][1]), config
        # Every pass ran each prompt once per process; the statistic counts both processes, the same on both.
        for step in range(2):
            want = expected_saving(report["rows"], step)
            assert want > 0.1
            assert shared["saved_per_rank"][0][step].item() == shared["saved_per_rank"][1][step].item()
            assert shared["saved_per_rank"][0][step].item() == pytest.approx(want, rel=1e-12), config
        assert plain["saved_per_rank"][0].abs().max().item() == 0.0

        for got, want in zip(shared["stats"], plain["stats"]):
            for key in COMPARED:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{config} {key}")
            np.testing.assert_allclose(got["objective/kl_dist"], want["objective/kl_dist"], rtol=1e-5, atol=1e-6)
            assert len(want["objective/kl_dist"]) == 16  # the rows of both processes
        base = AutoModelForCausalLM.from_pretrained(base_model_dir)
        initial = {f"pretrained_model.{k}": p.detach().to(torch.float64) for k, p in base.named_parameters()}
        # The policy's weights (the plain policy's internal value head does not train).
        assert len(initial) == len(plain["named_parameters"]) - 2
        moved = {k: plain["named_parameters"][k] - initial[k] for k in initial}
        largest = max(d.abs().max().item() for d in moved.values())
        assert largest > 1e-3, config
        for key, step in moved.items():
            # The updates agree to float32 rounding, relative to the largest step.
            torch.testing.assert_close(shared["named_parameters"][key] - initial[key], step, rtol=1e-5,
                                       atol=1e-5 * largest, msg=f"{config} {key}")  # fmt: skip
