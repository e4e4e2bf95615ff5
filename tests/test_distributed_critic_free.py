"""Critic-free PPO (GRPO on a plain causal LM) on 2 processes under DeepSpeed ZeRO-2, ZeRO-3 and DDP (CPU, gloo).

Launches ``tests/distributed/grpo_rollout_loop.py`` and checks that the processes formed one group,
ended with identical weights and KL coefficient, trained the policy but not the internal value head,
resumed bit-identically from a checkpoint, and saved a plain transformers model.
"""

import pytest
import torch
from test_distributed import SCRIPTS, _named_parameters, base_model_dir, deepspeed_cpu_collectives, launch  # noqa: F401
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.xdist_group("distributed")


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3", "multi_gpu"])
def test_grpo_rollout_loop_agrees_across_ranks_and_resumes_exactly(config, base_model_dir, tmp_path):
    launch(config, SCRIPTS / "grpo_rollout_loop.py", "--base_model", str(base_model_dir), "--output_dir", str(tmp_path))
    report = torch.load(tmp_path / "report.pt")

    expected_wrapper = "DistributedDataParallel" if config == "multi_gpu" else "DeepSpeedEngine"
    assert report["world_size"] == 2 and report["model_class"] == expected_wrapper
    weights = report["weights_per_rank"]
    assert (weights[0] - weights[1]).abs().max().item() == 0.0
    assert torch.equal(report["kl_coef_per_rank"][0], report["kl_coef_per_rank"][1])
    history = report["history"]
    assert abs(history[0]["objective/kl"]) < 1e-5  # the reference is the untrained policy
    assert all("ppo/policy/kl_loss" in stats and not any(k.startswith("ppo/val/") for k in stats) for stats in history)
    assert not report["head_trained"]

    # The resumed trainer took step 3 exactly as the straight run did.
    straight, resumed = report["straight"], report["resumed"]
    assert report["resumed_step"] == 3 and sorted(straight) == sorted(resumed)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert report["resumed_stats"] == history[2]

    # save_pretrained wrote the plain model, with the trained weights, loadable on one process.
    loaded = _named_parameters(AutoModelForCausalLM.from_pretrained(tmp_path / "model"))
    policy = {k[len("pretrained_model."):]: v for k, v in straight.items() if k.startswith("pretrained_model.")}
    assert sorted(loaded) == sorted(policy)
    assert all(torch.equal(loaded[k], policy[k]) for k in policy)
    base = _named_parameters(AutoModelForCausalLM.from_pretrained(base_model_dir))
    assert any(not torch.equal(base[k], policy[k]) for k in policy)
