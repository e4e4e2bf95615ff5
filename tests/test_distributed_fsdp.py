"""FSDP2 under `accelerate_configs/fsdp2.yaml` on 2 CPU processes (gloo) against 1 process.

Without GPUs accelerate drops the FSDP plugin (it would run DDP); the trainer then applies FSDP2 itself
(`trl_lite/parallel/fsdp.py`). `tests/distributed/fsdp_step.py` runs all cases in one launch per process count
(GAE with a value head and a created reference, a rotary GQA Qwen2 with packing, gradient checkpointing, a token
budget, a chunked head and accumulation, GRPO with LoRA, a separate critic, checkpoint and resume); the tests here
read what the runs wrote. Each case's update (SGD, one step on the same 8 rows) must equal 1 process's to 1e-5
relative, every process must hold the same weights, and the policy's parameters must really be DTensor shards.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_classic_examples import CLASSIC, assets  # noqa: F401 (the fixture: local stand-ins for the hub assets)
from test_distributed import REPO, SCRIPTS, launch
from test_reliability import assert_equal
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


def test_a_weight_push_sends_the_full_tensors_gathered_from_the_shards(runs):
    """The push to a vLLM engine (its generation part's gathering around ``named_policy_weights``) on 2 processes: every
    tensor of the transformers model whole (the tied head under both names), equal to the saved full weights."""
    two = torch.load(runs["two"] / "gae.pt")
    pushed = two["pushed"]
    want = {k.removeprefix("pretrained_model."): v for k, v in two["after"].items() if k.startswith("pretrained_model.")}
    assert "lm_head.weight" in pushed and torch.equal(pushed["lm_head.weight"], pushed["transformer.wte.weight"])
    assert set(want) <= set(pushed)
    for name, tensor in want.items():
        assert torch.equal(pushed[name], tensor), name


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
    with pytest.raises(ValueError, match="sequence parallelism .*sp_size=2"):
        fsdp.cpu_sharding(SimpleNamespace(num_processes=2, parallelism_config=SimpleNamespace(sp_size=2)))
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="FSDP2 only"):
        fsdp.fsdp_settings()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    with pytest.raises(ValueError, match="SIZE_BASED_WRAP"):
        fsdp.fsdp_settings()


def _driver_launch(log: Path, *args) -> subprocess.Popen:
    """tests/resume_driver.py under accelerate_configs/fsdp2.yaml on 2 processes, in a session of its own; its output
    goes to the file ``log`` (a pipe nobody reads while the test waits could fill and stop the processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" /
               "fsdp2.yaml"), "--num_processes", "2", "--main_process_port", str(port), str(REPO / "tests" /
               "resume_driver.py"), *map(str, args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finished(process: subprocess.Popen, log: Path) -> None:
    process.wait(timeout=600)
    assert process.returncode == 0, log.read_text()[-4000:]


def test_an_fsdp2_run_killed_in_a_save_resumes_bit_identically(tmp_path):
    """The resume driver (dropout, AdamW, a scheduler, score scaling, adaptive KL, a shuffled dataset, sampled
    generation) on 2 processes: killed (SIGKILL to every process) inside the save after step 2, resumed from the
    checkpoint of step 1 in new processes, it ends where the straight run ends - on each process, shards and
    optimizer state bit for bit."""
    steps, checkpoint, marker = 3, tmp_path / "checkpoint", tmp_path / "hanging"
    logs = {name: tmp_path / f"{name}.log" for name in ("straight", "killed", "resumed")}
    _finished(_driver_launch(logs["straight"], "--steps", steps, "--out", tmp_path / "straight.pt"), logs["straight"])
    killed = _driver_launch(logs["killed"], "--steps", steps, "--out", tmp_path / "part.pt", "--checkpoint", checkpoint,
                            "--save-at", 1, 2, "--hang-at", 2, "--hang-mode", "write", "--marker", marker)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert killed.poll() is None, logs["killed"].read_text()[-4000:]
            assert time.monotonic() < deadline, "the run never reached its save"
            time.sleep(0.2)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    # Killed with the save of step 2 half written beside the whole checkpoint of step 1.
    assert (tmp_path / "checkpoint.tmp").is_dir() and (checkpoint / "fsdp2").is_dir()
    resumed = _driver_launch(logs["resumed"], "--steps", steps, "--resume", "--checkpoint", checkpoint,
                             "--out", tmp_path / "resumed.pt")  # fmt: skip
    _finished(resumed, logs["resumed"])
    for suffix in ("", ".rank1"):
        straight = torch.load(tmp_path / f"straight.pt{suffix}", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed.pt{suffix}", weights_only=False)
        at_save = torch.load(tmp_path / f"part.pt.step1{suffix}", weights_only=False)
        assert resumed["current_step"] == steps and at_save["current_step"] == 1
        assert any(not torch.equal(at_save["model"][k], resumed["model"][k]) for k in resumed["model"])  # trained on
        assert resumed["kl_coef"] != 0.1
        assert_equal(resumed, straight, f"process{suffix or '.rank0'}")


def test_classic_ppo_script_runs_under_fsdp2(assets, tmp_path):  # noqa: F811
    """Classic TRL's `ppo.py` as it is (`PartialState()` first, the policy loaded before the trainer, a classifier
    pipeline for rewards) under fsdp2.yaml as under ZeRO-3 (test_distributed_state_first.py): 16 reviews, 4 per
    process and step, so 2 steps on each of the 2 processes, with the policy sharded by FSDP2, and exit status 0."""
    args = ["--model_name", assets["policy"], "--query_dataset", assets["imdb"]]
    args += ["--reward_model", f"sentiment-analysis:{assets['sentiment']}", "--batch_size", "4", "--mini_batch_size", "2"]
    result = launch("fsdp2", CLASSIC / "ppo.py", *args)  # launched directly: any exit status but 0 fails
    assert result.stderr.count("2/2 [") >= 2, result.stderr[-3000:]
    assert "/4 [" not in result.stderr  # a process training alone would take 4 steps
    assert result.stderr.count("trl_lite applies FSDP2 itself") == 2
