"""The two environment protocols of :func:`~trl_lite.agents.run_episodes`, and the prompts they start from.

- TRL's ``environment_factory`` protocol (environments written for TRL run unchanged): one instance
  per episode; ``reset(**fields) -> str | None`` (text appended to the last user message); every
  public method other than ``reset`` and ``get_reward`` is a tool the model calls; an optional
  ``get_reward() -> float`` gives the episode's reward.
- A step environment, for games without tools (as OpenRLHF's agents): ``reset(**fields) -> str | None``
  as above; ``step(text) -> (observation, reward, done)`` takes each model turn's text and answers
  with the next user message, a reward (the episode's reward is their sum) and whether the episode ended.

An instance with a ``step`` method is a step environment. An environment that raises fails the
whole call with an error naming the episode and its prompt.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable

STEP, TOOLS = "step", "tools"


def read_prompt(index: int, prompt) -> tuple[list[dict], dict]:
    """``(messages, fields)`` of ``prompts[index]``: a list of chat messages, or a dict whose ``"prompt"``
    holds them and whose other keys are the environment's ``reset`` keyword arguments."""
    fields = {}
    if isinstance(prompt, dict):
        if "prompt" not in prompt:
            raise ValueError(
                f"prompts[{index}] is a dict without a 'prompt' key (keys {sorted(prompt)}); a dict prompt holds its "
                "messages under 'prompt' and the environment's reset() arguments under its other keys."
            )
        fields = {key: value for key, value in prompt.items() if key != "prompt"}
        prompt = prompt["prompt"]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise TypeError(
            f"prompts[{index}] must be a non-empty list of chat messages ({{'role': ..., 'content': ...}}) or a dict "
            f"with one under 'prompt', got {type(prompt).__name__}."
        )
    for j, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise TypeError(
                f"prompts[{index}][{j}] must be a chat message {{'role': str, 'content': str}}, got {message!r:.100}."
            )
    return copy.deepcopy(list(prompt)), fields


def prompt_label(index: int, messages: list[dict]) -> str:
    """``prompts[i] ('<last user message>')``, for errors."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    text = users[-1] if users else messages[-1]["content"]
    return f"prompts[{index}] ({text[:80] + ('...' if len(text) > 80 else '')!r})"


def environment_kind(environment, what: str) -> str:
    """``STEP`` or ``TOOLS`` for an environment instance; TypeError when it has no ``reset``."""
    if not callable(getattr(environment, "reset", None)):
        raise TypeError(
            f"{what} ({type(environment).__name__}) has no reset() method; an environment needs reset(**fields) and "
            "either tool methods (TRL's protocol) or step(text) -> (observation, reward, done)."
        )
    return STEP if callable(getattr(environment, "step", None)) else TOOLS


def call_environment(label: str, what: str, function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)``; anything it raises fails the run with ``label`` (episode and prompt)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        raise RuntimeError(f"{label}: the environment's {what} raised {type(error).__name__}: {error}") from error


def reset_environment(environment, label: str, messages: list[dict], fields: dict) -> None:
    """Call ``reset(**fields)`` and append the text it returns to the last user message (in place)."""
    text = call_environment(label, "reset()", environment.reset, **fields)
    if text is None:
        return
    if not isinstance(text, str):
        raise TypeError(f"{label}: the environment's reset() must return a str or None, got {type(text).__name__}.")
    users = [m for m in messages if m["role"] == "user"]
    if users:
        users[-1]["content"] += text
    else:
        messages.append({"role": "user", "content": text})


def environment_step(environment, label: str, text: str) -> tuple[str | None, float, bool]:
    """``step(text)``, its answer checked: ``(observation, reward, done)``."""
    answer = call_environment(label, "step()", environment.step, text)
    if not isinstance(answer, tuple) or len(answer) != 3:
        raise TypeError(f"{label}: the environment's step() must return (observation, reward, done), got {answer!r:.100}.")
    observation, reward, done = answer
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"{label}: step()'s observation must be a str or None, got {type(observation).__name__}.")
    if not _is_real(reward):
        raise TypeError(f"{label}: step()'s reward must be a finite number, got {reward!r}.")
    if not done and not observation:
        raise ValueError(f"{label}: step() returned done=False without an observation for the model's next turn.")
    return observation, float(reward), bool(done)


def environment_reward(environment, label: str) -> float | None:
    """``get_reward()`` as a float, or None when the environment has none."""
    if not callable(getattr(environment, "get_reward", None)):
        return None
    reward = call_environment(label, "get_reward()", environment.get_reward)
    if not _is_real(reward):
        raise TypeError(f"{label}: the environment's get_reward() must return a finite number, got {reward!r}.")
    return float(reward)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
