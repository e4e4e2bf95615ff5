"""Episodes as ``step()`` rows, their statistics and their completions-table columns.

One episode is one row (docs/algorithm.md section 16): ``query`` is the prompt as the chat template
renders it up to the first generation prompt, ``response`` everything after it, and
``response_mask`` marks the tokens the model sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Episode:
    """One multi-turn episode, ready for ``PPOTrainer.step``.

    Attributes:
        query: ``(Q,)`` token ids: the prompt rendered by the chat template (tools' schemas included)
            up to and including the first generation prompt.
        response: ``(R,)`` token ids after the query: each model turn as sampled (its end-of-turn token
            included), each followed - unless the episode ended there - by the tokens the template adds
            for the tool or environment messages and the next generation prompt. It always ends with a
            model token.
        response_mask: ``(R,)`` long, 1 on the tokens the model sampled, 0 on the template's and the
            environment's.
        logprobs: ``(R,)`` float32, the engine's log-prob of each sampled token under ``logits / T`` (``T`` the
            run's ``PPOConfig.temperature``, docs/temperature.md); 0.0 at mask-0 positions (ignored by ``step``).
        reward: the weighted sum of its reward sources that scored it (TRL's ``nansum``): the reward
            functions and the environment's reward (``get_reward()``, or the sum of a step environment's
            rewards, 0.0 when it never stepped); NaN when no source scored it, None when there is no source.
        num_turns: model turns; ``tool_calls`` / ``tool_errors``: tool calls run / that failed (their
            ``{'error': ...}`` went back to the model); ``truncated``: ended by ``max_turns``,
            ``max_episode_tokens``, the context length or a turn cut at ``max_new_tokens``.
        messages: the conversation: the prompt's messages, then per turn the model's message (its
            text as decoded) and the tool or environment messages it got.
        prompt_index: index of the episode's prompt in the ``prompts`` of its call; ``group_id``: the
            same for the ``num_generations`` episodes of one prompt - whether or not their queries are
            equal - and distinct across calls.
        environment: the episode's environment instance, or None.
        reward_sources: ``{source: value}``: each reward function's value by its ``__name__``, the
            environment's reward by its class name (as TRL logs them); NaN where a source did not score it.
        prompt_length: how many of ``messages`` are the prompt's (with the text ``reset`` joined to them); the
            rest are the completion's, as reward functions get them.
        kept_sets: under truncated sampling (docs/truncated_sampling.md) the kept sets the engine's sampler used at
            each model token (a one-row :class:`~trl_lite.core.kept_sets.KeptSets` over ``response``, none at mask-0
            positions), or None (an engine that cannot record them: ``step()`` re-derives them).
    """

    query: torch.Tensor
    response: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    reward: float | None
    num_turns: int
    tool_calls: int
    tool_errors: int
    truncated: bool
    messages: list[dict]
    prompt_index: int
    group_id: int
    environment: object | None = field(default=None, repr=False)
    reward_sources: dict[str, float] = field(default_factory=dict)
    prompt_length: int = 0
    kept_sets: object = field(default=None, repr=False)

    @property
    def conversation(self) -> str:
        """The messages as text, one ``role: content`` block per message."""
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)


def _check_episodes(episodes) -> list[Episode]:
    if not isinstance(episodes, (list, tuple)) or not episodes:
        raise ValueError(f"episodes must be a non-empty list of Episode (from run_episodes), got {episodes!r:.80}.")
    for i, episode in enumerate(episodes):
        if not isinstance(episode, Episode):
            raise TypeError(f"episodes[{i}] must be an Episode (from run_episodes), got {type(episode).__name__}.")
    return list(episodes)


def step_inputs(episodes: list[Episode]) -> dict:
    """``PPOTrainer.step`` keyword arguments for ``episodes``, one row each, in order.

    Returns ``queries``, ``responses``, ``response_masks``, ``generation_logprobs`` (lists of 1-D
    tensors), ``kept_sets`` (per episode, see :class:`Episode`) and ``group_ids``: the episodes of one
    prompt of one ``run_episodes`` call share an id
    (numbered 0, 1, ... in order of appearance), or None when every prompt has one episode (so
    the trainer's own grouping or none applies). A group is its prompt: its members' queries may
    differ (environments that start each member apart), and ``step()`` takes explicit ``group_ids``
    as they are (docs/algorithm.md section 16). Scores are the caller's:
    ``trainer.step(**step_inputs(episodes), scores=[torch.tensor(e.reward) for e in episodes])``.
    """
    episodes = _check_episodes(episodes)
    compact: dict[int, int] = {}
    group_ids = [compact.setdefault(e.group_id, len(compact)) for e in episodes]
    return {
        "queries": [e.query for e in episodes],
        "responses": [e.response for e in episodes],
        "response_masks": [e.response_mask for e in episodes],
        "generation_logprobs": [e.logprobs for e in episodes],
        "group_ids": group_ids if len(compact) < len(episodes) else None,
        "kept_sets": [e.kept_sets for e in episodes],
    }


def episode_stats(episodes: list[Episode], accelerator=None) -> dict[str, float]:
    """``env/turns/mean|max``, ``env/tool_calls/mean`` (per episode), ``env/tool_error_fraction`` (failed
    calls / calls, 0 without calls) and ``env/truncated_fraction``, to merge into ``log_stats``' stats.

    With ``accelerator`` (``trainer.accelerator``) they cover the episodes of every process (a
    collective: every process must call it).
    """
    episodes = _check_episodes(episodes)
    sums = torch.tensor(
        [
            len(episodes),
            sum(e.num_turns for e in episodes),
            sum(e.tool_calls for e in episodes),
            sum(e.tool_errors for e in episodes),
            sum(e.truncated for e in episodes),
        ],
        dtype=torch.float64,
    )
    most = torch.tensor([max(e.num_turns for e in episodes)], dtype=torch.float64)
    if accelerator is not None and accelerator.num_processes > 1:
        sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").cpu()
        most = accelerator.gather(most.to(accelerator.device)).max().reshape(1).cpu()
    count, turns, calls, errors, truncated = sums.tolist()
    return {
        "env/turns/mean": turns / count,
        "env/turns/max": float(most.item()),
        "env/tool_calls/mean": calls / count,
        "env/tool_error_fraction": errors / calls if calls else 0.0,
        "env/truncated_fraction": truncated / count,
    }


def completions_columns(episodes: list[Episode]) -> dict[str, list]:
    """Columns for ``log_stats``' completions table, one entry per episode: ``conversation`` (the whole
    conversation as text), ``num_turns``, ``tool_calls``, ``tool_errors`` and ``truncated``.

    ``trainer.log_stats(stats, completions_columns(episodes), scores, columns_to_log=("conversation", "num_turns"))``
    """
    episodes = _check_episodes(episodes)
    return {
        "conversation": [e.conversation for e in episodes],
        "num_turns": [e.num_turns for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes],
        "tool_errors": [e.tool_errors for e in episodes],
        "truncated": [e.truncated for e in episodes],
    }
