"""Tests of verl/tools/function_tool.py: schemas of functions (written out by hand), the refusals and their
messages, loading a tool file, return values, and the bridges to verl.envs.tools and to BaseTool."""

import asyncio
import textwrap
import threading

import pytest

from verl.envs.tools import ToolRegistry, import_tool_modules
from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import (
    FUNCTION_TOOL_REGISTRY,
    FunctionTool,
    FunctionToolAsBaseTool,
    as_base_tool,
    function_tool,
    get_function_tool,
    load_function_tools_from_path,
    normalize_function_tool_return,
)
from verl.tools.schemas import ToolResponse


def schema_of(name: str) -> dict:
    return FUNCTION_TOOL_REGISTRY[name].tool_schema.model_dump(exclude_none=True)


def test_schema_of_a_documented_function():
    @function_tool("forecast")
    def get_forecast(city: str, days: int = 3, units: str | None = None, tags: list[str] | None = None) -> dict:
        """Get the weather forecast
        for the next days.

        Args:
            city: the city to look up.
            days (int): how many days ahead,
                counted from today.
            units: "metric" or "imperial".
            tags: labels to attach.

        Returns:
            The forecast.
        """
        return {}

    assert schema_of("forecast") == {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "Get the weather forecast\nfor the next days.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city to look up."},
                    "days": {"type": "integer", "description": "how many days ahead, counted from today."},
                    "units": {"type": ["string", "null"], "description": '"metric" or "imperial".'},
                    "tags": {"type": ["array", "null"], "description": "labels to attach."},
                },
                "required": ["city"],
            },
            "strict": False,
        },
    }
    assert FUNCTION_TOOL_REGISTRY["forecast"].fn is get_forecast and not FUNCTION_TOOL_REGISTRY["forecast"].is_async


def test_the_types_are_verl_envs_tools_ones():
    """One schema builder: a function's parameter types are what the multi_turn_tool workflow's @tool gives."""

    def lookup(key: str, limit: float = 1.0, strict: bool = False, extra: dict | None = None) -> str:
        """Look up.

        Args:
            key: k.
            limit: l.
            strict: s.
            extra: e.
        """
        return key

    function_tool(lookup)
    registry = ToolRegistry()
    registry.register(lookup)
    ours = schema_of("lookup")["function"]["parameters"]
    theirs = registry.get("lookup").parameters
    assert {k: v["type"] for k, v in ours["properties"].items()} == {
        k: v["type"] for k, v in theirs["properties"].items()
    }
    assert ours["required"] == theirs["required"] == ["key"]


@pytest.mark.parametrize(
    "source, error, message",
    [
        ("def f(x: int):\n    return x\n", ValueError, r"@function_tool 'f' \(m\.f\) has no docstring"),
        ('def f(x):\n    """Doc.\n\n    Args:\n        x: a.\n    """\n', TypeError,
         r"@function_tool 'f' \(m\.f\): parameter 'x' is missing a type hint"),
        ('def f(x: int, y: int):\n    """Doc.\n\n    Args:\n        x: a.\n    """\n', ValueError,
         r"no description for the argument 'y'; add `y: \.\.\.` to its `Args:` block"),
        ('def f(*xs: int):\n    """Doc."""\n', ValueError, r"declares variadic parameter\(s\) \['xs'\]"),
        ('def f(x: complex):\n    """Doc.\n\n    Args:\n        x: a.\n    """\n', TypeError,
         r"tool 'f' parameter 'x': annotation <class 'complex'> is not one of str, int"),
    ],
)  # fmt: skip
def test_refusals_name_the_function_and_the_parameter(source, error, message):
    namespace = {"__name__": "m"}
    exec(source, namespace)
    with pytest.raises(error, match=message):
        function_tool(namespace["f"])
    assert FUNCTION_TOOL_REGISTRY == {}


def test_duplicates_and_lookups():
    @function_tool("echo")
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: t.
        """
        return text

    function_tool("echo")(echo)  # the same function again is fine
    with pytest.raises(ValueError, match=r"function tool 'echo' is already registered \(by .*echo\); refusing"):
        function_tool("echo")(lambda text: text)
    assert get_function_tool("echo").fn is echo
    with pytest.raises(KeyError, match=r"no function tool 'nope' is registered \(registered: \['echo'\]\)"):
        get_function_tool("nope")
    with pytest.raises(TypeError, match="schema must be an OpenAIFunctionToolSchema or a dict, got str"):
        function_tool("bad", schema="not a schema")(echo)


def test_call_runs_sync_functions_off_the_event_loop_thread():
    @function_tool
    def where(x: int) -> str:
        """Thread name.

        Args:
            x: ignored.
        """
        return threading.current_thread().name

    @function_tool
    async def twice(x: int) -> int:
        """Double.

        Args:
            x: a number.
        """
        return 2 * x

    main = threading.current_thread().name
    assert asyncio.run(FUNCTION_TOOL_REGISTRY["where"].call({"x": 1})) != main
    assert FUNCTION_TOOL_REGISTRY["twice"].is_async and asyncio.run(FUNCTION_TOOL_REGISTRY["twice"].call({"x": 4})) == 8


TOOL_FILE = '''
from verl.tools.function_tool import function_tool

@function_tool("add")
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b

@function_tool
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout.
    """
    return text.upper()
