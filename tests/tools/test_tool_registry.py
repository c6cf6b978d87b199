"""Tests of verl/tools/tool_registry.py: a tool-config YAML written to disk and loaded back into BaseTool
instances, load_all_tools with a function-tool file, and the errors that name the bad entry and value."""

import asyncio

import pytest

from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import ToolResponse
from verl.tools.tool_registry import ToolType, get_tool_class, initialize_tools_from_config, load_all_tools

TOOL_MODULE = '''
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class Lookup(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        table = self.config["table"]
        return ToolResponse(text=str(table.get(parameters["key"], "?"))), 0.0, {"hit": parameters["key"] in table}


class Clock(BaseTool):
    """Brings its own schema."""

    def get_openai_tool_schema(self):
        return OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": {"name": "clock", "description": "The time."}})
'''

TOOLS_YAML = """
tools:
  - class_name: tool_stubs.Lookup
    config:
      type: native
      table: {a: 1, b: 2}
      owner: ${oc.env:TOOL_OWNER}
    tool_schema:
      type: function
      function:
        name: lookup
        description: Look a key up.
        parameters:
          type: object
          properties:
            key: {type: string, description: the key}
          required: [key]
  - class_name: tool_stubs.Clock
    config: {type: native}
"""


@pytest.fixture
def tools_yaml(tmp_path, module_dir, monkeypatch):
    module_dir("tool_stubs", TOOL_MODULE)
    monkeypatch.setenv("TOOL_OWNER", "alice")
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML)
    return str(path)


def test_a_yaml_config_loads_back_into_tools(tools_yaml):
    lookup, clock = initialize_tools_from_config(tools_yaml)
    assert type(lookup).__name__ == "Lookup" and type(clock).__name__ == "Clock"
    assert lookup.config == {"type": "native", "table": {"a": 1, "b": 2}, "owner": "alice"}  # resolved, plain
    assert type(lookup.config) is dict
    assert lookup.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key"}},
                           "required": ["key"]},
        },
    }  # fmt: skip
    assert clock.name == "clock"

    async def call():
        instance_id, _ = await lookup.create()
        try:
            return await lookup.execute(instance_id, {"key": "b"})
        finally:
            await lookup.release(instance_id)

    assert asyncio.run(call()) == (ToolResponse(text="2"), 0.0, {"hit": True})
    assert initialize_tools_from_config(tools_yaml)[0] is not lookup  # built anew on every load


def test_load_all_tools_merges_both_kinds(tools_yaml, tmp_path):
    functions = tmp_path / "functions.py"
    functions.write_text(
        "from verl.tools.function_tool import function_tool\n\n"
        "@function_tool\ndef double(x: int) -> int:\n"
        '    """Double a number.\n\n    Args:\n        x: the number.\n    """\n    return 2 * x\n'
    )
    tools = load_all_tools(tool_config_path=tools_yaml, function_tool_path=str(functions))
    assert [t.name for t in tools] == ["lookup", "clock", "double"]
    assert isinstance(tools[2], FunctionTool)
    assert load_all_tools(None, None) == []
    assert [t.name for t in load_all_tools(None, str(functions))] == ["double"]


def test_a_function_tool_may_not_reuse_a_configured_name(tools_yaml, tmp_path):
    functions = tmp_path / "clash.py"
    functions.write_text(
        "from verl.tools.function_tool import function_tool\n\n"
        "@function_tool\ndef clock() -> str:\n"
        '    """Another clock."""\n    return "noon"\n'
    )
    with pytest.raises(ValueError, match=r"function tool name\(s\) \['clock'\] from '.*clash.py' collide with tools "):
        load_all_tools(tools_yaml, str(functions))


@pytest.mark.parametrize(
    "yaml_text, error, message",
    [
        ("other: 1\n", ValueError, r"needs a `tools:` list at its top level, got None"),
        ("tools: {a: 1}\n", ValueError, r"needs a `tools:` list at its top level"),
        ("tools:\n  - config: {type: native}\n", ValueError, r"tools\[0\]: each entry needs a `class_name`"),
        ("tools:\n  - class_name: tool_stubs.Clock\n", ValueError,
         r"tools\[0\] \(tool_stubs.Clock\): `config.type` is missing; set it to one of \['native'\]"),
        ("tools:\n  - class_name: tool_stubs.Clock\n    config: {type: mcp}\n", ValueError,
         r"tools\[0\] \(tool_stubs.Clock\): config.type='mcp' is not supported; known: \['native'\]"),
        ("tools:\n  - class_name: Clock\n    config: {type: native}\n", ValueError,
         r"tool class_name 'Clock' must be a dotted path"),
        ("tools:\n  - class_name: no_such_pkg.Tool\n    config: {type: native}\n", ImportError,
         r"tool class_name 'no_such_pkg.Tool': cannot import module 'no_such_pkg'"),
        ("tools:\n  - class_name: tool_stubs.Nope\n    config: {type: native}\n", ImportError,
         r"module 'tool_stubs' has no attribute 'Nope'"),
        ("tools:\n  - class_name: tool_stubs.Lookup\n    config: {type: native}\n"
         "    tool_schema: {type: function, function: {name: lookup}}\n", ValueError,
         r"(?s)tools\[0\] \(tool_stubs.Lookup\): tool_schema is not an OpenAI function-tool schema: .*description"),
    ],
)  # fmt: skip
def test_config_errors_name_the_entry_and_the_value(tmp_path, module_dir, yaml_text, error, message):
    module_dir("tool_stubs", TOOL_MODULE)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(error, match=message):
        initialize_tools_from_config(str(path))


def test_tool_types_and_classes():
    assert ToolType("native") is ToolType.NATIVE
    assert get_tool_class("verl.tools.base_tool.BaseTool").__name__ == "BaseTool"
