"""Tools of an episode: their JSON schemas (transformers' ``get_json_schema``) and their calls, as TRL makes them.

A call's result reaches the model as ``str(result)``, or - a list of content blocks - as the tool
message's content itself. A call that fails - an unknown tool, a tool that raises (wrong arguments
included: Python's own ``TypeError``) - sends ``str({'error': '<message>'})`` instead; the episode
goes on, and the call counts in the episode's ``tool_errors``. ``async def`` tools are awaited, the
async calls of one turn together. With ``check_tool_arguments`` the arguments are first checked
against the tool's schema (a mismatch is a failed call whose message says why).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable

from transformers.utils import get_json_schema

from .chat import ToolCall

# Methods of a TRL-style environment that are not tools.
ENVIRONMENT_METHODS = frozenset({"reset", "get_reward"})
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def run_coroutines(coroutines: list) -> list:
    """Await ``coroutines`` together; their results in order, an exception as the result of the one that raised.

    They run on one event loop kept in a daemon thread for the process (as TRL does), so that async
    tools may hold loop-bound resources across turns and calls, and so that this works under a
    caller's own running loop (a notebook) too.
    """
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="trl_lite-agent-tools", daemon=True).start()

    async def gather():
        return await asyncio.gather(*coroutines, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _loop).result()


def tool_schema(function: Callable, what: str) -> dict:
    """``get_json_schema(function)``, its failure re-raised naming ``what`` (the argument it came from)."""
    try:
        return get_json_schema(function)
    except Exception as error:  # transformers raises its own TypeError/DocstringParsingException subclasses
        raise ValueError(
            f"{what} needs a JSON schema for the model's chat template, and transformers' get_json_schema refused it: "
            f"{error} (a tool needs type hints on every argument and a Google-style docstring with an Args: section)."
        ) from error


def environment_tools(environment) -> dict[str, Callable]:
    """The tools of a TRL-style environment: its public bound methods other than ``reset`` and ``get_reward``
    (a ``staticmethod`` is a plain function on the instance, so it is no tool, as in TRL)."""
    return {
        name: method
        for name, method in inspect.getmembers(environment, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in ENVIRONMENT_METHODS
    }


def error_content(message: str) -> str:
    """A failed call's tool message: TRL's ``str({'error': message})``."""
    return str({"error": message})


def run_tool_calls(calls: list[ToolCall], schemas: dict[str, dict], functions: dict[str, Callable],
                   check_arguments: bool) -> list[tuple[dict, bool]]:  # fmt: skip
    """The tool message of each call, in order, and whether the call failed.

    ``calls``: well-formed calls (a malformed one is the caller's); ``schemas``: name -> ``get_json_schema``
    dict; ``functions``: name -> the callable of this episode.
    """
    answers: list = [None] * len(calls)
    pending = []  # (position, coroutine) of the async calls, awaited together
    for i, call in enumerate(calls):
        if call.error is not None:
            answers[i] = (call.name or "unknown", error_content(call.error), True)
            continue
        if call.name not in functions:
            answers[i] = (call.name, error_content(f"Tool {call.name} not found."), True)
            continue
        if check_arguments:
            problem = _check_arguments(schemas[call.name]["function"].get("parameters", {}), call.arguments)
            if problem is not None:
                answers[i] = (call.name, error_content(f"{call.name}: {problem}"), True)
                continue
        function = functions[call.name]
        try:
            if inspect.iscoroutinefunction(function):
                pending.append((i, function(**call.arguments)))
            else:
                answers[i] = (call.name, _content(function(**call.arguments)), False)
        except Exception as error:  # the model's feedback, not the run's end
            answers[i] = (call.name, error_content(str(error)), True)
    if pending:
        results = run_coroutines([coroutine for _, coroutine in pending])
        for (i, _), result in zip(pending, results):
            failed = isinstance(result, Exception)
            answers[i] = (calls[i].name, error_content(str(result)) if failed else _content(result), failed)
    return [({"role": "tool", "name": name, "content": content}, failed) for name, content, failed in answers]


def _content(result):
    """A result as the tool message's content: a list of content blocks as it is, anything else ``str()``."""
    return result if isinstance(result, list) else str(result)


def _check_arguments(parameters: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit a schema's ``parameters`` object, or None when they do."""
    properties = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return f"unknown argument(s) {unknown}; the arguments are {sorted(properties)}."
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s) {missing}."
    for name, value in arguments.items():
        if not _matches(properties[name], value):
            return f"argument {name!r} must be {_describe(properties[name])}, got {json.dumps(value)}."
    return None


_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _matches(spec: dict, value) -> bool:
    """Whether ``value`` fits a ``get_json_schema`` property: its type(s), ``nullable``, ``enum`` and array ``items``."""
    if value is None and spec.get("nullable"):
        return True
    if "enum" in spec and value not in spec["enum"]:
        return False
    types = spec.get("type")
    if types is None:
        return True
    types = types if isinstance(types, list) else [types]
    for kind in types:
        if kind not in _TYPES:
            return True  # a type this check does not know: the tool decides
        if _TYPES[kind](value):
            if kind == "array" and "items" in spec:
                return all(_matches(spec["items"], item) for item in value)
            return True
    return False


def _describe(spec: dict) -> str:
    kinds = spec.get("type", "any value")
    text = " or ".join(kinds) if isinstance(kinds, list) else str(kinds)
    if "enum" in spec:
        text += f" in {spec['enum']}"
    return text + (" or null" if spec.get("nullable") else "")
