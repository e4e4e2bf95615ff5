"""A trainer built after the script's own accelerate state, as classic TRL's `examples/scripts/ppo.py` builds it.

Classic's script makes `PartialState()` (and, with `--use_peft`, an `Accelerator()`) before `PPOTrainer`. Without
CUDA accelerate then settles a single-process state; before the fix, DeepSpeed failed at construction and plain
data parallel ran each process alone on the whole dataset. `tests/distributed/state_first_loop.py` runs one
`step()` per dataloader batch on 2 processes (12 rows, 2 per process and step); the tests check that the run is
the one of a trainer built first: 3 steps per process on disjoint rows, the same weights on both processes and
the same weights as the trainer-first run. The in-process tests check the errors where the state cannot be
rebuilt (`build_accelerator`).
"""

import pytest
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState
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
