"""A separate critic with PTX and a policy EMA on 2 processes (CPU, gloo) under DeepSpeed ZeRO-2/3.

`tests/distributed/critic_loop.py` runs generate -> score -> step with PTX rows on each process;
the test checks that the critic was prepared as a DeepSpeed engine of its own (partitioned under
ZeRO-3), that every process ends with the same policy, critic and EMA weights (gathered with
`torch.distributed`), that the critic and the EMA moved, and that the saved critic and EMA load in
a plain process with the weights the processes held.
"""

from pathlib import Path

import pytest
import torch
from test_distributed import BASE_MODEL, SCRIPTS, launch
from tiny_models import make_gpt2, make_gpt2_critic
from transformers import GPT2ForSequenceClassification

from trl_lite import AutoModelForCausalLMWithValueHead

pytestmark = pytest.mark.xdist_group("distributed")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("critic_models")
    make_gpt2(**BASE_MODEL).save_pretrained(path / "policy")
    # 256 wide, as the policy: ZeRO-3 partitions its largest matrices.
    make_gpt2_critic(seed=1, n_embd=256).save_pretrained(path / "critic")
    return path


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3"])
def test_critic_rollout_loop_ranks_agree(config, models_dir, tmp_path):
    launch(
        config, SCRIPTS / "critic_loop.py", "--base_model", str(models_dir / "policy"),
        "--critic_model", str(models_dir / "critic"), "--output_dir", str(tmp_path),
    )  # fmt: skip
    report = torch.load(tmp_path / "report.pt", weights_only=False)
    assert report["world_size"] == 2
    assert report["critic_class"] == "DeepSpeedEngine"
    assert (report["critic_partitioned_parameters"] > 0) == (config == "deepspeed_zero3")
    for key, (rank0, rank1) in report["per_rank"].items():
        assert torch.equal(rank0, rank1), f"{key} weights differ between ranks"

    initial_critic = GPT2ForSequenceClassification.from_pretrained(models_dir / "critic").state_dict()
    saved_critic = GPT2ForSequenceClassification.from_pretrained(tmp_path / "model" / "value_model").state_dict()
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.allclose(report["critic"][name], initial_critic[name].double())
    for key, value in report["critic"].items():
        torch.testing.assert_close(saved_critic[key].double(), value, rtol=0, atol=0, msg=key)

    saved_ema = dict(AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "ema").named_parameters())
    saved_policy = dict(AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "model").named_parameters())
    name = "pretrained_model.transformer.h.1.attn.c_attn.weight"
    torch.testing.assert_close(saved_ema[name].detach().double(), report["ema"][name], rtol=0, atol=0)
    torch.testing.assert_close(saved_policy[name].detach().double(), report["policy"][name], rtol=0, atol=0)
    assert not torch.allclose(report["ema"][name], report["policy"][name])
    # The policy's value head is frozen when a critic gives the values: the EMA does not track it.
    assert not any(k.startswith("v_head") for k in report["ema"])
