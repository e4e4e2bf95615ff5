"""trl_lite.agents on vLLM: colocated in this process and as a server (``python -m trl_lite.vllm_server`` on
the loopback address). Greedy episodes - tools, a TRL-style environment, a step environment - equal the
transformers engine's token for token, mask for mask, with the engine's log-probs equal to a float64
recomputation; sampled episodes train through step(), TRL-style environments whose group members start
apart and a dict of two of them included; the context length comes from the engine (its
max_model_len, the server's model card); the classic TextEnvironment gives on vLLM what it gives on the
model. The models are test_agents' successor GPT-2s (64 wide, 2 heads: vLLM's CPU attention needs a
head size of at least 32); one colocated engine serves every test, its weights swapped through the
trainer's own push (``generation.weights_changed()``).
"""

import random

import pytest
import torch
from test_agents import (
    CALLS,
    N_POSITIONS,
    TOKENIZER,
    USER,
    Counter,
    GuessGame,
    add,
    expected_layout,
    render_ids,
    successor_model,
    token,
    turn,
)
from test_agents_trl import (
    INCREMENT_MODEL,
    INCREMENT_TOOLS,
    CompassEnv,
    IncrementEnv,
    assert_grpo_advantages,
)
from test_vllm_server import launched_server
from transformers import GPT2LMHeadModel
from transformers.utils import get_json_schema

from trl_lite import PPOConfig, PPOTrainer, TextEnvironment
from trl_lite.agents import episode_stats, run_episodes, step_inputs

import vllm  # noqa: F401  (a test dependency: without it this module fails, it is not skipped)

# One worker runs the whole module: one colocated engine per process, one server.
pytestmark = pytest.mark.xdist_group("agents_vllm")

TOOL_MODEL = turn("<tool_call>", CALLS["add"], "</tool_call>")
COUNTER_MODEL = turn("<tool_call>", CALLS["increment"], "</tool_call>")
GUESS_MODEL = turn("GUESS_FIVE")


def vllm_config(**overrides):
    options = dict(
        batch_size=4, mini_batch_size=4, ppo_epochs=1, learning_rate=1e-3, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=N_POSITIONS,
        vllm_dtype="float32", seed=0,
    )  # fmt: skip
    options.update(overrides)
    return PPOConfig(**options)


@pytest.fixture(scope="module")
def trainer():
    trainer = PPOTrainer(vllm_config(), successor_model(TOOL_MODEL), tokenizer=TOKENIZER)
    yield trainer
    trainer.generation.close()


def use_weights(trainer, model: GPT2LMHeadModel) -> None:
    """Give the trainer's policy ``model``'s weights; the engine gets them with the next rollout."""
    policy = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
    with torch.no_grad():
        policy.load_state_dict(model.state_dict())
    trainer.generation.weights_changed()


def transformers_trainer(model):
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=4, advantage_estimator="grpo", num_samples_per_query=2),
                      model, tokenizer=TOKENIZER)  # fmt: skip


