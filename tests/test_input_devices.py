"""Every public entry point takes tensors on the CPU (what a tokenizer returns) and moves them, once, to
the device it computes on.

A GPU is not needed to see the contract broken: the device the inputs must reach is faked as ``meta``
(``devices.accelerator_device``, or a model whose parameters sit on ``meta``), and the call is stopped
where the inputs reach the model (``devices.inputs_reaching``). An entry point that forgot the move
hands the model CPU tensors - what raises "Expected all tensors to be on the same device" on a GPU.
"""

import pytest
import torch
from devices import FAKE_DEVICE, ReachedTheModel, accelerator_device, inputs_reaching
from peft import LoraConfig, get_peft_model
from preference_pairs import make_reward_model, planted_pairs
from test_multi_adapter import dirs, make_policy  # noqa: F401 (dirs is a fixture)
from tiny_models import make_gpt2, make_tokenizer

from trl_lite import (
    AutoModelForCausalLMWithValueHead,
    BestOfNSampler,
    PPOConfig,
    PPOTrainer,
    RewardConfig,
    RewardTrainer,
    TextEnvironment,
)
from trl_lite.trainer import RewardDataCollatorWithPadding

QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15])]


def make_trainer(model=None, **config):
    model = model if model is not None else AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, tokenizer=make_tokenizer())


def assert_all_on(seen: dict, names, device=FAKE_DEVICE):
    for name in names:
        assert seen.get(name), f"{name} did not reach the model (seen: {seen})"
        assert set(seen[name]) == {device}, f"{name} reached the model on {seen[name]}, not on {device}"


def test_compute_reward_score_moves_cpu_inputs_to_the_models_device(dirs):  # noqa: F811
    model = make_policy(*dirs).to(FAKE_DEVICE)  # parameters without storage on a device other than the CPU
    lm = model.transformers_model
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    with inputs_reaching(getattr(lm, lm.base_model_prefix)) as seen, pytest.raises(ReachedTheModel):
        model.compute_reward_score(input_ids, attention_mask=(input_ids != 0).long())
    assert_all_on(seen, ["input_ids", "attention_mask"])


def test_reward_trainers_compute_rewards_moves_a_cpu_batch_to_the_accelerators_device(tmp_path, monkeypatch):
    tokenizer = make_tokenizer()
    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=32, disable_tqdm=True)
    trainer = RewardTrainer(make_reward_model(), args, train_dataset=planted_pairs(4, seed=1), tokenizer=tokenizer)
    batch = RewardDataCollatorWithPadding(tokenizer)([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids_chosen"].device.type == "cpu"
    with accelerator_device(monkeypatch), inputs_reaching(trainer.model) as seen, pytest.raises(ReachedTheModel):
        trainer.compute_rewards(trainer.model, batch)
    assert_all_on(seen, ["input_ids", "attention_mask"])


@pytest.mark.parametrize("peft", [False, True], ids=["plain", "peft_reference"])
def test_generate_moves_cpu_queries_to_the_accelerators_device(monkeypatch, peft):
    if peft:  # the reference is the policy with its adapter disabled: generate_ref_response runs on it
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
        model = AutoModelForCausalLMWithValueHead.from_pretrained(get_peft_model(make_gpt2(), lora))
    else:
        model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    trainer = make_trainer(model)
    kwargs = {"generate_ref_response": True} if peft else {}
    with accelerator_device(monkeypatch):
        with inputs_reaching(trainer.model, "generate") as seen, pytest.raises(ReachedTheModel):
            trainer.generate(QUERIES, batch_size=2, return_prompt=False, max_new_tokens=3, **kwargs)
        assert_all_on(seen, ["input_ids", "attention_mask"])
        with inputs_reaching(trainer.model, "generate") as seen, pytest.raises(ReachedTheModel):
            trainer.generate(QUERIES[0], max_new_tokens=3)  # one query
        assert_all_on(seen, ["input_ids"])


def test_generate_moves_each_chunk_in_one_copy_not_one_copy_per_query(monkeypatch):
    """The queries of a chunk are padded on the CPU and moved together: no query is moved alone."""
    trainer = make_trainer()
    moved = []
    original = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        moved.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    with inputs_reaching(trainer.model, "generate"), pytest.raises(ReachedTheModel):
        trainer.generate(QUERIES, batch_size=4, return_prompt=False, max_new_tokens=3)
    assert not any(len(shape) == 1 and shape[0] in {len(q) for q in QUERIES} for shape in moved), moved


def test_best_of_n_moves_cpu_queries_to_the_requested_device():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    sampler = BestOfNSampler(model, make_tokenizer(), lambda texts: [0.0] * len(texts), length_sampler=lambda: 3,
                             sample_size=2)  # fmt: skip
    with inputs_reaching(model, "generate") as seen, pytest.raises(ReachedTheModel):
        sampler.generate([q.tolist() for q in QUERIES], device=FAKE_DEVICE)
    assert_all_on(seen, ["input_ids", "attention_mask"])


def test_text_environment_on_a_trainer_generates_on_the_accelerators_device(monkeypatch):
    trainer = make_trainer()
    env = TextEnvironment(trainer, make_tokenizer(), {}, lambda texts: [0.0] * len(texts), "the ",
                          generation_kwargs={"max_new_tokens": 3})  # fmt: skip
    with accelerator_device(monkeypatch):
        env.current_device = trainer.accelerator.device
        with inputs_reaching(trainer.model, "generate") as seen, pytest.raises(ReachedTheModel):
            env.run(["movie", "plot"])
    assert_all_on(seen, ["input_ids", "attention_mask"])


def test_async_rollouts_generate_on_the_policy_copy_on_the_accelerators_device(monkeypatch):
    """AsyncRollouts with max_staleness > 0 generates on a copy of the policy (SnapshotGeneration's
    PolicyCopyEngine): CPU queries reach the copy on the accelerator's device too."""
    from trl_lite.rollouts.producer_generation import SnapshotGeneration

    trainer = make_trainer()
    generation = SnapshotGeneration(trainer)
    copy = generation.rollout_generation.engine.model
    assert copy is not trainer.model.pretrained_model
    with accelerator_device(monkeypatch), inputs_reaching(copy, "generate") as seen, pytest.raises(ReachedTheModel):
        generation.generate(QUERIES, batch_size=2, return_prompt=False, max_new_tokens=3)
    assert_all_on(seen, ["input_ids", "attention_mask"])


def test_run_episodes_generates_on_the_accelerators_device(monkeypatch):
    """run_episodes builds each turn's queries on the CPU; the engine moves each chunk to the device."""
    from test_agents import CALLS, USER, add, successor_model, turn
    from test_agents import make_trainer as make_agent_trainer

    from trl_lite.agents import run_episodes

    trainer = make_agent_trainer(successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>")))
    with accelerator_device(monkeypatch):
        with inputs_reaching(trainer.model, "generate") as seen, pytest.raises(ReachedTheModel):
            run_episodes(trainer, [USER], tools=[add], max_turns=1, max_new_tokens=4)
    assert_all_on(seen, ["input_ids", "attention_mask"])
