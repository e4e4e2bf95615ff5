"""Environments written for TRL's GRPOTrainer run unchanged through run_episodes and step(): each test
pins one of TRL's episode semantics on a small environment written in the style of TRL's documentation
(``reset(**kwargs)``, public methods as tools, ``get_reward``), on the transformers engine.

- groups whose members start apart (``reset`` drawing a random task per episode) and a dict of two
  environments routed by the rows' ``environment`` field, both trained with GRPO through step();
- the turn limit (the last turn's calls are not run), ``async def`` tools and rewards, ``str()`` results
  and content blocks, no schema check on arguments, bound methods only (no staticmethod), ``reset``
  getting the whole row and joining the last message whatever its role;
- rewards: TRL-style reward functions (``environments=`` and the row's fields) with their weights and
  ``get_reward``, None/NaN as "not scored", summed with ``nansum``.

The models are test_agents' successor GPT-2s; their calls are one token each (test_agents.CALLS).
"""

import asyncio
import logging
import math
import random

import pytest
import torch
from test_agents import (
    CALLS,
    CHAT_TEMPLATE,
    TOKENIZER,
    USER,
    make_chat_tokenizer,
    make_trainer,
    render_ids,
    successor_model,
    turn,
)
from transformers.utils import get_json_schema

from trl_lite.agents import run_episodes, step_inputs


