"""The tool-config YAML loader (verl's `rollout.multi_turn.tool_config_path`) and `load_all_tools`.

`initialize_tools_from_config(path)` builds one instance per `tools:` entry, `cls(config=..., tool_schema=...)`
(`class_name` imported by name; `config.type` must be `native`, as in verl 0.9.1; OmegaConf resolves `${...}`).
`load_all_tools` adds the function tools of `function_tool_path` and refuses a name given by both. Errors name the
entry (`tools[i]`), the file and the bad value. Layer 1: the standard library, omegaconf and `verl.tools`.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import ValidationError

from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool, load_function_tools_from_path
from verl.tools.schemas import OpenAIFunctionToolSchema

__all__ = ["ToolType", "get_tool_class", "initialize_tools_from_config", "load_all_tools"]


class ToolType(Enum):
    """How a configured tool runs (`config.type`); verl 0.9.1 has only in-process tools (MCP was removed)."""

    NATIVE = "native"


def get_tool_class(cls_name: str) -> type:
    """The class named "package.module.Class" (imported if needed); ValueError/ImportError naming it."""
    module_name, _, class_name = str(cls_name).rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"tool class_name {cls_name!r} must be a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(f"tool class_name {cls_name!r}: cannot import module {module_name!r} ({err})") from err
    if not hasattr(module, class_name):
        raise ImportError(f"tool class_name {cls_name!r}: module {module_name!r} has no attribute {class_name!r}")
    return getattr(module, class_name)


def _entry_schema(entry: DictConfig, where: str) -> OpenAIFunctionToolSchema | None:
    if entry.get("tool_schema", None) is None:
        return None
    raw = OmegaConf.to_container(entry.tool_schema, resolve=True)
    try:
        return OpenAIFunctionToolSchema.model_validate(raw)
    except ValidationError as err:
        raise ValueError(f"{where}: tool_schema is not an OpenAI function-tool schema: {err}") from err


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """One instance of every tool declared in the YAML file `tools_config_file`, in the file's order."""
    tools_config = OmegaConf.load(tools_config_file)
    entries = tools_config.get("tools", None) if isinstance(tools_config, DictConfig) else None
    if not isinstance(entries, ListConfig):
        raise ValueError(f"tool config {tools_config_file!r} needs a `tools:` list at its top level, got {entries!r}")
    tools: list[BaseTool] = []
    for index, entry in enumerate(entries):
        where = f"tool config {tools_config_file!r} tools[{index}]"
        if not isinstance(entry, DictConfig) or entry.get("class_name", None) is None:
            raise ValueError(f"{where}: each entry needs a `class_name` ('package.module.Class'), got {entry!r}")
        where += f" ({entry.class_name})"
        config = entry.get("config", None)
        if not isinstance(config, DictConfig) or config.get("type", None) is None:
            raise ValueError(f"{where}: `config.type` is missing; set it to one of {[t.value for t in ToolType]}")
        try:
            tool_type = ToolType(config.type)
        except ValueError:
            raise ValueError(f"{where}: config.type={config.type!r} is not supported; "
                             f"known: {[t.value for t in ToolType]}") from None  # fmt: skip
        if tool_type is not ToolType.NATIVE:  # the only type for now; a new one gets its branch here
            raise NotImplementedError(f"{where}: tool type {tool_type.value!r}")
        tool_cls = get_tool_class(entry.class_name)
        tool_schema = _entry_schema(entry, where)
        tools.append(tool_cls(config=OmegaConf.to_container(config, resolve=True), tool_schema=tool_schema))
    return tools


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None) -> list[BaseTool | FunctionTool]:
    """The configured tools (`BaseTool`s, built anew on each call) followed by the function tools of
    `function_tool_path` (loaded once per process); either path may be None ([] when both are).
    ValueError listing the function tools whose names a configured tool already uses."""
    native: list[Any] = initialize_tools_from_config(tool_config_path) if tool_config_path else []
    functions: list[FunctionTool] = load_function_tools_from_path(function_tool_path) if function_tool_path else []
    taken = {tool.name for tool in native}
    collisions = sorted(tool.name for tool in functions if tool.name in taken)
    if collisions:
        raise ValueError(
            f"function tool name(s) {collisions} from {function_tool_path!r} collide with tools declared in "
            f"{tool_config_path!r}: every tool name must be unique across tool_config_path and function_tool_path"
        )
    return native + functions
