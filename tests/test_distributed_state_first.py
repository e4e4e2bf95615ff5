"""A trainer built after the script's own accelerate state, as classic TRL's `examples/scripts/ppo.py` builds it.

Classic's script makes `PartialState()` (and, with `--use_peft`, an `Accelerator()`) before `PPOTrainer`. Without
CUDA accelerate then settles a single-process state; before the fix, DeepSpeed failed at construction and plain
data parallel ran each process alone on the whole dataset. `tests/distributed/state_first_loop.py` runs one
`step()` per dataloader batch on 2 processes (12 rows, 2 per process and step); the tests check that the run is
the one of a trainer built first: 3 steps per process on disjoint rows, the same weights on both processes and
the same weights as the trainer-first run. Classic's `ppo.py` and `ppo_multi_adapter.py` themselves
(`examples/classic/`) then run under classic's own ZeRO-1/2/3 and multi_gpu files
(written by `classic_config`) and must exit 0 without any exit wrapper, as must a ZeRO-3 run that ended
training, launched 4 times. The in-process tests check the errors where the state cannot be rebuilt
(`build_accelerator`) and the ZeRO-3 and exit fixes.
"""

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from accelerate.state import AcceleratorState, GradientState, PartialState
# assets: the fixture of local stand-ins for the hub assets
from test_classic_examples import CLASSIC, _jsonl, _review, assets  # noqa: F401
from test_distributed import SCRIPTS, _free_port, launch

from trl_lite import PPOConfig
from trl_lite.trainer.accelerate_setup import build_accelerator

pytestmark = pytest.mark.xdist_group("distributed")