def assert_same_episodes(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert a.query.tolist() == b.query.tolist() and a.response.tolist() == b.response.tolist()
        assert a.response_mask.tolist() == b.response_mask.tolist() and a.messages == b.messages
        assert (a.num_turns, a.tool_calls, a.tool_errors, a.truncated, a.reward) == (
            b.num_turns, b.tool_calls, b.tool_errors, b.truncated, b.reward
        )  # fmt: skip
        actions = a.response_mask.bool()
        assert torch.allclose(a.logprobs[actions], b.logprobs[actions], atol=1e-4)


def assert_logprobs_match_float64(episodes, model) -> float:
    """The engine's log-prob of every model token against float64 transformers on the whole sequence; returns
    the number of template tokens skipped."""
    model64 = successor_model({}).double().eval()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    holes = 0
    for episode in episodes:
        sequence = torch.cat([episode.query, episode.response])
        with torch.no_grad():
            logits = model64(input_ids=sequence[None]).logits[0, len(episode.query) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, episode.response[:, None]).squeeze(1)
        actions = episode.response_mask.bool()
        assert (episode.logprobs.double() - expected)[actions].abs().max() < 1e-4
        holes += int((~actions).sum())
    return holes


def test_colocated_engine_has_prefix_caching_and_gives_its_context_length(trainer):
    backend = trainer.generation.engine.backend
    assert backend.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    use_weights(trainer, successor_model(GUESS_MODEL, n_positions=N_POSITIONS))
    long_prompt = [{"role": "user", "content": "add 2 and 3 " * 200}]
    with pytest.raises(ValueError, match=f"the engine's context length is {N_POSITIONS}"):
        run_episodes(trainer, [long_prompt], max_new_tokens=4)


@pytest.mark.parametrize("case", ["tools", "trl_environment", "step_environment"])
def test_greedy_episodes_equal_the_transformers_engines(trainer, case):
    successors, call, prompts = {
        "tools": (TOOL_MODEL, {"tools": [add]}, [USER, USER]),
        "trl_environment": (COUNTER_MODEL, {"environment_factory": Counter}, [{"prompt": USER, "start": s} for s in (1, 2)]),
        "step_environment": (GUESS_MODEL, {"environment_factory": GuessGame}, [{"prompt": USER, "secret": s} for s in (5, 7)]),
    }[case]  # fmt: skip
    model = successor_model(successors)
    use_weights(trainer, model)
    on_vllm = run_episodes(trainer, prompts, max_turns=3, max_new_tokens=8, **call)
    on_transformers = run_episodes(transformers_trainer(model), prompts, max_turns=3, max_new_tokens=8, **call)
    assert_same_episodes(on_vllm, on_transformers)
    assert [e.num_turns for e in on_vllm] == ([1, 3] if case == "step_environment" else [3, 3])
    tools = None if case == "step_environment" else [get_json_schema(add if case == "tools" else Counter().increment)]
    response, mask = expected_layout(on_vllm[1], tools)
    assert on_vllm[1].response.tolist() == response and on_vllm[1].response_mask.tolist() == mask
    assert_logprobs_match_float64(on_vllm, model)


def test_sampled_episodes_have_the_engines_logprobs_and_train(trainer):
    model = successor_model(TOOL_MODEL, scale=0.16, seed=1)
    use_weights(trainer, model)
    prompts = [USER, [{"role": "user", "content": "add 4 and 5"}]]
    episodes = run_episodes(trainer, prompts, tools=[add], max_turns=3, num_generations=2, max_new_tokens=6,
                            do_sample=True, top_k=0, seed=3)  # fmt: skip
    assert assert_logprobs_match_float64(episodes, model) > 0  # some episodes called the tool
    stats = trainer.step(**step_inputs(episodes), scores=[torch.tensor(float(i % 2)) for i in range(4)])
    assert stats["rollout/logprob_diff/max"] < 1e-4
    assert stats["time/rollout/generate"] > 0
    assert episode_stats(episodes)["env/turns/max"] <= 3
    # The next rollout runs on the updated weights (pushed once, before its first turn).
    pushes = []
    original = trainer.generation.push
    trainer.generation.push = lambda named: (pushes.append(1), original(named))[1]
    try:
        run_episodes(trainer, prompts, tools=[add], max_turns=3, num_generations=2, max_new_tokens=6, do_sample=True)
    finally:
        trainer.generation.push = original
    assert pushes == [1]


def test_trl_environments_that_start_apart_and_a_dict_of_them_play_and_train_on_vllm(trainer):
    """TRL-style environments (test_agents_trl): greedy episodes of a dict of two environments equal the
    transformers engine's; sampled groups whose members start apart train with GRPO through step()."""
    model = successor_model(INCREMENT_MODEL, scale=0.16, seed=2)
    use_weights(trainer, model)
    rows = [{"environment": "counter"}, {"prompt": USER, "environment": "compass", "heading": "north"}]
    factories = {"counter": IncrementEnv, "compass": CompassEnv}
    greedy = {}
    for name, on in (("vllm", trainer), ("transformers", transformers_trainer(model))):
        random.seed(0)  # both engines' environments draw the same tasks
        greedy[name] = run_episodes(on, rows, environment_factory=factories, max_turns=3, max_new_tokens=8)
    assert_same_episodes(greedy["vllm"], greedy["transformers"])
    assert greedy["vllm"][1].messages[2]["content"] == "{'error': 'Tool increment not found.'}"
    random.seed(4)
    episodes = run_episodes(trainer, rows, environment_factory=factories, max_turns=3, num_generations=2,
                            max_new_tokens=6, do_sample=True, top_k=0, seed=3)  # fmt: skip
    assert_logprobs_match_float64(episodes, model)
    for episode in episodes[:2]:  # each member's query is its own task's
        target = episode.environment.target
        assert episode.messages[0]["content"] == f"Increment the counter to {target}."
        assert episode.query.tolist() == render_ids(episode.messages[:1], INCREMENT_TOOLS, True)
    inputs = step_inputs(episodes)
    rewards = [e.reward for e in episodes]
    stats = trainer.step(**inputs, scores=[torch.tensor(r) for r in rewards])
    assert stats["rollout/logprob_diff/max"] < 1e-4
    assert_grpo_advantages(stats, episodes, rewards, inputs["group_ids"])


def test_text_environment_on_vllm_gives_the_classic_results(trainer):
    """Each turn generates past <submit> on vLLM and is cut where the classic stopping criteria stop."""
    submit = TOKENIZER("<submit>", add_special_tokens=False)["input_ids"]
    chain = [token("GUESS_FIVE"), token("HELLO"), *submit, token("HELLO")]  # then <submit> again, and again
    successors = dict(zip(chain[:-1], chain[1:]))
    model = successor_model(successors)
    use_weights(trainer, model)
    kwargs = dict(reward_fn=lambda texts: [float(len(t)) for t in texts], prompt="guess ", max_turns=2,
                  generation_kwargs={"do_sample": False, "max_new_tokens": 10})  # fmt: skip
    tasks = ["GUESS_FIVE", "GUESS_FIVE"]
    on_vllm = TextEnvironment(trainer, TOKENIZER, tools={}, **kwargs).run(tasks)
    classic = TextEnvironment(model, TOKENIZER, tools={}, **kwargs).run(tasks)
    for got, expected in zip(on_vllm[:3], classic[:3]):
        assert [t.tolist() for t in got] == [t.tolist() for t in expected]
    assert on_vllm[3] == classic[3]
    assert TOKENIZER.decode(on_vllm[1][0]) == "HELLO<submit>"


# ----------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m trl_lite.vllm_server`` on a saved successor model; yields its URL."""
    model_dir = tmp_path_factory.mktemp("agent_model")
    successor_model(GUESS_MODEL).save_pretrained(model_dir)  # not the weights the tests use: they are pushed
    with launched_server(model_dir, tmp_path_factory.mktemp("server_log") / "server.log", N_POSITIONS) as (url, _):
        yield url


def test_episodes_on_a_server_equal_the_transformers_engines(server):
    model = successor_model(TOOL_MODEL)
    config = vllm_config(vllm_mode="server", vllm_server_url=server, vllm_server_timeout=120)
    trainer = PPOTrainer(config, successor_model(TOOL_MODEL), tokenizer=TOKENIZER)
    try:
        on_server = run_episodes(trainer, [USER, USER], tools=[add], max_turns=3, max_new_tokens=8)
        assert_same_episodes(on_server, run_episodes(transformers_trainer(model), [USER, USER], tools=[add],
                                                     max_turns=3, max_new_tokens=8))  # fmt: skip
        assert_logprobs_match_float64(on_server, model)
        long_prompt = [{"role": "user", "content": "add 2 and 3 " * 200}]  # the server's max_model_len bounds it
        with pytest.raises(ValueError, match=f"the engine's context length is {N_POSITIONS}"):
            run_episodes(trainer, [long_prompt], max_new_tokens=4)
        sampled = run_episodes(trainer, [USER, USER], tools=[add], max_turns=2, num_generations=2, max_new_tokens=8,
                               do_sample=True)  # fmt: skip
        stats = trainer.step(**step_inputs(sampled), scores=[torch.tensor(1.0), torch.tensor(0.0)] * 2)
        assert stats["rollout/logprob_diff/max"] < 1e-4
    finally:
        trainer.generation.close()
