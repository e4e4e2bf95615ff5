"""Multi-turn agent rollouts: tools and environments on the trainer's engine, straight into ``step()``.

    from trl_lite.agents import run_episodes, step_inputs, episode_stats

    episodes = run_episodes(trainer, prompts, tools=[calculator], num_generations=8, max_new_tokens=32, do_sample=True)
    stats = trainer.step(**step_inputs(episodes), scores=[torch.tensor(reward(e)) for e in episodes])
    trainer.log_stats({**stats, **episode_stats(episodes)}, completions_columns(episodes), scores,
                      columns_to_log=("conversation",))

Environments written for TRL's ``environment_factory`` (one class, or a dict routed by each row's
``environment`` field) and TRL-style ``reward_funcs`` run unchanged, with TRL's episode semantics
(docs/agents.md). The token layout of an episode, where its score lands and how groups
form - by prompt, so a group's members may start apart: docs/algorithm.md section 16.
"""

from .chat import ChatFormat, ToolCall, parse_tool_calls
from .episodes import Episode, completions_columns, episode_stats, step_inputs
from .rollout import run_episodes

__all__ = [
    "ChatFormat", "Episode", "ToolCall", "completions_columns", "episode_stats", "parse_tool_calls", "run_episodes",
    "step_inputs",
]  # fmt: skip