RUNS = {  # case: (accelerate config, what the script makes first)
    "zero2-trainer": ("deepspeed_zero2", "trainer"),
    "zero2-partial_state": ("deepspeed_zero2", "partial_state"),
    "zero2-accelerator": ("deepspeed_zero2", "accelerator"),
    "ddp-trainer": ("multi_gpu", "trainer"),
    "ddp-partial_state": ("multi_gpu", "partial_state"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    out = {}
    for case, (config, first) in RUNS.items():
        path = tmp_path_factory.mktemp(case)
        launch(config, SCRIPTS / "state_first_loop.py", "--output_dir", str(path), "--first", first)
        out[case] = torch.load(path / "report.pt")
    return out


@pytest.mark.parametrize("case", [c for c in RUNS if not c.endswith("-trainer")])
def test_a_state_made_first_runs_as_the_trainer_made_first(case, reports):
    report, baseline = reports[case], reports[case.split("-")[0] + "-trainer"]
    wrapper = "DeepSpeedEngine" if case.startswith("zero2") else "DistributedDataParallel"
    assert report["model_class"] == baseline["model_class"] == wrapper
    # One group of 2, seen by the trainer and by the script's own state object.
    assert report["trainer_num_processes"] == report["user_num_processes"] == 2
    assert report["distributed_type"] == report["user_distributed_type"] == baseline["distributed_type"]
    # The dataloader is sharded: 12 rows / (2 per step x 2 processes) = 3 steps each, on disjoint rows.
    assert report["steps_per_rank"] == [3, 3]
    rows = report["rows_per_rank"]
    assert sorted(rows[0] + rows[1]) == list(range(12))
    assert rows == baseline["rows_per_rank"]
    # The same update on both processes, and the one of the trainer-first run.
    weights = report["weights_per_rank"]
    assert (weights[0] - weights[1]).abs().max().item() == 0.0
    assert (weights[0] - report["start"]).abs().max().item() > 1e-3
    assert (weights[0] - baseline["weights_per_rank"][0]).abs().max().item() == 0.0


@pytest.fixture
def launched_two(monkeypatch):
    """A process that the environment says is one of 2 (WORLD_SIZE=2, no LOCAL_RANK), with fresh accelerate state."""
    for name in ("LOCAL_RANK", "RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_state_that_cannot_join_the_launch_is_an_error(launched_two):
    """A process group of 1 made before the trainer: no rebuild can give 2 processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        PartialState()
        with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*Build the trainer before any PartialState\(\)"):
            build_accelerator(PPOConfig())
    finally:
        dist.destroy_process_group()


def test_an_accelerator_with_fewer_processes_than_launched_is_an_error(launched_two):
    """cpu=False without CUDA (or any set-up accelerate makes single-process) under a launch of 2 raises at once."""
    with pytest.raises(RuntimeError, match=r"accelerate set up 1 process\(es\).*WORLD_SIZE=2: every process would"):
        build_accelerator(PPOConfig(accelerator_kwargs={"cpu": False}))


# The settings of classic TRL 0.11.4's examples/accelerate_configs/ files, field by field (their launcher defaults:
# bf16, 8 processes; 2 are launched here). Classic's ZeRO-3 file sets zero3_init_flag: models built under the launch
# are partitioned as they load. Written out per test rather than kept as copies of classic's files.
_CLASSIC_COMMON = {
    "compute_environment": "LOCAL_MACHINE", "debug": False, "downcast_bf16": "no", "machine_rank": 0,
    "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1, "num_processes": 8,
    "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    "use_cpu": False,
}  # fmt: skip
_CLASSIC_ZERO = {"deepspeed_multinode_launcher": "standard", "zero3_init_flag": False}
_CLASSIC_NO_OFFLOAD = {"offload_optimizer_device": "none", "offload_param_device": "none"}
CLASSIC_SETTINGS = {
    "deepspeed_zero1": {"distributed_type": "DEEPSPEED",
                        "deepspeed_config": {**_CLASSIC_ZERO, "gradient_accumulation_steps": 1, "zero_stage": 1}},
    "deepspeed_zero2": {"distributed_type": "DEEPSPEED",
                        "deepspeed_config": {**_CLASSIC_ZERO, **_CLASSIC_NO_OFFLOAD, "zero_stage": 2}},
    "deepspeed_zero3": {"distributed_type": "DEEPSPEED",
                        "deepspeed_config": {**_CLASSIC_ZERO, **_CLASSIC_NO_OFFLOAD, "zero3_init_flag": True,
                                             "zero3_save_16bit_model": True, "zero_stage": 3}},
    "multi_gpu": {"distributed_type": "MULTI_GPU", "gpu_ids": "all"},
}  # fmt: skip
CONFIGS = list(CLASSIC_SETTINGS)


def classic_config(name: str, directory) -> Path:
    """Classic's `name`.yaml, written into `directory`."""
    path = Path(directory) / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**_CLASSIC_COMMON, **CLASSIC_SETTINGS[name]}))
    return path


@pytest.mark.parametrize("config", CONFIGS)
def test_classic_ppo_script_runs_and_exits_0(config, assets, tmp_path):  # noqa: F811
    """Classic `ppo.py` as it is (imports changed), launched directly under classic's own config: it ends after its
    last step without `end_training`, so the interpreter exits with the process group alive unless the trainer
    destroys it. `PartialState()` first, the policy loaded before the trainer, the classifier pipeline after it (kept
    whole under classic ZeRO-3's zero3_init_flag): 16 reviews, 4 per process and step, so 2 steps on each of the
    2 processes; `launch` fails on any exit status but 0 (an abort at exit is -6)."""
    args = ["--model_name", assets["policy"], "--query_dataset", assets["imdb"]]
    args += ["--reward_model", f"sentiment-analysis:{assets['sentiment']}", "--batch_size", "4", "--mini_batch_size", "2"]
    result = launch(classic_config(config, tmp_path), CLASSIC / "ppo.py", *args)
    assert result.stderr.count("2/2 [") >= 2, result.stderr[-3000:]
    assert "/4 [" not in result.stderr  # a process training alone would take 4 steps


