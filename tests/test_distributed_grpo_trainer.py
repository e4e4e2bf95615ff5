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
from test_agents import successor_model  # noqa: E402
from test_grpo_trainer_tools import ADD_TURN, INCREMENT_TURN  # noqa: E402

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
    seen0, seen1 = ([prompt for prompt, _ in seen] for seen in report["seen"])
    # one whole group of 4 on each process, the two prompts of the 1-process order (seed 3)
    assert len(set(seen0)) == len(set(seen1)) == 1 and len(seen0) == len(seen1) == 4 and seen0[0] != seen1[0]
    order = grpo_trainer_run.build(str(base_model_dir), str(tmp_path / "one"), per_device_train_batch_size=8, trainer=trainer)
    assert order.ppo_config.advantage_estimator == trainer
    assert [row["prompt"] for row in order.prompts.next_rows()] == [seen0[0], seen1[0]]
    assert report["sampling_seeds"] == [order.args.seed, order.args.seed + 1]  # TRL's seed per process
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
    assert_same_update(order, w0, base_model_dir)
    assert os.path.isdir(tmp_path / "two")


def assert_same_update(order, weights, base_model_dir, update_tolerance: float | None = None) -> None:
    """The 1-process trainer ``order`` (after its step) holds ``weights`` to float tolerance, and they moved.
    ``update_tolerance``: compare the updates instead, each element to that share of the largest update (a large
    SGD step on small weights: float32 rounding of the update, not of the weights, is what the two runs differ by)."""
    replay = {name: value.detach().to(torch.float64) for name, value in order.model.named_parameters()}
    assert set(replay) == set(weights)
    initial = dict(grpo_trainer_run.AutoModelForCausalLM.from_pretrained(base_model_dir).named_parameters())
    initial = {name: value.detach().to(torch.float64) for name, value in initial.items()}
    largest = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    assert largest > 0
    for name, value in replay.items():
        if update_tolerance is None:
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)
        else:
            got, want = weights[name] - initial[name], value - initial[name]
            torch.testing.assert_close(got, want, rtol=0, atol=update_tolerance * largest, msg=name)


@pytest.mark.parametrize("config, agents", [("deepspeed_zero2", "tools"), ("deepspeed_zero3", "tools"),
                                            ("deepspeed_zero3", "environment")])  # fmt: skip
def test_tool_and_environment_episodes_on_two_processes_train_as_one_process(config, agents, tmp_path):
    """TRL's ``tools`` / ``environment_factory`` under DeepSpeed: each process plays one prompt's 4 episodes (under
    ZeRO-3 every generated token is a collective, and the processes' episodes differ in turns and length), the tool
    metrics and the environments' rewards are over both processes' episodes, and the update equals one process's
    step() on both processes' episodes together, tool tokens out of the loss."""
    # 384 wide: the embedding and head exceed ZeRO-3's persistence threshold, so they are partitioned; the head scaled
    # so that about half the turns follow the tool-calling map and the others wander (rewards differ within a group).
    model_dir = tmp_path / "model"
    successors = ADD_TURN if agents == "tools" else INCREMENT_TURN
    successor_model(successors, scale=0.017, seed=1, n_embd=384).save_pretrained(model_dir)
    launch(config, SCRIPTS / "grpo_trainer_run.py", "--base_model", str(model_dir), "--output",
           str(tmp_path / "two" / "out.pt"), "--agents", agents)  # fmt: skip
    report = torch.load(tmp_path / "two" / "out.pt")
    assert report["num_processes"] == 2 and report["model_class"] == "DeepSpeedEngine"
    assert (report["partitioned_parameters"] > 0) == (config == "deepspeed_zero3")
    (rollout0,), (rollout1,) = report["rollouts"]
    seen = report["seen"][0] + report["seen"][1]
    order = grpo_trainer_run.build(str(model_dir), str(tmp_path / "one"), per_device_train_batch_size=8, agents=agents)
    rows = order.prompts.next_rows()
    for process, row in enumerate(rows):  # one whole group of the 1-process order on each process
        assert all(row["prompt"][0]["content"] in prompt for prompt, _ in report["seen"][process])
    tool_messages = [count for _, count in seen]
    assert 0 < sum(tool_messages) < 8  # some episodes called the tool, some did not
    assert report["sampling_seeds"] == [order.args.seed, order.args.seed + 1]
    assert rollout0[1] != rollout1[1]  # each process sampled from a seed of its own (the trainer's, not the driver's)
    turns = [[sum(m[i] > m[i + 1] for i in range(len(m) - 1)) + 1 for m in r[3]] for r in (rollout0, rollout1)]
    assert sorted(turns[0]) != sorted(turns[1])  # the processes played different numbers of model turns
    logged = report["log_history"][0]
    assert logged["tools/call_frequency"] == pytest.approx(sum(tool_messages) / 8)
    if agents == "environment":  # Counter's reward: its start plus 2 per increment call, over both processes
        starts = [row["start"] for row in rows for _ in range(4)]
        counts = [start + 2 * calls for start, calls in zip(starts, tool_messages)]
        assert logged["rewards/Counter/mean"] == pytest.approx(sum(counts) / 8)
    masks = [torch.tensor(m) for m in rollout0[3] + rollout1[3]]
    assert any(bool((m == 0).any()) for m in masks)  # tool tokens, out of the loss
    assert rollout0[4] == rollout1[4] == [0] * 4
    queries, responses, scores = ([torch.tensor(x) for x in rollout0[i] + rollout1[i]] for i in range(3))
    order.ppo.step(queries, responses, scores, response_masks=masks, group_ids=[0] * 4 + [1] * 4)
    assert_same_update(order, report["weights"][0], model_dir, update_tolerance=1e-4)
    assert all(torch.equal(report["weights"][0][k], report["weights"][1][k]) for k in report["weights"][0])