class IncrementEnv:
    """TRL's documented shape: the environment draws its own task at reset and writes it into the prompt."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        self.target = random.choice([2, 4, 6])
        return f"Increment the counter to {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CompassEnv:
    """A second environment for a dict environment_factory: its own tool, its task from the row."""

    def reset(self, heading: str = "north", **kwargs) -> None:
        self.kwargs = dict(kwargs, heading=heading)
        self.heading = heading

    def get_reward(self) -> float:
        return 0.5 if self.heading == "north" else 0.0

    def turn_to(self, heading: str) -> str:
        """
        Turn to a heading.

        Args:
            heading: The new heading.
        """
        self.heading = heading
        return heading


INCREMENT_MODEL = turn("<tool_call>", CALLS["increment_step"], "</tool_call>")
INCREMENT_TOOLS = [get_json_schema(IncrementEnv().increment)]


def grpo_reference(rewards: list[float], groups: list[int]) -> torch.Tensor:
    """GRPO advantages in float64: ``(r - mean_G) / (unbiased std_G + 1e-6)`` per group."""
    r = torch.tensor(rewards, dtype=torch.float64)
    ids = torch.tensor(groups)
    out = torch.empty_like(r)
    for g in ids.unique():
        members = ids == g
        out[members] = (r[members] - r[members].mean()) / (r[members].std() + 1e-6)
    return out


def assert_grpo_advantages(stats, episodes, rewards, groups):
    """step()'s per-token advantages are each episode's GRPO advantage on each of its model tokens."""
    actions = torch.tensor([int(e.response_mask.sum()) for e in episodes])
    expected = grpo_reference(rewards, groups).repeat_interleave(actions)
    got = torch.as_tensor(stats["ppo/policy/advantages"], dtype=torch.float64).flatten()
    assert torch.allclose(got, expected, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Groups whose members start apart; several environments in one run
# ----------------------------------------------------------------------------------------------


def test_members_of_a_group_start_apart_and_train_with_grpo():
    model = successor_model(INCREMENT_MODEL, scale=0.16, seed=1)
    trainer = make_trainer(model, batch_size=8, advantage_estimator="grpo", num_samples_per_query=4)
    random.seed(4)  # after the trainer, which seeds Python's random too
    # Rows without a prompt: the environment owns the task (TRL's environment_factory without a dataset).
    episodes = run_episodes(trainer, [{}, {}], environment_factory=IncrementEnv, max_turns=3, num_generations=4,
                            max_new_tokens=6, do_sample=True, top_k=0)  # fmt: skip
    targets = [e.environment.target for e in episodes]
    assert len(set(targets[:4])) > 1 and len(set(targets[4:])) > 1  # each group holds several starts
    for episode, target in zip(episodes, targets):
        assert episode.messages[0] == {"role": "user", "content": f"Increment the counter to {target}."}
        assert episode.query.tolist() == render_ids(episode.messages[:1], INCREMENT_TOOLS, True)
        assert episode.reward == float(episode.environment.counter == target)
    inputs = step_inputs(episodes)
    assert inputs["group_ids"] == [0] * 4 + [1] * 4 and [e.group_id for e in episodes[:4]] == [episodes[0].group_id] * 4
    rewards = [e.reward for e in episodes]
    assert len(set(rewards[:4])) > 1 and len(set(rewards[4:])) > 1  # advantages that are not all 0
    scores = [torch.tensor(r) for r in rewards]
    # Without group_ids, consecutive rows must share their query (nothing else says they are a group).
    derived = {key: value for key, value in inputs.items() if key != "group_ids"}
    with pytest.raises(ValueError, match="are in one group but their queries differ"):
        trainer.step(**derived, scores=scores)
    stats = trainer.step(**inputs, scores=scores)
    assert_grpo_advantages(stats, episodes, rewards, inputs["group_ids"])


def test_a_dict_of_two_environments_routes_each_row_and_trains_with_grpo():
    model = successor_model(INCREMENT_MODEL, scale=0.16, seed=2)
    trainer = make_trainer(model, batch_size=4, advantage_estimator="grpo", num_samples_per_query=2)
    random.seed(4)  # after the trainer, which seeds Python's random too
    compass_prompt = [{"role": "user", "content": "Face the wind."}]
    rows = [{"environment": "counter"}, {"prompt": compass_prompt, "environment": "compass", "heading": "north"}]
    factories = {"counter": IncrementEnv, "compass": CompassEnv}
    episodes = run_episodes(trainer, rows, environment_factory=factories, max_turns=3, num_generations=2,
                            max_new_tokens=6, do_sample=True, top_k=0)  # fmt: skip
    assert [type(e.environment) for e in episodes] == [IncrementEnv, IncrementEnv, CompassEnv, CompassEnv]
    # Only the episode's own environment's tools reach its prompt; reset gets the row without `environment`.
    counter_tools, compass_tools = INCREMENT_TOOLS, [get_json_schema(CompassEnv().turn_to)]
    for episode in episodes[:2]:
        assert episode.query.tolist() == render_ids(episode.messages[:1], counter_tools, True)
    for episode in episodes[2:]:
        assert episode.query.tolist() == render_ids(compass_prompt, compass_tools, True)
        assert episode.environment.kwargs == {"prompt": compass_prompt, "heading": "north"}
        replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert all(reply == "{'error': 'Tool increment not found.'}" for reply in replies)  # the other's tool
        assert episode.reward == 0.5 and episode.tool_errors == episode.tool_calls
    inputs = step_inputs(episodes)
    assert inputs["group_ids"] == [0, 0, 1, 1]
    rewards = [e.reward for e in episodes]
    assert rewards[0] != rewards[1]  # the counter's group: one episode reached its target
    assert rewards[0] != rewards[1]  # the counter's group: one episode reached its target
    assert rewards[0] != rewards[1]  # the counter's group: one episode reached its target
    stats = trainer.step(**inputs, scores=[torch.tensor(r) for r in rewards])
    assert_grpo_advantages(stats, episodes, rewards, inputs["group_ids"])


# ----------------------------------------------------------------------------------------------
# Episode semantics
# ----------------------------------------------------------------------------------------------


def test_the_last_turns_tool_calls_are_not_run():
    trainer = make_trainer(successor_model(INCREMENT_MODEL))
    (episode,) = run_episodes(trainer, [USER], environment_factory=IncrementEnv, max_turns=2, max_new_tokens=8)
    assert episode.environment.counter == 2  # turn 1's call ran, turn 2's did not reach the environment
    assert (episode.num_turns, episode.tool_calls, episode.truncated) == (2, 1, True)
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]


class AsyncCounter:
    """``async def`` tool and reward, as TRL allows both."""

    def reset(self, **kwargs) -> None:
        self.counter = 0

    async def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add.
        """
        await asyncio.sleep(0)
        if self.counter >= 4:
            raise ValueError("the counter is full")
        self.counter += step
        return self.counter

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.counter)


