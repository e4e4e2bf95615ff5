"""GRPOTrainer under `accelerate launch` on 2 processes (CPU) with the shipped DDP, DeepSpeed ZeRO-2 and ZeRO-3
configs: each process takes its share of the generation's prompts with their groups whole, the processes end with
the same weights, the logged metrics are over both processes' rows, and the update equals one process's step() on
both processes' rollouts together (within float tolerance); RLOOTrainer (beta 0.1: its KL in the reward) likewise
under the same three configs."""

import os
import sys

import pytest
import torch
from test_distributed import SCRIPTS, base_model_dir, launch  # noqa: F401

sys.path.insert(0, str(SCRIPTS))
import grpo_trainer_run  # noqa: E402

pytestmark = pytest.mark.xdist_group("distributed")


@pytest.mark.parametrize("config, trainer", [("multi_gpu", "grpo"), ("deepspeed_zero2", "grpo"),
                                             ("deepspeed_zero3", "grpo"), ("multi_gpu", "rloo"),
                                             ("deepspeed_zero2", "rloo"), ("deepspeed_zero3", "rloo")])  # fmt: skip
def test_two_processes_train_as_one_process_on_their_rollouts_together(config, trainer, base_model_dir, tmp_path):
    launch(config, SCRIPTS / "grpo_trainer_run.py", "--base_model", str(base_model_dir), "--output",
           str(tmp_path / "two" / "out.pt"), "--trainer", trainer)  # fmt: skip
    report = torch.load(tmp_path / "two" / "out.pt")
    assert report["num_processes"] == 2
    assert report["model_class"] == ("DistributedDataParallel" if config == "multi_gpu" else "DeepSpeedEngine")
    assert (report["partitioned_parameters"] > 0) == (config == "deepspeed_zero3")  # ZeRO-3 really shards
    (rollout0,), (rollout1,) = report["rollouts"]
    seen0, seen1 = report["seen"]
    # one whole group of 4 on each process, the two prompts of the 1-process order (seed 3)
    assert len(set(seen0)) == len(set(seen1)) == 1 and len(seen0) == len(seen1) == 4 and seen0[0] != seen1[0]
    order = grpo_trainer_run.build(str(base_model_dir), str(tmp_path / "one"), per_device_train_batch_size=8, trainer=trainer)
    assert order.ppo_config.advantage_estimator == trainer
    assert [row["prompt"] for row in order.prompts.next_rows()] == [seen0[0], seen1[0]]
    w0, w1 = report["weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)

    # the logged metrics are over both processes' rows
    scores = rollout0[2] + rollout1[2]
    logged = report["log_history"][0]
    assert logged["rewards/length_reward/mean"] == pytest.approx(sum(scores) / 8, rel=1e-6)
    lengths = [len(r) for r in rollout0[1] + rollout1[1]]
    assert logged["completions/mean_length"] == pytest.approx(sum(lengths) / 8)
    assert logged["num_tokens"] == sum(lengths) + sum(len(q) for q in rollout0[0] + rollout1[0])

    # one process, one step() on both rollouts: the same update
    queries, responses, scores = ([torch.tensor(x) for x in rollout0[i] + rollout1[i]] for i in range(3))
    order.ppo.step(queries, responses, scores)
    replay = dict(order.model.named_parameters())
    assert set(replay) == set(w0)
    for name, value in replay.items():
        torch.testing.assert_close(w0[name], value.detach().to(torch.float64), rtol=1e-5, atol=1e-7, msg=name)
    initial = dict(grpo_trainer_run.AutoModelForCausalLM.from_pretrained(base_model_dir).named_parameters())
    assert any(not torch.equal(initial[k].to(torch.float64), w0[k]) for k in w0)
    assert os.path.isdir(tmp_path / "two")
