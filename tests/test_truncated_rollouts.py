"""Truncated sampling through the paths that own their rollouts (PPO_SPEC section 23): ``AsyncRollouts`` (stale
batches sampled by an older policy) and ``run_episodes`` (multi-turn, tool tokens between the model's turns) carry
the sampler's kept sets to ``step()``, whose lp_old is the rollout policy's ``pi_T`` renormalised over those sets -
checked against a float64 brute force - and whose first pass's ratio is 1 on fresh batches."""

import copy
import math
import warnings

import torch
from test_agents import CALLS, USER, add, successor_model, turn
from test_agents import make_trainer as agents_trainer
from test_truncated_head import brute_kept
from test_truncated_step import QUERIES, T, make_lm, make_trainer

from trl_lite.agents import run_episodes, step_inputs
from trl_lite.core.kept_sets import Truncation
from trl_lite.rollouts import AsyncRollouts


def sets_then_scored_now(then, now, query, response, cut, temperature):
    """float64 ``log pi_T^K``: ``now``'s logits over the sets the rule keeps from ``then``'s (the label added)."""
    out = []
    for model in (then, now):
        lm64 = copy.deepcopy(model).double().eval()
        with torch.no_grad():
            out.append(lm64(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1] / temperature)
    keep = brute_kept(out[0], cut)
    keep[torch.arange(len(response)), response] = True
    return torch.log_softmax(out[1].masked_fill(~keep, -math.inf), -1)[torch.arange(len(response)), response]


def capture(trainer):
    """The experiences step() makes, in order."""
    seen, make = [], trainer.experience_maker.make
    trainer.experience_maker.make = lambda batch: seen.append(make(batch)) or seen[-1]
    return seen


def test_async_rollouts_replay_each_batchs_sampler_sets_under_the_policy_that_trains_on_it():
    cut = dict(top_k=6)
    trainer = make_trainer(make_lm("qwen2"), cut, ppo_epochs=1, learning_rate=3e-2)
    policy = lambda: copy.deepcopy(trainer.model.pretrained_model)  # noqa: E731
    versions, sampled = {0: policy()}, []

    def rollout_fn(data, generate):
        responses, logprobs = generate(data, return_prompt=False, max_new_tokens=6, do_sample=True,
                                       return_logprobs=True)  # fmt: skip
        sampled.append(generate.policy_version)
        return {"queries": data, "responses": responses, "generation_logprobs": logprobs,
                "scores": [torch.tensor(float(i)) for i in range(len(data))]}  # fmt: skip

    seen = capture(trainer)
    steps = []
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, AsyncRollouts(trainer, [QUERIES] * 3, rollout_fn,
                                                                        max_staleness=1) as rollouts:  # fmt: skip
        warnings.simplefilter("always")
        for batch in rollouts:
            assert batch["kept_sets"] is not None and all(k is not None for k in batch["kept_sets"])
            steps.append((batch, batch["policy_version"], policy()))
            stats = trainer.step(**batch)
            if not steps[1:]:  # the first batch: sampled by the policy that scores it
                assert float(torch.as_tensor(stats["ppo/policy/ratio"]).sub(1).abs().max()) < 1e-5
            versions[trainer.current_step] = policy()
    assert not [w for w in caught if "re-derived" in str(w.message)]
    assert [version for _, version, _ in steps] == [0, 0, 1]  # the later batches were sampled a version back
    for (batch, version, now), experience in zip(steps, seen):
        for i, (query, response) in enumerate(zip(batch["queries"], batch["responses"])):
            expected = sets_then_scored_now(versions[version], now, query, response, Truncation(**cut), T)
            assert torch.allclose(experience.logprobs[i, : len(response)].double(), expected, atol=2e-5), (version, i)


