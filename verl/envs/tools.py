"""Python tools for multi-turn rollouts: registration, JSON schemas, `<tool_call>` parsing, execution.

Owns `ToolRegistry` and the `@tool` decorator (registers into `DEFAULT_REGISTRY`): a tool is a plain or
async Python function with a typed signature; its JSON schema (OpenAI function format) comes from the
annotations (str, int, float, bool, list, dict, optionally `| None`) and the first docstring line.

`parse_tool_calls(text)` reads every `<tool_call> ... </tool_call>` block of a model turn: the block is one
JSON object, a JSON list of objects, or one object per line (the RLLA / ToolRL format); an object is
`{"name": ..., "arguments": {...}}` ("parameters" is accepted too, and OpenAI's JSON-string arguments).
That is verl's `hermes` format; `get_tool_call_format(rollout.multi_turn.format)` picks the parser by name.
`run_tool_calls` turns a turn into observations: results, and every failure (bad JSON, unknown tool, bad
arguments, an exception in the tool, a timeout) as an `error: ...` text. Nothing here raises on model
output: errors are what the model gets to read.

Layer 1 (utilities): standard library only; must not import torch, Ray or the engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
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


def _json_type(annotation: Any, where: str) -> tuple[str, bool]:
    """(JSON type, nullable) of a parameter annotation; TypeError for anything unsupported."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return _json_type(args[0], where)[0], True
        raise TypeError(f"{where}: union annotation {annotation!r}; only `X | None` is supported")
    base = origin or annotation
    if base in _JSON_TYPES:
        return _JSON_TYPES[base], False
    raise TypeError(f"{where}: annotation {annotation!r} is not one of str, int, float, bool, list, dict (or | None)")


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
        json_type, nullable = _json_type(hints[param.name], where)
        properties[param.name] = {"type": [json_type, "null"] if nullable else json_type}
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
            kinds = _PY_TYPES[allowed[0]]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                return f"argument {key!r} must be {allowed[0]}, got {json.dumps(value)}"
        return None


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


# ----------------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ParsedToolCall:
    """One call read from model text: name and arguments, or `error` (what the model will be told)."""

    name: str | None = None
    arguments: dict | None = None
    error: str | None = None


def _snippet(text: str, limit: int = 80) -> str:
    text = text.strip()
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")


def _call_from_object(obj: Any) -> ParsedToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedToolCall(
            error=f'a tool call must be {{"name": ..., "arguments": {{...}}}}, got {_snippet(json.dumps(obj))}'
        )
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return ParsedToolCall(
                name=obj["name"], error=f"arguments of {obj['name']!r} are not valid JSON ({err.msg})"
            )
    if not isinstance(arguments, dict):
        return ParsedToolCall(name=obj["name"], error=f"arguments of {obj['name']!r} must be a JSON object")
    return ParsedToolCall(name=obj["name"], arguments=arguments)


def _parse_block(block: str) -> list[ParsedToolCall]:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        lines = [line for line in block.strip().splitlines() if line.strip()]
        if len(lines) <= 1:
            return [_bad_json(block)]
        calls = []
        for line in lines:
            try:
                calls.append(_call_from_object(json.loads(line)))
            except json.JSONDecodeError:
                calls.append(_bad_json(line))
        return calls
    items = obj if isinstance(obj, list) else [obj]
    return [_call_from_object(item) for item in items] or [ParsedToolCall(error="empty tool call list")]


def _bad_json(text: str) -> ParsedToolCall:
    try:
        json.loads(text)
        reason = "unexpected format"
    except json.JSONDecodeError as err:
        reason = f"{err.msg} at column {err.colno}"
    return ParsedToolCall(error=f"the tool call is not valid JSON ({reason}): {_snippet(text)}")


def parse_tool_calls(text: str) -> list[ParsedToolCall]:
    """Every call in the `<tool_call>` blocks of `text`, in order (empty when there is no complete block)."""
    calls: list[ParsedToolCall] = []
    for block in TOOL_CALL_RE.findall(text):
        calls.extend(_parse_block(block))
    return calls


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls: the parser of a turn's text and the string that ends a call
    (a model turn stops there so the tools can run)."""

    parse: Callable[[str], list[ParsedToolCall]]
    stop: str


# `actor_rollout_ref.rollout.multi_turn.format` (verl's key, default hermes) -> format
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(parse=parse_tool_calls, stop="</tool_call>"),  # <tool_call>{json}</tool_call>
}


def get_tool_call_format(name: Any) -> ToolCallFormat:
    """The tool-call format named by `rollout.multi_turn.format` (None = hermes); ValueError listing the known."""
    name = "hermes" if name is None else str(name)
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"actor_rollout_ref.rollout.multi_turn.format={name!r} is not a known tool-call format; "
            f"known: {sorted(TOOL_CALL_FORMATS)}"
        )
    return TOOL_CALL_FORMATS[name]


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
