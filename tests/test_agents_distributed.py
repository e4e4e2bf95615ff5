"""run_episodes under `accelerate launch` with two processes (ZeRO-2, and ZeRO-3 whose transformers-engine
generate is a collective): the processes play episodes of different lengths - one won in a turn, one
still going after three - and train on them in step; the statistics cover both processes' episodes and
the processes end with equal weights. The script is tests/distributed/agent_loop.py."""

import pytest
import torch
from test_agents import GUESS_MODEL_TURN, successor_model
from test_distributed import REPO, deepspeed_cpu_collectives, launch  # noqa: F401  (fixture)

pytestmark = pytest.mark.xdist_group("distributed")

SCRIPT = REPO / "tests" / "distributed" / "agent_loop.py"


@pytest.fixture(scope="module")
def guessing_model_dir(tmp_path_factory):
    # 384 wide: its embedding and head exceed ZeRO-3's persistence threshold (1e5 elements), so they are
    # partitioned and every forward pass - every generated token - is a collective.
    path = tmp_path_factory.mktemp("guessing_model")
    successor_model(GUESS_MODEL_TURN, n_embd=384, n_positions=128).save_pretrained(path)
    return path


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3"])
def test_two_processes_play_episodes_of_different_lengths_and_train(config, guessing_model_dir, tmp_path):
    launch(config, SCRIPT, "--base_model", str(guessing_model_dir), "--output_dir", str(tmp_path))
    report = torch.load(tmp_path / "report.pt")
    assert report["num_processes"] == 2
    won, lost = report["episodes"]  # per process: per step, per episode (turns, length, model tokens, reward, truncated)
    for step in won:
        assert step == [(1, 2, 2, 1.0, False)] * 2  # "GUESS_FIVE<|im_end|>", right at once
    for step in lost:
        for turns, length, actions, reward, truncated in step:
            assert (turns, length, actions, reward, truncated) == (3, 50, 6, 0.0, True)
    for stats in report["stats"]:  # over both processes' four episodes
        assert stats["env/turns/mean"] == 2.0 and stats["env/turns/max"] == 3.0
        assert stats["env/truncated_fraction"] == 0.5
    assert torch.equal(report["weights"][0], report["weights"][1])