def test_run_episodes_carry_each_turns_sampler_sets_past_the_tool_tokens_to_step():
    cut = dict(top_k=5)
    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"), scale=0.16, seed=1)
    trainer = agents_trainer(model, batch_size=4, advantage_estimator="grpo", num_samples_per_query=2, **cut)
    prompts = [USER, [{"role": "user", "content": "add 4 and 5"}]]
    torch.manual_seed(0)
    episodes = run_episodes(trainer, prompts, tools=[add], max_turns=3, num_generations=2, max_new_tokens=6,
                            do_sample=True)  # fmt: skip
    assert any(not bool(e.response_mask.all()) for e in episodes)  # tool tokens between model turns
    for episode in episodes:
        counts = episode.kept_sets.counts
        assert episode.kept_sets.width == len(episode.response)
        assert bool((counts[episode.response_mask == 0] == 0).all()) and bool((counts[episode.response_mask == 1] > 0).all())
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy = getattr(policy, "pretrained_model", policy)
    sampler = copy.deepcopy(policy)
    with torch.no_grad():  # the policy moves between sampling and scoring: lp_old keeps the sampler's sets
        policy.get_output_embeddings().weight.add_(0.05 * torch.randn(policy.get_output_embeddings().weight.shape,
                                                                      generator=torch.Generator().manual_seed(3)))
    now = copy.deepcopy(policy)
    seen = capture(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step(**step_inputs(episodes), scores=[torch.tensor(float(i % 2)) for i in range(4)])
    assert not [w for w in caught if "re-derived" in str(w.message)]
    for i, episode in enumerate(episodes):
        expected = sets_then_scored_now(sampler, now, episode.query, episode.response, Truncation(**cut), 1.0)
        actions = episode.response_mask.bool()
        lp_old = seen[0].logprobs[i, : len(episode.response)].double()
        assert torch.allclose(lp_old[actions], expected[actions], atol=2e-5), i


def test_the_grpo_trainer_steps_over_its_samplers_sets(tmp_path):
    """GRPOTrainer: its rollout's generate() records the sets, its step() finds them by the rows' tokens."""
    from grpo_helpers import trainer as grpo_trainer

    run = grpo_trainer(tmp_path, model="qwen2", top_k=5, temperature=0.7, max_steps=1)
    policy = run.ppo.accelerator.unwrap_model(run.ppo.model)
    sampler = copy.deepcopy(getattr(policy, "pretrained_model", policy))
    seen, batches, make = [], [], run.ppo.experience_maker.make
    run.ppo.experience_maker.make = lambda batch: batches.append(batch) or seen.append(make(batch)) or seen[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    assert not [w for w in caught if "re-derived" in str(w.message)]
    (batch,), (experience,) = batches, seen
    assert batch.kept_sets is not None and all(kept is not None for kept in batch.kept_sets)
    for i, (query, response) in enumerate(zip(batch.queries, batch.responses)):
        query, response = query.cpu(), response.cpu()
        expected = sets_then_scored_now(sampler, sampler, query, response, Truncation(top_k=5), 0.7)
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), expected, atol=2e-5), i


def test_the_grpo_trainers_tool_episodes_step_over_their_samplers_sets(tmp_path):
    """GRPOTrainer with tools: run_episodes' kept sets reach step() past the tool tokens."""
    from test_agents import make_chat_tokenizer
    from test_grpo_trainer_tools import ADD_TURN, config, dataset, even_ids

    from trl_lite import GRPOTrainer

    model = successor_model(ADD_TURN, scale=0.16, seed=1)
    run = GRPOTrainer(model, reward_funcs=[even_ids], args=config(tmp_path, max_steps=1, top_k=5),
                      train_dataset=dataset(), processing_class=make_chat_tokenizer(), tools=[add])  # fmt: skip
    policy = run.ppo.accelerator.unwrap_model(run.ppo.model)
    sampler = copy.deepcopy(getattr(policy, "pretrained_model", policy))
    seen, batches, make = [], [], run.ppo.experience_maker.make
    run.ppo.experience_maker.make = lambda batch: batches.append(batch) or seen.append(make(batch)) or seen[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    assert not [w for w in caught if "re-derived" in str(w.message)]
    (batch,), (experience,) = batches, seen
    assert any(not bool(m.all()) for m in batch.response_masks)  # tool tokens in the responses
    for i, (query, response, mask) in enumerate(zip(batch.queries, batch.responses, batch.response_masks)):
        query, response, actions = query.cpu(), response.cpu(), mask.cpu().bool()
        expected = sets_then_scored_now(sampler, sampler, query, response, Truncation(top_k=5), 1.0)
        lp_old = experience.logprobs[i, : len(response)].double()
        assert torch.allclose(lp_old[actions], expected[actions], atol=2e-5), i
