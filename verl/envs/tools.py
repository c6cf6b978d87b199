"""Python tools for multi-turn rollouts: registration, JSON schemas, `<tool_call>` parsing, execution.

Owns `ToolRegistry` and `@tool` (into `DEFAULT_REGISTRY`): a plain or async typed function whose OpenAI schema
comes from its annotations (str, int, float, bool, list, dict, unions, `Literal`) and first docstring line.
Re-exports `parse_tool_calls` and `get_tool_call_format` from `verl.envs.tool_formats`. `run_tool_calls` turns a
turn's calls into observations; every failure becomes an `error: ...` text, never an exception.
Layer 1: standard library only.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Parsing lives in verl.envs.tool_formats (one implementation, shared with verl's ToolParser classes).
from verl.envs.tool_formats import (
    TOOL_CALL_FORMATS,
    TOOL_CALL_RE,  # noqa: F401 (a module-level name of this file before the move)
    ParsedToolCall,
    ToolCallFormat,
    get_tool_call_format,
    parse_tool_calls,
)

__all__ = [
    "DEFAULT_REGISTRY",
    "ParsedToolCall",
    "TOOL_CALL_FORMATS",
    "Tool",
    "ToolCallFormat",
    "ToolRegistry",
    "format_observations",
    "get_tool_call_format",
    "import_tool_modules",
    "parse_tool_calls",
    "run_tool_calls",
    "tool",
]

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                               dict: "object"}  # fmt: skip
_PY_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                          "boolean": (bool,), "array": (list,), "object": (dict,)}  # fmt: skip


@dataclass(frozen=True)
class Tool:
    """A registered function: `parameters` is its JSON schema ({"type": "object", "properties", "required"})."""

    name: str
    fn: Callable
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI `tools=[...]` entry of this tool."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}  # fmt: skip


def _json_type(annotation: Any, where: str) -> str:
    """The JSON type of a plain annotation (str, int, float, bool, list, dict, generic or not); TypeError else."""
    base = typing.get_origin(annotation) or annotation
    if base in _JSON_TYPES:
        return _JSON_TYPES[base]
    raise TypeError(
        f"{where}: annotation {annotation!r} is not one of str, int, float, bool, list, dict, a union of them "
        f"(`int | float`, `X | None`) or a Literal of str/int/float/bool values"
    )


def _property_schema(annotation: Any, where: str) -> dict:
    """The JSON schema of one parameter: {"type": ...}, a list of types for a union ("null" last for
    `| None`), and "enum" for `Literal[...]`; TypeError for anything unsupported."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        kinds = []
        for value in values:
            if type(value) not in (str, int, float, bool):
                raise TypeError(f"{where}: Literal value {value!r} is not a str, int, float or bool")
            if _JSON_TYPES[type(value)] not in kinds:
                kinds.append(_JSON_TYPES[type(value)])
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        kinds = []
        for arg in args:
            if arg is not type(None) and _json_type(arg, where) not in kinds:
                kinds.append(_json_type(arg, where))
        if type(None) in args:
            kinds.append("null")
        return {"type": kinds[0] if len(kinds) == 1 else kinds}
    return {"type": _json_type(annotation, where)}


