"""Tools of an episode: their JSON schemas (transformers' ``get_json_schema``), and calls checked against them.

A call that cannot run - an unknown tool, arguments that do not match the schema, a tool that
raises - gives the model an error text as the tool's message instead of a result; the episode
goes on, and the call counts in the episode's ``tool_errors``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable

from transformers.utils import get_json_schema

from .chat import ToolCall

# Methods of a TRL-style environment that are not tools.
ENVIRONMENT_METHODS = frozenset({"reset", "get_reward"})


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
    """The tools of a TRL-style environment: its public methods other than ``reset`` and ``get_reward``."""
    tools = {}
    for name, _ in inspect.getmembers(type(environment), callable):
        if not name.startswith("_") and name not in ENVIRONMENT_METHODS:
            tools[name] = getattr(environment, name)
    return tools


def run_tool_call(call: ToolCall, schemas: dict[str, dict], functions: dict[str, Callable]) -> tuple[str, bool]:
    """The tool message's text for ``call`` and whether the call failed.

    ``schemas``: name -> ``get_json_schema`` dict; ``functions``: name -> the callable of this episode.
    A result that is not a string is sent as JSON (or ``str`` when it is not JSON-serialisable).
    """
    if call.error is not None:
        return f"Error: {call.error}", True
    if call.name not in functions:
        return f"Error: unknown tool {call.name!r}; the tools are {sorted(functions)}.", True
    problem = _check_arguments(schemas[call.name]["function"].get("parameters", {}), call.arguments)
    if problem is not None:
        return f"Error: {call.name}: {problem}", True
    try:
        result = functions[call.name](**call.arguments)
    except Exception as error:  # the model's feedback, not the run's end
        return f"Error: {call.name} raised {type(error).__name__}: {error}", True
    if isinstance(result, str):
        return result, False
    try:
        return json.dumps(result), False
    except TypeError:
        return str(result), False


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
