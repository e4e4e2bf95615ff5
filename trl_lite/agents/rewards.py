"""An episode's reward from its sources, as TRL's GRPOTrainer combines them (docs/algorithm.md section 16).

The sources are TRL-style reward functions - ``f(prompts, completions, completion_ids, **kwargs) ->
list[float | None]`` with the episodes' ``environments`` and each row field as a list in ``kwargs`` -
each with its weight, and the environment's own reward (``get_reward()``, or a step environment's
summed rewards) with weight 1. None and NaN mean "not scored"; the reward is the weighted sum of the
scored sources (``nansum``), NaN when no source scored the episode.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable

import torch

from .tools import run_coroutines

logger = logging.getLogger(__name__)
# Keys of a row that TRL does not pass to reward functions as fields: they arrive as prompts/completions.
_NOT_FIELDS = frozenset({"prompt", "completion", "completion_ids"})


def check_reward_funcs(reward_funcs, reward_weights) -> tuple[list[Callable], list[float]]:
    """``reward_funcs`` as a list (one callable or a list of them) and their weights (default 1 each)."""
    if reward_funcs is None:
        if reward_weights is not None:
            raise ValueError(
                f"reward_weights={reward_weights!r} was given without reward_funcs; give both or neither."
            )
        return [], []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for i, func in enumerate(funcs):
        if not callable(func):
            raise TypeError(
                f"reward_funcs[{i}] must be a function f(prompts, completions, **kwargs) -> list of floats, "
                f"got {type(func).__name__}."
            )
    if reward_weights is None:
        return funcs, [1.0] * len(funcs)
    weights = list(reward_weights) if isinstance(reward_weights, (list, tuple)) else None
    if weights is None or len(weights) != len(funcs) or not all(_finite(w) for w in weights):
        raise ValueError(
            f"reward_weights must be a list of {len(funcs)} finite numbers, one per reward function, "
            f"got {reward_weights!r}."
        )
    return funcs, [float(w) for w in weights]


def source_name(func: Callable) -> str:
    return getattr(func, "__name__", type(func).__name__)


def score_episodes(
    funcs: list[Callable],
    weights: list[float],
    prompts: list,
    completions: list[list[dict]],
    completion_ids: list[list[int]],
    rows: list[dict],
    environments: list | None,
    environment_rewards: list[float | None],
) -> tuple[list[float | None], list[dict[str, float]]]:
    """Each episode's reward and its sources' values.

    Args:
        funcs, weights: the reward functions and their weights.
        prompts: per episode, its prompt's messages (with the text ``reset`` joined to them).
        completions: per episode, the messages after the prompt (model turns, tool and environment messages).
        completion_ids: per episode, the response token ids.
        rows: per episode, its row; every key but ``prompt`` reaches the functions as a list over episodes.
        environments: the episodes' environment instances (``environments=``), or None without any.
        environment_rewards: per episode, its environment's reward (NaN: not scored), or None when its
            environment gives none; the source is named after the environment's class, as in TRL.

    Returns ``(rewards, sources)``: a reward per episode - None when nothing could score it (no
    function and no environment reward), NaN when every source left it unscored - and per episode
    ``{source name: value}`` (NaN where not scored).
    """
    count = len(prompts)
    kwargs = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
    kwargs = {key: value for key, value in kwargs.items() if key not in _NOT_FIELDS}
    if environments is not None:
        kwargs["environments"] = environments
    columns, names = [], []
    for func in funcs:
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        values = run_coroutines([func(**call)])[0] if inspect.iscoroutinefunction(func) else func(**call)
        if isinstance(values, BaseException):
            raise values
        columns.append(_scores(values, count, source_name(func)))
        names.append(source_name(func))
    with_environment = [i for i, reward in enumerate(environment_rewards) if reward is not None]
    if not funcs and not with_environment:
        return [None] * count, [{} for _ in range(count)]
    table = torch.tensor(columns, dtype=torch.float64).reshape(len(funcs), count).T  # (episodes, functions)
    rewards = (table * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    scored = ~table.isnan().all(dim=1)
    sources = [dict(zip(names, row)) for row in table.tolist()]
    for i in range(count):
        reward = environment_rewards[i]
        if reward is not None:
            sources[i][type(environments[i]).__name__] = reward
            if not math.isnan(reward):
                rewards[i] += reward
                scored[i] = True
    result = [float(r) if s else math.nan for r, s in zip(rewards.tolist(), scored.tolist())]
    unscored = [i for i, s in enumerate(scored.tolist()) if not s]
    if unscored:
        logger.warning(
            "%d of %d episodes were scored by no reward source (every function and get_reward() gave None or NaN), "
            "episode %d first; their reward is NaN.", len(unscored), count, unscored[0],
        )  # fmt: skip
    return result, sources


def _scores(values, count: int, name: str) -> list[float]:
    """A reward function's output as ``count`` floats, None as NaN."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ValueError(
            f"reward function {name} must return a list of {count} rewards (one per episode, None for one it does "
            f"not score), got {values!r:.100}."
        )
    scores = []
    for j, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isinf(value)):
            raise TypeError(
                f"reward function {name} gave episode {j} {value!r}; a reward is a finite number or None/NaN."
            )
        scores.append(math.nan if value is None else float(value))
    return scores


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