'''


def test_load_a_tool_file_once(tmp_path, monkeypatch):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    monkeypatch.chdir(tmp_path)
    tools = load_function_tools_from_path("my_tools.py")  # relative to the working directory
    assert [t.name for t in tools] == ["add", "shout"]
    assert load_function_tools_from_path(str(path)) is tools  # not executed again
    assert asyncio.run(tools[0].call({"a": 2, "b": 3})) == 5
    with pytest.raises(FileNotFoundError, match=r"function_tool_path does not exist: 'missing\.py' \(looked for "):
        load_function_tools_from_path("missing.py")


def test_a_file_loaded_first_as_a_tool_module_still_yields_its_tools(tmp_path):
    """The same file in rollout.multi_turn.tool_modules (verl.envs.tools' loader) and in function_tool_path."""
    path = tmp_path / "both.py"
    path.write_text(TOOL_FILE)
    import_tool_modules([str(path)])
    assert sorted(FUNCTION_TOOL_REGISTRY) == ["add", "shout"]
    assert [t.name for t in load_function_tools_from_path(str(path))] == ["add", "shout"]


def test_a_file_without_tools_warns(tmp_path, caplog):
    path = tmp_path / "empty_tools.py"
    path.write_text("X = 1\n")
    with caplog.at_level("WARNING"):
        assert load_function_tools_from_path(str(path)) == []
    assert "no @function_tool decorators found" in caplog.text


def test_return_values_become_response_reward_metrics():
    response = ToolResponse(text="r")
    assert normalize_function_tool_return(response) == (response, 0.0, {})
    assert normalize_function_tool_return("héllo") == (ToolResponse(text="héllo"), 0.0, {})
    assert normalize_function_tool_return({"t": "é"}) == (ToolResponse(text='{"t": "é"}'), 0.0, {})
    assert normalize_function_tool_return(3.5) == (ToolResponse(text="3.5"), 0.0, {})
    assert normalize_function_tool_return(({"a": 1},)) == (ToolResponse(text='{"a": 1}'), 0.0, {})
    assert normalize_function_tool_return(("ok", 1)) == (ToolResponse(text="ok"), 1.0, {})
    assert normalize_function_tool_return(("ok", None, {"n": 2})) == (ToolResponse(text="ok"), 0.0, {"n": 2})
    with pytest.raises(TypeError, match=r"a tuple of length 4 .* must have length 1, 2, or 3"):
        normalize_function_tool_return(("a", 1, {}, "extra"))


def test_a_registry_tool_becomes_a_function_tool_with_the_same_schema():
    registry = ToolRegistry()

    @registry.register
    async def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    tool = FunctionTool.from_registry_tool(registry.get("divide"))
    assert (
        tool.tool_schema.model_dump(exclude_none=True, exclude={"function": {"strict"}})
        == registry.get("divide").schema()
    )
    assert tool.is_async and asyncio.run(tool.call({"a": 1.0, "b": 4.0})) == 0.25


def test_as_base_tool_gives_function_tools_the_lifecycle():
    @function_tool("score")
    def score(answer: str) -> tuple:
        """Score an answer.

        Args:
            answer: the answer.
        """
        return f"checked {answer}", float(answer == "42"), {"length": len(answer)}

    function = FUNCTION_TOOL_REGISTRY["score"]
    wrapped = as_base_tool(function)
    assert isinstance(wrapped, FunctionToolAsBaseTool) and isinstance(wrapped, BaseTool)
    assert not isinstance(function, BaseTool) and wrapped.name == "score" and wrapped.function_tool is function
    assert as_base_tool(wrapped) is wrapped

    async def episode():
        instance_id, _ = await wrapped.create()
        result = await wrapped.execute(instance_id, {"answer": "42"})
        reward = await wrapped.calc_reward(instance_id)
        await wrapped.release(instance_id)
        return result, reward

    assert asyncio.run(episode()) == ((ToolResponse(text="checked 42"), 1.0, {"length": 2}), 0.0)
    with pytest.raises(TypeError, match=r"as_base_tool: expected a BaseTool or a FunctionTool, got str: 'score'"):
        as_base_tool("score")


def test_the_docstring_example_of_the_module_registers():
    source = textwrap.dedent('''
        def get_weather(city: str, unit: str | None = None) -> dict:
            """Get the current weather of a city.

            Args:
                city: the city to look up.
                unit: "C" or "F".
            """
            return {}
    ''')
    namespace = {"__name__": "example"}
    exec(source, namespace)
    function_tool(namespace["get_weather"])
    assert schema_of("get_weather")["function"]["parameters"]["required"] == ["city"]