@pytest.mark.parametrize("config", CONFIGS)
def test_classic_multi_adapter_script_runs_and_exits_0(config, assets, tmp_path):  # noqa: F811
    """Classic `ppo_multi_adapter.py` (imports changed) launched directly on 2 processes under classic's own config:
    1,600 rows, train[:1%] = 16, batches of 8 on each of the 2 processes: one step each, and exit status 0."""
    rng = random.Random(1)
    rows = [{"chosen": _review(rng, 16), "rejected": _review(rng, 16)} for _ in range(1600)]
    _jsonl(tmp_path / "hh" / "train.jsonl", rows)
    args = ["--model_name", assets["multi_base"], "--dataset_name", str(tmp_path / "hh")]
    args += ["--rm_adapter", assets["rm_adapter"]]
    args += ["--use_safetensors", "True", "--load_in_4bit", "False"]
    result = launch(classic_config(config, tmp_path), CLASSIC / "ppo_multi_adapter.py", *args)
    assert result.stderr.count("1it [") >= 2 and "2it [" not in result.stderr, result.stderr[-3000:]


EXIT_PROBE = """
import _thread, atexit, sys, time
import torch.distributed as dist
import yaml
atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))  # first registered: runs last
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from trl_lite import PPOConfig
from trl_lite.trainer.accelerate_setup import build_accelerator
build_accelerator(PPOConfig())
build_accelerator(PPOConfig())  # a second trainer registers nothing more
def native():  # a thread outside `threading`, as a C++ thread that asks for the GIL is
    time.sleep(0.3)
    print("native thread finished", flush=True)
_thread.start_new_thread(native, ())
"""


def test_the_process_group_is_destroyed_and_native_threads_finish_before_interpreter_shutdown():
    """gloo's worker threads free finished collectives' tensors after the process has moved on, and a tensor
    that Python has let go needs the GIL to be freed: a worker that asks for it once the interpreter is finalizing
    is unwound and the process aborts (exit -6; 2 of 40 2-process ZeRO-3 runs of `equivalence_step.py`, both in
    gloo's `runLoop` freeing an all-gather held by a barrier). This checks the exit handler's two parts: once a
    trainer's accelerator is built, the group is gone by the time the script's own exit handlers (registered
    before the trainer) run, and a thread that holds a thread state outside `threading` (what such a worker has
    while it waits for the GIL) runs to its end instead of being cut off by finalization."""
    import os
    import subprocess
    import sys

    from test_classic_examples import ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE, str(_free_port())], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "group alive at exit: False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "native thread finished" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_zero3_run_that_ended_training_exits_0_every_time(tmp_path):
    """`tests/distributed/equivalence_step.py` (one step, full weights gathered, `end_training`, then a normal
    exit) under ZeRO-3 on 2 processes, 4 times: `launch` fails on any exit status but 0."""
    for run in range(4):
        out = tmp_path / str(run)
        out.mkdir()
        launch("deepspeed_zero3", SCRIPTS / "equivalence_step.py", "--output_dir", str(out))
        assert (out / "result.pt").exists()


def test_zero3_init_off_context_loads_models_whole():
    """accelerate 1.x's `zero3_init_context_manager(enable=False)` registers transformers' ZeRO-3 config again,
    so `from_pretrained` inside it still partitions (classic `ppo.py`'s reward classifier). The trainer's
    accelerator wraps the plugin's context: inside it transformers sees no ZeRO-3 config; after it, it does."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from trl_lite.trainer.accelerate_setup import unregister_zero3_config_when_init_off

    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    try:
        plugin.set_deepspeed_weakref()  # what accelerate does when the plugin is selected
        with plugin.zero3_init_context_manager(enable=False):
            assert is_deepspeed_zero3_enabled()  # accelerate alone: still registered, models load partitioned
        unregister_zero3_config_when_init_off(plugin)
        unregister_zero3_config_when_init_off(plugin)  # a second call wraps nothing more
        with plugin.zero3_init_context_manager(enable=False):
            assert not plugin.zero3_init_flag and not is_deepspeed_zero3_enabled()
        assert plugin.zero3_init_flag and is_deepspeed_zero3_enabled()
        with plugin.zero3_init_context_manager(enable=True):  # already on: nothing changes
            assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