def _schema(fn: Callable, name: str) -> dict:
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # an annotation naming something the function's module does not define
        raise TypeError(f"tool {name!r}: its type annotations cannot be resolved ({err})") from err
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool {name!r} parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{where}: *args/**kwargs cannot be described to the model; list the parameters")
        if param.name not in hints:
            raise TypeError(f"{where} has no type annotation; tools need a typed signature")
        properties[param.name] = _property_schema(hints[param.name], where)
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def _origin(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class ToolRegistry:
    """Named tools. `registry.register` (or the module-level `@tool`) is a decorator, with or without
    arguments: `@tool`, `@tool(name="weather", description="...")`."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def register(self, fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
        def decorator(func: Callable) -> Callable:
            tool_name = name or func.__name__
            old = self._tools.get(tool_name)
            if old is not None and _origin(old.fn) != _origin(func):  # re-importing the same module is fine
                raise ValueError(f"a tool named {tool_name!r} is already registered (by {_origin(old.fn)})")
            doc = (inspect.getdoc(func) or "").strip().splitlines()
            self._tools[tool_name] = Tool(tool_name, func, description or (doc[0] if doc else ""),
                                          _schema(func, tool_name))  # fmt: skip
            return func

        return decorator(fn) if fn is not None else decorator

    def names(self) -> list[str]:
        return sorted(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict]:
        return [self._tools[n].schema() for n in self.names()]

    def subset(self, names: list[str]) -> ToolRegistry:
        """A registry holding only `names` (ValueError naming the unknown ones)."""
        unknown = sorted(set(names) - set(self._tools))
        if unknown:
            raise ValueError(f"unknown tools {unknown} (rollout.multi_turn.tools); registered: {self.names()}")
        out = ToolRegistry()
        out._tools = {n: self._tools[n] for n in names}
        return out

    def check_arguments(self, tool_: Tool, arguments: dict) -> str | None:
        """An error text when `arguments` do not fit the tool's schema, else None."""
        props, required = tool_.parameters["properties"], tool_.parameters["required"]
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown arguments {unknown}; the parameters are {sorted(props)}"
        missing = [p for p in required if p not in arguments]
        if missing:
            return f"missing required arguments {missing}"
        for key, value in arguments.items():
            json_type = props[key]["type"]
            allowed = json_type if isinstance(json_type, list) else [json_type]
            if value is None and "null" in allowed:
                continue
            kinds = [kind for kind in allowed if kind != "null"]
            if not any(_is_json_type(value, kind) for kind in kinds):
                return f"argument {key!r} must be {' or '.join(kinds)}, got {json.dumps(value)}"
            if "enum" in props[key] and value not in props[key]["enum"]:
                return f"argument {key!r} must be one of {json.dumps(props[key]['enum'])}, got {json.dumps(value)}"
        return None


def _is_json_type(value: Any, kind: str) -> bool:
    """Whether a decoded JSON value is of JSON type `kind` (a bool is neither an integer nor a number)."""
    kinds = _PY_TYPES.get(kind, ())
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


DEFAULT_REGISTRY = ToolRegistry()


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
    """Register a typed Python function as a tool in `DEFAULT_REGISTRY` (usable with or without arguments)."""
    return DEFAULT_REGISTRY.register(fn, name=name, description=description)


def import_tool_modules(modules: list[str]) -> None:
    """Import modules ("pkg.module") or files ("path/tools.py") so that their `@tool` functions register."""
    for module in modules or []:
        if str(module).endswith(".py"):
            if not os.path.isfile(module):
                raise FileNotFoundError(f"rollout.multi_turn.tool_modules: {module!r} is not a file")
            name = "verl_tools_" + hashlib.sha1(os.path.abspath(module).encode()).hexdigest()[:12]
            if name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(name, module)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded
            spec.loader.exec_module(loaded)
        else:
            importlib.import_module(str(module))


# ----------------------------------------------------------------------------------------------- running
def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


async def run_tool_call(registry: ToolRegistry, call: ParsedToolCall, timeout_s: float | None = None) -> str:
    """The observation text of one parsed call (the result, or "error: ..."). Never raises for tool errors.

    Async tools are awaited with `timeout_s`; plain functions run inline on the event loop (keep them fast,
    or write them as `async def`).
    """
    if call.error is not None:
        return f"error: {call.error}"
    tool_ = registry.get(call.name)
    if tool_ is None:
        return f"error: unknown tool {call.name!r}; available tools: {registry.names()}"
    problem = registry.check_arguments(tool_, call.arguments)
    if problem:
        return f"error: tool {call.name!r}: {problem}"
    try:
        if inspect.iscoroutinefunction(tool_.fn):
            result = await asyncio.wait_for(tool_.fn(**call.arguments), timeout=timeout_s)
        else:
            result = tool_.fn(**call.arguments)
    except asyncio.TimeoutError:
        return f"error: tool {call.name!r} timed out after {timeout_s} s"
    except Exception as err:  # the tool's failure is an observation for the model, not a crash
        return f"error: tool {call.name!r} raised {type(err).__name__}: {err}"
    return _to_text(result)


async def run_tool_calls(
    registry: ToolRegistry, calls: list[ParsedToolCall], timeout_s: float | None = None
) -> list[str]:
    """Observations of `calls`, in order (each call runs after the previous one)."""
    return [await run_tool_call(registry, call, timeout_s) for call in calls]


def format_observations(observations: list[str], max_chars: int | None = None) -> str:
    """The text inserted after a tool-call turn: one `<obs> ... </obs>` line per call, each cut to `max_chars`."""
    lines = []
    for obs in observations:
        if max_chars is not None and len(obs) > max_chars:
            obs = obs[:max_chars] + "...(truncated)"
        lines.append(f"<obs> {obs} </obs>")
    return "\n" + "\n".join(lines) + "\n"
