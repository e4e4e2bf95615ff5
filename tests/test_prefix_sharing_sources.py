"""Prefix sharing with engine log-probs: truncated importance sampling (TIS) and the episodes of `run_episodes`.

As in tests/test_prefix_sharing.py, a step with `prefix_sharing=True` must give the statistics and the update
of `prefix_sharing=False` (float32, relative 1e-5): here with the engine's log-probs given to `step()` - the
TIS weights `min(exp(lp_old - lp_gen), cap)` and the log-prob gap statistics read `lp_old` from shared passes -
and on multi-turn episodes, whose rows of one prompt share the rendered prompt token for token.
"""

import copy

import numpy as np
import pytest
import torch
from devices import assert_close
from test_agents import CALLS, TOKENIZER, USER, add, successor_model, turn
from test_objectives import _generation_logprobs
from test_prefix_sharing import ARCHITECTURES, COMPARED, GRPO, grouped_batch, make_trainer

from trl_lite import PPOConfig, PPOTrainer
from trl_lite.agents import run_episodes, step_inputs

GAP_KEYS = ("rollout/logprob_diff/mean", "rollout/logprob_diff/max", "rollout/is_weight/mean")


def assert_same_step(shared: dict, plain: dict, keys) -> None:
    assert shared["prefix_sharing/tokens_saved_fraction"] > 0.1
    assert plain["prefix_sharing/tokens_saved_fraction"] == 0.0
    for key in keys:
        np.testing.assert_allclose(shared[key], plain[key], rtol=1e-5, atol=1e-6, err_msg=key)


def assert_same_update(shared_model, plain_model, initial: dict) -> None:
    plain = {k: p.detach() - initial[k] for k, p in plain_model.named_parameters() if k in initial}
    largest = max(step.abs().max() for step in plain.values())
    assert largest > 1e-3
    for key, param in shared_model.named_parameters():
        if key in plain:  # the updates agree to float32 rounding, relative to the largest step
            assert_close(param.detach() - initial[key], plain[key], rtol=1e-5, atol=1e-5 * largest)


TIS_CASES = {
    # lp_old from the policy's rollout pass (2 epochs), the TIS weights made before training ...
    "rollout-pass": dict(ppo_epochs=2, mini_batch_size=4, shuffle_by_prompt=True),
    # ... and from the one training forward (one on-policy update: no rollout pass), made in the learner.
    "training-forward": dict(ppo_epochs=1),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("name", list(TIS_CASES))
def test_tis_with_shared_prompts_equals_the_unshared_step(name, arch):
    options = dict(GRPO, importance_sampling_correction="tis", importance_sampling_cap=1.1, arch=arch, **TIS_CASES[name])
    trainers = {sharing: make_trainer(sharing, **options) for sharing in (True, False)}
    initial = {k: p.detach().clone() for k, p in trainers[False].model.named_parameters()}
    stats = {True: [], False: []}
    for seed in range(2):
        queries, responses, scores = grouped_batch(seed)
        # The engine's log-probs: the current policy's with noise, so that some TIS weights hit the cap.
        generation = _generation_logprobs(trainers[False].model, queries, responses, 0.3, seed)
        for sharing, trainer in trainers.items():
            torch.manual_seed(seed)
            stats[sharing].append(trainer.step(queries, responses, scores, generation_logprobs=generation))
    for shared, plain in zip(stats[True], stats[False]):
        assert 0.5 < plain["rollout/is_weight/mean"] < 1.1  # the weights are in play
        assert_same_step(shared, plain, COMPARED + GAP_KEYS)
    assert_same_update(trainers[True].model, trainers[False].model, initial)


def chat_qwen2():
    """A tiny Qwen2 (rotary, 4 query heads sharing 2 key/value heads) over the chat tokenizer's vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    config = Qwen2Config(vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id)  # fmt: skip
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_episodes_of_one_prompt_share_it_and_step_as_unshared(arch):
    generator = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"), scale=0.16, seed=1)
    model = generator if arch == "gpt2" else chat_qwen2()  # Qwen2: steps on the episodes the GPT-2 played
    prompts = [USER, [{"role": "user", "content": "add 4 and 5 and then 6"}]]
    trainers, initial = {}, {k: p.detach().clone() for k, p in model.named_parameters()}
    for sharing in (True, False, "generator"):
        config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=2, learning_rate=0.1, seed=0,
                           advantage_estimator="grpo", num_samples_per_query=4, prefix_sharing=sharing is True,
                           shuffle_by_prompt=True)  # fmt: skip
        policy = copy.deepcopy(generator if sharing == "generator" else model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=config.learning_rate)
        trainers[sharing] = PPOTrainer(config, policy, tokenizer=TOKENIZER, optimizer=optimizer)
    torch.manual_seed(0)
    episodes = run_episodes(trainers.pop("generator"), prompts, tools=[add], max_turns=3, num_generations=4,
                            max_new_tokens=6, do_sample=True, top_k=0)  # fmt: skip
    inputs = step_inputs(episodes)
    assert inputs["group_ids"] == [0, 0, 0, 0, 1, 1, 1, 1]
    queries = inputs["queries"]
    assert all(torch.equal(queries[i], queries[i - i % 4]) for i in range(8))  # the prompt, token for token
    assert not torch.equal(queries[0], queries[4])
    assert len({len(r) for r in inputs["responses"]}) > 1
    assert any(not bool(m.all()) for m in inputs["response_masks"])  # tool output tokens: masked, still attended
    scores = [torch.tensor(float(i % 3)) for i in range(8)]
    stats = {}
    for sharing, trainer in trainers.items():
        torch.manual_seed(1)
        stats[sharing] = trainer.step(**inputs, scores=scores)
    assert_same_step(stats[True], stats[False], COMPARED + GAP_KEYS[:2])
    # Every pass held whole groups (mini-batches of 4 with shuffle_by_prompt): each prompt ran once per pass.
    total = sum(len(q) + len(r) for q, r in zip(queries, inputs["responses"]))
    assert stats[True]["prefix_sharing/tokens_saved_fraction"] == pytest.approx(3 * (len(queries[0]) + len(queries[4])) / total)
    assert_same_update(trainers[True].model, trainers[False].model, {f"pretrained_model.{k}": v for k, v in initial.items()})
