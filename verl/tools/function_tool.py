"""Function tools: a plain (or async) Python function offered to the model as a stateless tool, verl's way.

    from verl.tools.function_tool import function_tool

    @function_tool                      # or @function_tool("name"), @function_tool(schema={...})
    def get_weather(city: str, unit: str | None = None) -> dict:
        '''Get the current weather of a city.

        Args:
            city: the city to look up.
            unit: "C" or "F".
        '''

The decorator registers a `FunctionTool` (name, fn, tool_schema, is_async) in `FUNCTION_TOOL_REGISTRY` and
returns the function unchanged. The schema's parameter types come from the annotations through
`verl.envs.tools`' schema builder (the one the `@tool` registry of the `multi_turn_tool` workflow uses), its
description from the docstring's summary and each parameter's description from the Google-style `Args:` block;
a function without a docstring, a type hint or an argument's description, or with *args/**kwargs, is refused
at registration with a message naming the function and the parameter. `schema=` skips all of that.

`load_function_tools_from_path(path)` executes a .py file once per process (the `function_tool_path` of
verl's rollout config) and returns the tools it registered. `FunctionTool.call(parameters)` runs the function
(sync functions in a worker thread); `normalize_function_tool_return` turns what it returned into verl's
`(ToolResponse, reward, metrics)`. A `FunctionTool` is not a `BaseTool` (verl dispatches on that);
`as_base_tool` wraps one in the `BaseTool` lifecycle for code that drives every tool the same way.

Layer 1 (utilities): the standard library, pydantic (through `verl.tools.schemas`), `verl.tools.base_tool`
and `verl.envs.tools`.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl.envs.tools import Tool, ToolRegistry, import_tool_modules
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "FUNCTION_TOOL_REGISTRY",
    "FunctionTool",
    "FunctionToolAsBaseTool",
    "as_base_tool",
    "function_tool",
    "get_function_tool",
    "load_function_tools_from_path",
    "normalize_function_tool_return",
]

logger = logging.getLogger(__name__)


@dataclass
class FunctionTool:
    """A registered function: `name` (the tool's name, as in `tool_schema.function.name`), the callable, the
    schema offered to the model, and whether the callable is a coroutine function."""

    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, parameters: dict[str, Any]) -> Any:
        """The function's return value for the model's decoded arguments (a sync function runs in a thread,
        so that it does not block the event loop)."""
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)

    @classmethod
    def from_registry_tool(cls, tool: Tool) -> FunctionTool:
        """The `FunctionTool` of a `verl.envs.tools` `@tool` entry (same function, same schema)."""
        schema = OpenAIFunctionToolSchema.model_validate(tool.schema())
        return cls(name=tool.name, fn=tool.fn, tool_schema=schema, is_async=inspect.iscoroutinefunction(tool.fn))


# name -> FunctionTool, filled by @function_tool (tests clear it)
FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}
# absolute path -> the tools that file registered (a file is executed once per process)
_LOADED_FUNCTION_TOOL_PATHS: dict[str, list[FunctionTool]] = {}


def _origin(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def function_tool(name: str | Callable | None = None, *, schema: OpenAIFunctionToolSchema | dict | None = None):
    """Register a function as a tool: `@function_tool`, `@function_tool()`, `@function_tool("name")` or
    `@function_tool("name", schema=...)` (an `OpenAIFunctionToolSchema` or a dict of that shape, used as is).
    ValueError when another function already holds the name."""
    if callable(name):  # bare @function_tool: `name` is the function
        return _decorator(None, schema)(name)
    return _decorator(name, schema)


def _decorator(name: str | None, schema: OpenAIFunctionToolSchema | dict | None) -> Callable:
    def register(fn: Callable) -> Callable:
        tool_name = name or fn.__name__
        existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"function tool {tool_name!r} is already registered (by {_origin(existing.fn)}); "
                             f"refusing to replace it with {_origin(fn)}: rename one of them")  # fmt: skip
        if isinstance(schema, OpenAIFunctionToolSchema):
            tool_schema = schema
        elif isinstance(schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(schema)
        elif schema is None:
            tool_schema = _schema_of_function(fn, tool_name)
        else:
            raise TypeError(f"@function_tool {tool_name!r}: schema must be an OpenAIFunctionToolSchema or a dict, "
                            f"got {type(schema).__name__}")  # fmt: skip
        FUNCTION_TOOL_REGISTRY[tool_name] = FunctionTool(tool_name, fn, tool_schema, inspect.iscoroutinefunction(fn))
        logger.info("registered function tool %r (%s)", tool_name, _origin(fn))
        return fn

    return register


def get_function_tool(name: str) -> FunctionTool:
    """The registered tool `name`; KeyError naming the registered ones."""
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(f"no function tool {name!r} is registered (registered: {sorted(FUNCTION_TOOL_REGISTRY)}); "
                       f"is the file defining it given as the rollout's multi_turn.function_tool_path?")  # fmt: skip
    return FUNCTION_TOOL_REGISTRY[name]


# ------------------------------------------------------------------------------------------- the schema
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG = re.compile(r"^(\s*)(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")  # "name: text" or "name (type): text"


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary: the text before the first section, {argument: description} from the `Args:` block); an
    argument's description runs on over the lines indented deeper than its own."""
    summary: list[str] = []
    args: dict[str, str] = {}
    section, current, arg_indent = None, None, None
    for line in doc.splitlines():
        header = _SECTION.match(line)
        if header:
            section, current, arg_indent = header.group(1), None, None
            continue
        if section is None:
            summary.append(line)
        elif section in ("Args", "Arguments") and line.strip():
            indent = len(line) - len(line.lstrip())
            match = _ARG.match(line)
            if match and (arg_indent is None or indent <= arg_indent):
                current, arg_indent = match.group(2), indent
                args[current] = match.group(3).strip()
            elif current is not None:
                args[current] = f"{args[current]} {line.strip()}".strip()
    return "\n".join(summary).strip(), args


def _schema_of_function(fn: Callable, tool_name: str) -> OpenAIFunctionToolSchema:
    """The schema of a typed, documented function (see the module docstring for what is refused)."""
    where = f"@function_tool {tool_name!r} ({_origin(fn)})"
    params = inspect.signature(fn).parameters.values()
    variadic = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"{where} declares variadic parameter(s) {variadic}, which an OpenAI tool schema cannot "
                         f"describe: list the parameters by name (a list of values is `name: list`)")  # fmt: skip
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ValueError(f"{where} has no docstring: write a summary line and an `Args:` block describing every "
                         f"parameter (the model reads them)")  # fmt: skip
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise TypeError(f"{where}: parameter {p.name!r} is missing a type hint")
    summary, arg_docs = _parse_docstring(doc)
    for p in params:
        if not arg_docs.get(p.name):
            raise ValueError(f"{where}: the docstring has no description for the argument {p.name!r}; "
                             f"add `{p.name}: ...` to its `Args:` block")  # fmt: skip
    # the JSON types come from the annotations through verl.envs.tools' builder (the @tool registry's)
    scratch = ToolRegistry()
    scratch.register(fn, name=tool_name)
    parameters = copy.deepcopy(scratch.get(tool_name).parameters)
    for param_name, prop in parameters["properties"].items():
        prop["description"] = arg_docs[param_name]
    return OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": tool_name, "description": summary, "parameters": parameters}}
    )


