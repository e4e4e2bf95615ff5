"""What the episodes of one ``run_episodes`` call share per environment: its kind, its tools' schemas and
the chat format that shows them to the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .chat import ChatFormat
from .environments import STEP, TOOLS, environment_kind
from .tools import environment_tools, tool_schema


@dataclass
class Setup:
    """What the episodes of one environment (or of none) share: its kind, the tools' schemas (plain
    tools and the environment's methods) and the chat format that shows them to the model."""

    kind: str | None
    schemas: dict[str, dict]
    chat: ChatFormat


def function_tools(tools) -> tuple[dict[str, Callable], dict[str, dict]]:
    """The plain tools by name and their schemas, checked."""
    if tools is None:
        return {}, {}
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}.")
    functions, schemas = {}, {}
    for i, function in enumerate(tools):
        if not callable(function):
            raise TypeError(f"tools[{i}] must be a function, got {type(function).__name__}.")
        schema = tool_schema(function, f"tools[{i}] ({getattr(function, '__name__', type(function).__name__)})")
        name = schema["function"]["name"]
        if name in functions:
            raise ValueError(f"tools[{i}] is named {name!r} like an earlier tool; tool names must be unique.")
        functions[name], schemas[name] = function, schema
    return functions, schemas


def environment_setups(names: list, k: int, environments: list, functions: dict, schemas: dict, chat_probe: ChatFormat,
            tokenizer) -> dict:  # fmt: skip
    """``{environment name: Setup}`` for the environments the rows name (None: a single factory, or none)."""
    setups = {}
    for name in dict.fromkeys(names):
        mine = [environments[i * k + g] for i, n in enumerate(names) if n == name for g in range(k)]
        what = "environment_factory()" if name is None else f"environment_factory[{name!r}]()"
        kind, own = None, dict(schemas)
        if mine[0] is not None:
            kinds = {environment_kind(env, f"{what} #{i}") for i, env in enumerate(mine)}
            if len(kinds) > 1:
                raise TypeError(f"{what} made step environments and TRL-style ones in one call; make one kind.")
            kind = kinds.pop()
        if kind == STEP and functions:
            raise ValueError("tools cannot be combined with a step environment (one with step(text)); give tools to a "
                             "TRL-style environment as methods, or pass them without environment_factory.")  # fmt: skip
        if kind == TOOLS:
            for method_name, method in environment_tools(mine[0]).items():
                if method_name in schemas:
                    raise ValueError(
                        f"the environment's method {method_name!r} has the name of one of tools; rename one of them."
                    )
                own[method_name] = tool_schema(method, f"{what}'s method {method_name!r}")
        chat = ChatFormat(tokenizer, list(own.values())) if own else chat_probe
        setups[name] = Setup(kind, own, chat)
    return setups