def test_async_tools_and_get_reward_are_awaited():
    trainer = make_trainer(successor_model(INCREMENT_MODEL))
    (episode,) = run_episodes(trainer, [USER], environment_factory=AsyncCounter, max_turns=4, max_new_tokens=8)
    replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert replies == ["2", "4", "{'error': 'the counter is full'}"]
    assert (episode.tool_calls, episode.tool_errors, episode.reward) == (3, 1, 4.0)


class Describer:
    """A tool whose results are a dict, a bool, None and a list of content blocks, in turn."""

    RESULTS = ({"a": 1}, True, None, [{"type": "text", "text": "a block"}])

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def describe(self) -> object:
        """Describe the state."""
        self.calls += 1
        return self.RESULTS[self.calls - 1]

    @staticmethod
    def helper() -> str:
        """A public staticmethod: no tool in TRL (only bound methods are)."""
        return "helped"


def blocks_tokenizer():
    """The test tokenizer with a template that also renders a list of text blocks as a message's content."""
    tokenizer = make_chat_tokenizer()
    as_text = "(message.content if message.content is string else message.content | map(attribute='text') | join(''))"
    tokenizer.chat_template = CHAT_TEMPLATE.replace("message.content", as_text)
    assert tokenizer.get_vocab() == TOKENIZER.get_vocab()
    return tokenizer


def rendered_until_last_turn(tokenizer, messages, tools) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools)["input_ids"]
    return ids[: len(ids) - ids[::-1].index(tokenizer.convert_tokens_to_ids("<|im_end|>"))]


def test_tool_results_are_str_of_the_result_and_content_blocks_pass_through():
    tokenizer = blocks_tokenizer()
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["describe"], "</tool_call>")))
    (episode,) = run_episodes(trainer, [USER], environment_factory=Describer, max_turns=5, max_new_tokens=8,
                              tokenizer=tokenizer)  # fmt: skip
    replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert replies == ["{'a': 1}", "True", "None", [{"type": "text", "text": "a block"}]]
    tools = [get_json_schema(Describer().describe)]
    sequence = torch.cat([episode.query, episode.response]).tolist()
    assert sequence == rendered_until_last_turn(tokenizer, episode.messages, tools)
    assert "\n<tool_response>\na block\n</tool_response>" in tokenizer.decode(episode.response)


def test_only_bound_methods_are_tools():
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["helper"], "</tool_call>")))
    (episode,) = run_episodes(trainer, [USER], environment_factory=Describer, max_turns=2, max_new_tokens=8)
    assert episode.query.tolist() == render_ids(USER, [get_json_schema(Describer().describe)], True)
    assert episode.messages[2] == {"role": "tool", "name": "helper", "content": "{'error': 'Tool helper not found.'}"}


def test_arguments_reach_the_tool_as_given_unless_checked():
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["increment_float"], "</tool_call>")))
    (episode,) = run_episodes(trainer, [USER], environment_factory=IncrementEnv, max_turns=2, max_new_tokens=8)
    assert episode.messages[2]["content"] == "1.0" and episode.tool_errors == 0  # increment(step=1.0) works
    (episode,) = run_episodes(trainer, [USER], environment_factory=IncrementEnv, max_turns=2, max_new_tokens=8,
                              check_tool_arguments=True)  # fmt: skip
    assert episode.messages[2]["content"] == """{'error': "increment: argument 'step' must be integer, got 1.0."}"""
    assert episode.tool_errors == 1 and episode.environment.counter == 0


class Recorder:
    """Records what reset got; returns the text (or blocks) it was told to."""

    def reset(self, **kwargs):
        self.kwargs = kwargs
        return kwargs.get("reply")


