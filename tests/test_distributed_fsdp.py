"""FSDP2 under `accelerate_configs/fsdp2.yaml` on 2 CPU processes (gloo) against 1 process.

Without GPUs accelerate drops the FSDP plugin (it would run DDP); the trainer then applies FSDP2 itself
(`trl_lite/parallel/fsdp.py`). `tests/distributed/fsdp_step.py` runs all cases in one launch per process count
(GAE with a value head and a created reference, a rotary GQA Qwen2 with packing, gradient checkpointing, a token
budget, a chunked head and accumulation, GRPO with LoRA, a separate critic, checkpoint and resume); the tests here
read what the runs wrote. Each case's update (SGD, one step on the same 8 rows) must equal 1 process's to 1e-5
relative, every process must hold the same weights, and the policy's parameters must really be DTensor shards.
"""

from types import SimpleNamespace

import pytest
import torch

from test_distributed import SCRIPTS, launch
from trl_lite import AutoModelForCausalLMWithValueHead
from trl_lite.parallel import fsdp

pytestmark = pytest.mark.xdist_group("distributed")

CASES = ("gae", "qwen", "grpo_lora", "critic", "resume")
# Statistics of each process's own rows (spreads, counts per pass): they differ between 2 x 4 and 1 x 8 rows by design.
PER_PROCESS = ("std", "var", "tokens_per_minibatch", "minibatches", "tokens_saved_fraction")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    two, one = tmp_path_factory.mktemp("fsdp_two"), tmp_path_factory.mktemp("fsdp_one")
    result = launch("fsdp2", SCRIPTS / "fsdp_step.py", "--output_dir", str(two))
    launch("single_gpu", SCRIPTS / "fsdp_step.py", "--output_dir", str(one), "--cases", "gae,qwen,grpo_lora,critic",
           num_processes=1)  # fmt: skip
    output = result.stdout + result.stderr
    return {"two": two, "one": one, "output": output}


def _update(result: dict) -> torch.Tensor:
    return torch.cat([(result["after"][k] - result["before"][k]).flatten() for k in sorted(result["after"])])


@pytest.mark.parametrize("case", ["gae", "qwen", "grpo_lora", "critic"])
def test_an_fsdp2_step_on_two_processes_equals_one_process(runs, case):
    two, one = torch.load(runs["two"] / f"{case}.pt"), torch.load(runs["one"] / f"{case}.pt")
    assert two["world_size"] == 2 and two["sharded"] and not one["sharded"]
    assert sorted(two["after"]) == sorted(one["after"])
    got, want = _update(two), _update(one)
    assert want.norm() > 1e-3  # the step moved the weights
    assert (got - want).norm() <= 1e-5 * want.norm()
    assert two["spread"] == 0.0  # every process holds the same weights
    assert two["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-6)
    compared = [k for k in one["stats"] if not any(part in k for part in PER_PROCESS)]
    assert "ppo/loss/policy" in compared and "objective/kl" in compared
    for key in compared:
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key


def test_without_gpus_the_fsdp_config_warns_once_per_process_and_never_runs_ddp(runs):
    assert runs["output"].count("trl_lite applies FSDP2 itself") == 2  # 6 trainers per process, one warning each
    assert "DistributedDataParallel" not in runs["output"]


def test_the_transformers_engine_generates_from_the_sharded_policy(runs):
    """Greedy responses before any forward (the first call) and after the step equal those of 1 process."""
    two, one = torch.load(runs["two"] / "gae.pt"), torch.load(runs["one"] / "gae.pt")
    assert two["generated_before"] == one["generated_before"]
    assert two["generated_after"] == one["generated_after"]


def test_save_pretrained_writes_one_full_checkpoint_that_loads_without_fsdp(runs):
    two = torch.load(runs["two"] / "gae.pt")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(runs["two"] / "gae_saved"))
    named = {k: p.detach().to(torch.float64) for k, p in model.named_parameters()}
    assert sorted(named) == sorted(two["after"])
    assert max((named[k] - two["after"][k]).abs().max().item() for k in named) == 0.0


def test_a_resumed_fsdp2_run_is_bit_identical(runs):
    """Adam and a StepLR scheduler: a step, a sharded checkpoint (torch.distributed.checkpoint), a second step;
    against a new trainer that loads the checkpoint and takes the second step."""
    two = torch.load(runs["two"] / "resume.pt")
    assert two["sharded"] and two["spread"] == 0.0
    assert sorted(two["straight"]) == sorted(two["after"])
    assert all(torch.equal(two["straight"][k], two["after"][k]) for k in two["after"])
    assert max((two["after"][k] - two["before"][k]).abs().max().item() for k in two["after"]) > 1e-3
    assert any((runs["two"] / "resume_checkpoint" / "fsdp2").glob("*.distcp"))


def test_the_fsdp_settings_come_from_the_launch_environment(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp.fsdp_settings() is None and fsdp.cpu_sharding(SimpleNamespace(num_processes=2)) is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "GPT2Block, Qwen2DecoderLayer")
    settings = fsdp.fsdp_settings()
    assert settings == fsdp.FSDP2Settings(False, "TRANSFORMER_BASED_WRAP", ("GPT2Block", "Qwen2DecoderLayer"))
    assert fsdp.cpu_sharding(SimpleNamespace(num_processes=1)) is None  # one process: nothing to shard over
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="FSDP2 only"):
        fsdp.fsdp_settings()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    with pytest.raises(ValueError, match="SIZE_BASED_WRAP"):
        fsdp.fsdp_settings()
