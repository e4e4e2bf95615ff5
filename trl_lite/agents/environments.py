"""The two environment protocols of :func:`~trl_lite.agents.run_episodes`, the rows they start from, and
which environment a row gets.

- TRL's ``environment_factory`` protocol (environments written for TRL run unchanged): one instance
  per episode; ``reset(**row)`` gets the whole row, ``prompt`` included, and may return text (or a
  list of content blocks) that joins the last message; every public bound method other than
  ``reset`` and ``get_reward`` is a tool the model calls; an optional ``get_reward()`` gives the
  episode's reward, None or NaN meaning "not scored". ``environment_factory`` may be a dict of such
  factories, each row naming its own under its ``environment`` key.
- A step environment, for games without tools (as OpenRLHF's agents): ``reset(**fields)`` gets the
  row's fields other than ``prompt`` (and ``environment``) and may return text as above;
  ``step(text) -> (observation, reward, done)`` takes each model turn's text and answers with the
  next user message, a reward (the episode's reward is their sum) and whether the episode ended.

An instance with a ``step`` method is a step environment. An environment that raises fails the
whole call with an error naming the episode and its prompt. ``get_reward`` and tools may be
``async def``; they are awaited (:func:`.tools.run_coroutines`).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections.abc import Callable

from .tools import run_coroutines

STEP, TOOLS = "step", "tools"
# The dataset key that picks an environment from a dict environment_factory (TRL's name for it).
ENVIRONMENT_KEY = "environment"
# The prompt of a row without one, when the environment's reset() writes the task (as TRL defaults it).
EMPTY_PROMPT = ({"role": "user", "content": ""},)


def read_prompt(index: int, prompt, has_environment: bool) -> tuple[list[dict], dict]:
    """``(messages, row)`` of ``prompts[index]``: a list of chat messages (the row ``{"prompt": messages}``),
    or a dict row whose ``"prompt"`` holds them; with an environment the row may leave ``prompt`` out
    (its ``reset`` then writes the task into an empty user message)."""
    if isinstance(prompt, dict):
        row = dict(prompt)
        if "prompt" not in row and not has_environment:
            raise ValueError(
                f"prompts[{index}] is a dict without a 'prompt' key (keys {sorted(row)}); a dict prompt holds its "
                "messages under 'prompt' and the environment's reset() arguments under its other keys (only with "
                "an environment_factory may 'prompt' be left out)."
            )
        messages = row.get("prompt", list(EMPTY_PROMPT))
    else:
        messages, row = prompt, {"prompt": prompt}
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(
            f"prompts[{index}] must be a non-empty list of chat messages ({{'role': ..., 'content': ...}}) or a dict "
            f"with one under 'prompt', got {type(messages).__name__}."
        )
    for j, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), (str, list))
        ):
            raise TypeError(
                f"prompts[{index}][{j}] must be a chat message {{'role': str, 'content': str or a list of content "
                f"blocks}}, got {message!r:.100}."
            )
    return copy.deepcopy(list(messages)), row


def prompt_label(index: int, messages: list[dict]) -> str:
    """``prompts[i] ('<last user message>')``, for errors."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    text = _text(users[-1] if users else messages[-1]["content"])
    return f"prompts[{index}] ({text[:80] + ('...' if len(text) > 80 else '')!r})"