def test_reset_gets_the_row_and_joins_the_last_message_whatever_its_role():
    tokenizer = blocks_tokenizer()
    trainer = make_trainer(successor_model(turn("HELLO")))
    prefilled = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "Ready."}]
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Look:"}]}]
    rows = [
        {"prompt": prefilled, "reply": " Board 3.", "environment": "kept"},  # a single factory passes it on
        {"prompt": USER, "reply": [{"type": "text", "text": " (blocks)"}]},
        {"prompt": blocks, "reply": " text"},
        {"prompt": USER},
    ]
    episodes = run_episodes(trainer, rows, environment_factory=Recorder, max_new_tokens=4, tokenizer=tokenizer)
    assert [e.environment.kwargs for e in episodes] == rows  # the whole row, prompt included
    assert episodes[0].messages[:2] == [prefilled[0], {"role": "assistant", "content": "Ready. Board 3."}]
    assert episodes[1].messages[0]["content"] == [
        {"type": "text", "text": "add 2 and 3"}, {"type": "text", "text": " (blocks)"}
    ]  # fmt: skip
    assert episodes[2].messages[0]["content"] == [{"type": "text", "text": "Look:"}, {"type": "text", "text": " text"}]
    assert episodes[3].messages[0] == USER[0]
    assert rows[0]["prompt"][1]["content"] == "Ready."  # the caller's row is left as it was
    for episode in episodes:
        prompt = episode.messages[:-1]
        expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
        assert episode.query.tolist() == expected


# ----------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------


class Graded(IncrementEnv):
    """get_reward: the counter, or "not scored" (None, NaN) for the rows that say so."""

    def reset(self, grade="score", **kwargs) -> None:
        self.counter, self.grade = 0, grade

    def get_reward(self):
        return {"score": float(self.counter), "none": None, "nan": math.nan}[self.grade]


def test_reward_functions_and_get_reward_combine_as_trls_nansum(caplog):
    seen = {}

    def bonus(prompts, completions, completion_ids, environments, grade, bonus, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    environments=environments, grade=grade, bonus=bonus, rest=kwargs)  # fmt: skip
        return [None if g == "nan" else b for g, b in zip(grade, bonus)]

    async def turns(completions, **kwargs):
        return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]

    trainer = make_trainer(successor_model(INCREMENT_MODEL))
    rows = [{"prompt": USER, "grade": g, "bonus": b} for g, b in (("score", 0.5), ("none", 0.25), ("nan", 0.0))]
    episodes = run_episodes(trainer, rows, environment_factory=Graded, max_turns=2, max_new_tokens=8,
                            reward_funcs=[bonus, turns], reward_weights=[2.0, 0.5])  # fmt: skip
    assert seen["grade"] == ["score", "none", "nan"] and seen["bonus"] == [0.5, 0.25, 0.0] and seen["rest"] == {}
    assert seen["environments"] == [e.environment for e in episodes]
    assert seen["prompts"] == [USER] * 3 and seen["completions"] == [e.messages[1:] for e in episodes]
    assert seen["completion_ids"] == [e.response.tolist() for e in episodes]
    # 2 model turns each; the environment's counter is 2 (one call ran), scored only for the "score" row.
    expected = [2.0 * 0.5 + 0.5 * 2 + 2.0, 2.0 * 0.25 + 0.5 * 2, 0.5 * 2]
    assert [e.reward for e in episodes] == pytest.approx(expected, abs=1e-12)
    assert episodes[1].reward_sources["Graded"] != episodes[1].reward_sources["Graded"]  # NaN: not scored
    assert episodes[0].reward_sources == {"bonus": 0.5, "turns": 2.0, "Graded": 2.0}
    # No source scores an episode: its reward is NaN, and a warning says so.
    rows = [{"prompt": USER, "grade": "none"}, {"prompt": USER, "grade": "nan"}]
    with caplog.at_level(logging.WARNING, logger="trl_lite.agents.rewards"):
        episodes = run_episodes(trainer, rows, environment_factory=Graded, max_turns=2, max_new_tokens=8)
    assert all(math.isnan(e.reward) for e in episodes)
    assert "2 of 2 episodes were scored by no reward source" in caplog.text


def test_bad_reward_function_output_is_refused():
    trainer = make_trainer(successor_model(INCREMENT_MODEL))
    def short(**kwargs):
        return [1.0]

    def text(completions, **kwargs):
        return ["1"] * len(completions)

    with pytest.raises(ValueError, match="reward function short must return a list of 2 rewards"):
        run_episodes(trainer, [USER, USER], reward_funcs=short, max_new_tokens=4)
    with pytest.raises(TypeError, match="reward function text gave episode 0 '1'; a reward is a finite number"):
        run_episodes(trainer, [USER, USER], reward_funcs=[text], max_new_tokens=4)