# ------------------------------------------------------------------------------------------- loading
def _defined_in(fn: Callable, path: str) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and os.path.realpath(code.co_filename) == os.path.realpath(path)


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Execute the .py file `path` (relative to the working directory) and return the function tools it
    registered, sorted by name. A second call for the same file returns the first call's list without
    executing the file again. FileNotFoundError when there is no such file; a warning when it registers none."""
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"function_tool_path does not exist: {path!r} (looked for {abs_path})")
    if abs_path in _LOADED_FUNCTION_TOOL_PATHS:
        return _LOADED_FUNCTION_TOOL_PATHS[abs_path]
    before = set(FUNCTION_TOOL_REGISTRY)
    import_tool_modules([abs_path])  # verl.envs.tools' file loader (a no-op when that file is loaded already)
    # what this file added, and what it defined if it was loaded before (e.g. also listed in tool_modules)
    tools = [tool for name, tool in sorted(FUNCTION_TOOL_REGISTRY.items())
             if name not in before or _defined_in(tool.fn, abs_path)]  # fmt: skip
    if tools:
        logger.info("function_tool_path %s: %s", path, [t.name for t in tools])
    else:
        logger.warning("function_tool_path %r was loaded but no @function_tool decorators found in it; "
                       "decorate the functions to offer with @verl.tools.function_tool.function_tool", path)  # fmt: skip
    _LOADED_FUNCTION_TOOL_PATHS[abs_path] = tools
    return tools


# ------------------------------------------------------------------------------------------- results
def _as_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """(response, reward, metrics) of what a function tool returned:

    a `ToolResponse` as is; a str as its text; a dict as its JSON text; a tuple `(response,)`,
    `(response, reward)` or `(response, reward, metrics)` (a None reward is 0.0, None metrics are {}, and a
    reward of 0 or False stays 0.0); anything else as `str(ret)`. Reward 0.0 and metrics {} unless given.
    A tuple of another length is a TypeError (it is almost surely a mistake, not a value for the model)."""
    if not isinstance(ret, tuple):
        return _as_response(ret), 0.0, {}
    if not 1 <= len(ret) <= 3:
        raise TypeError(f"a function tool returned a tuple of length {len(ret)} ({ret!r}); it must have length "
                        f"1, 2, or 3: (response,), (response, reward) or (response, reward, metrics)")  # fmt: skip
    reward = ret[1] if len(ret) > 1 else None
    metrics = ret[2] if len(ret) > 2 else None
    return _as_response(ret[0]), 0.0 if reward is None else float(reward), {} if metrics is None else dict(metrics)


# ------------------------------------------------------------------------------------------- one code path
class FunctionToolAsBaseTool(BaseTool):
    """A `FunctionTool` behind the `BaseTool` lifecycle: `create`/`calc_reward`/`release` are the stateless
    defaults, `execute` calls the function and normalizes its return. Exceptions propagate, as from any
    `BaseTool.execute`: the caller decides what the model reads."""

    def __init__(self, function_tool: FunctionTool, config: dict | None = None):
        self.function_tool = function_tool
        super().__init__(config or {}, function_tool.tool_schema)
        self.name = function_tool.name  # the registered name (a `schema=` override may spell another)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return normalize_function_tool_return(await self.function_tool.call(parameters))


def as_base_tool(tool: BaseTool | FunctionTool) -> BaseTool:
    """`tool` itself when it is a `BaseTool`; a `FunctionTool` wrapped in `FunctionToolAsBaseTool`."""
    if isinstance(tool, BaseTool):
        return tool
    if isinstance(tool, FunctionTool):
        return FunctionToolAsBaseTool(tool)
    raise TypeError(f"as_base_tool: expected a BaseTool or a FunctionTool, got {type(tool).__name__}: {tool!r}")