def _text(content) -> str:
    """A message content's text: the string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if isinstance(block, dict))


def environment_factories(environment_factory) -> dict | None:
    """``environment_factory`` as ``{name: factory}`` (name None for a single factory), checked; None without one."""
    if environment_factory is None:
        return None
    if isinstance(environment_factory, dict):
        if not environment_factory:
            raise ValueError("environment_factory is an empty dict; give at least one {name: factory}.")
        for name, factory in environment_factory.items():
            if not callable(factory):
                raise TypeError(
                    f"environment_factory[{name!r}] must be callable (a class or a function), got {factory!r:.80}."
                )
        return dict(environment_factory)
    if not callable(environment_factory):
        raise TypeError(
            "environment_factory must be callable (a class or a function) or a dict of them keyed by the rows' "
            f"'{ENVIRONMENT_KEY}' values, got {environment_factory!r:.80}."
        )
    return {None: environment_factory}


def row_environment(index: int, row: dict, factories: dict) -> object:
    """The name of the environment ``prompts[index]`` plays in: None for a single factory, else its row's
    ``environment`` value, which must be a key of the dict ``environment_factory``."""
    if None in factories and len(factories) == 1:
        return None
    name = row.get(ENVIRONMENT_KEY)
    if ENVIRONMENT_KEY not in row or name not in factories:
        given = f"{ENVIRONMENT_KEY}={name!r}" if ENVIRONMENT_KEY in row else f"no '{ENVIRONMENT_KEY}' key"
        raise ValueError(
            f"prompts[{index}] has {given}, which names none of the environments of the dict environment_factory; "
            f"each row must name one of {list(factories)} under '{ENVIRONMENT_KEY}'."
        )
    return name


def reset_arguments(row: dict, kind: str, routed: bool) -> dict:
    """``reset``'s keyword arguments: TRL's protocol gets the whole row (without the routing
    ``environment`` key of a dict factory); a step environment the row's fields other than ``prompt``."""
    drop = ({ENVIRONMENT_KEY} if routed else set()) | ({"prompt"} if kind == STEP else set())
    return {key: value for key, value in row.items() if key not in drop}


def environment_kind(environment, what: str) -> str:
    """``STEP`` or ``TOOLS`` for an environment instance; TypeError when it has no ``reset``."""
    if not callable(getattr(environment, "reset", None)):
        raise TypeError(
            f"{what} ({type(environment).__name__}) has no reset() method; an environment needs reset(**fields) and "
            "either tool methods (TRL's protocol) or step(text) -> (observation, reward, done)."
        )
    return STEP if callable(getattr(environment, "step", None)) else TOOLS


def call_environment(label: str, what: str, function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)``, awaited when it is a coroutine function; anything it raises fails
    the run with ``label`` (episode and prompt)."""
    try:
        if inspect.iscoroutinefunction(function):
            (result,) = run_coroutines([function(*args, **kwargs)])
            if isinstance(result, BaseException):
                raise result
            return result
        return function(*args, **kwargs)
    except Exception as error:
        raise RuntimeError(f"{label}: the environment's {what} raised {type(error).__name__}: {error}") from error


def reset_environment(environment, label: str, messages: list[dict], arguments: dict) -> None:
    """Call ``reset(**arguments)`` and join what it returns - text or a list of content blocks - to the
    content of the last message, whatever its role (in place), as TRL does."""
    observation = call_environment(label, "reset()", environment.reset, **arguments)
    if observation is None:
        return
    if not isinstance(observation, (str, list)):
        raise TypeError(
            f"{label}: the environment's reset() must return a str, a list of content blocks or None, "
            f"got {type(observation).__name__}."
        )
    content = messages[-1]["content"]
    # Text and content blocks mix as blocks: a plain string becomes one text block.
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    messages[-1] = {**messages[-1], "content": content + observation}


def environment_step(environment, label: str, text: str) -> tuple[str | None, float, bool]:
    """``step(text)``, its answer checked: ``(observation, reward, done)``."""
    answer = call_environment(label, "step()", environment.step, text)
    if not isinstance(answer, tuple) or len(answer) != 3:
        raise TypeError(f"{label}: the environment's step() must return (observation, reward, done), got {answer!r:.100}.")
    observation, reward, done = answer
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"{label}: step()'s observation must be a str or None, got {type(observation).__name__}.")
    if not _is_real(reward) or not math.isfinite(reward):
        raise TypeError(f"{label}: step()'s reward must be a finite number, got {reward!r}.")
    if not done and not observation:
        raise ValueError(f"{label}: step() returned done=False without an observation for the model's next turn.")
    return observation, float(reward), bool(done)


def environment_reward(environment, label: str) -> float | None:
    """``get_reward()`` as a float - NaN when it returned None or NaN ("not scored", as in TRL) - or
    None when the environment has no ``get_reward``."""
    if not callable(getattr(environment, "get_reward", None)):
        return None
    reward = call_environment(label, "get_reward()", environment.get_reward)
    if reward is None:
        return math.nan
    if not _is_real(reward) or math.isinf(reward):
        raise TypeError(
            f"{label}: the environment's get_reward() must return a finite number, or None/NaN for an episode it "
            f"does not score, got {reward!r}."
        )
    return float(reward)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
