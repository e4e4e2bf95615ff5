"""A trainer built after the script's own accelerate state, as classic TRL's `examples/scripts/ppo.py` builds it.

Classic's script makes `PartialState()` (and, with `--use_peft`, an `Accelerator()`) before `PPOTrainer`. Without
CUDA accelerate then settles a single-process state; before the fix, DeepSpeed failed at construction and plain
data parallel ran each process alone on the whole dataset. `tests/distributed/state_first_loop.py` runs one
`step()` per dataloader batch on 2 processes (12 rows, 2 per process and step); the tests check that the run is
the one of a trainer built first: 3 steps per process on disjoint rows, the same weights on both processes and
the same weights as the trainer-first run. Classic's `ppo.py` itself (`examples/classic/ppo.py`) then runs under
classic's own ZeRO-3 config. The in-process tests check the errors where the state cannot be rebuilt
(`build_accelerator`).
"""

import pytest
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState
from test_classic_examples import CLASSIC, assets  # noqa: F401 (the fixture: local stand-ins for the hub assets)
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


# Classic TRL 0.11.4's examples/accelerate_configs/deepspeed_zero3.yaml: bf16, zero3_init_flag true (models built
# under the launch are partitioned as they load), 8 processes (2 below).
CLASSIC_ZERO3 = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_classic_ppo_script_runs_under_classics_zero3_config(assets, tmp_path):  # noqa: F811
    """`PartialState()` first, the policy loaded before the trainer, the classifier pipeline after it (kept whole
    under zero3_init_flag): 16 reviews, 4 per process and step, so 2 steps on each of the 2 processes."""
    config = tmp_path / "deepspeed_zero3.yaml"
    config.write_text(CLASSIC_ZERO3)
    args = ["--model_name", assets["policy"], "--query_dataset", assets["imdb"]]
    args += ["--reward_model", f"sentiment-analysis:{assets['sentiment']}", "--batch_size", "4", "--mini_batch_size", "2"]
    result = launch(config, SCRIPTS / "run_script_then_exit.py", str(CLASSIC / "ppo.py"), *args)
    assert result.stderr.count("2/2 [") >= 2, result.stderr[-3000:]
    assert "/4 [" not in result.stderr  # a process training alone would take 4 steps
