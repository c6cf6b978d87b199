"""Tests of verl/envs/tools.py: schemas from typed signatures, `<tool_call>` parsing (JSON object, list, one
object per line as in RLLA), and execution where every failure becomes an `error: ...` observation."""

import asyncio

import pytest

from verl.envs.tools import ToolRegistry, format_observations, parse_tool_calls, run_tool_calls


def registry_with_tools() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.register
    def get_forecast(city: str, days: int = 3, units: str | None = None) -> dict:
        """Get the weather forecast for the next days.

        More text that is not part of the description."""
        return {"city": city, "days": days}

    @registry.register(name="divide")
    def div(a: float, b: float) -> float:
        return a / b

    @registry.register
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "done"

    return registry


def run(registry, text, timeout_s=1.0):
    return asyncio.run(run_tool_calls(registry, parse_tool_calls(text), timeout_s))


def test_schema_from_the_signature():
    registry = registry_with_tools()
    assert registry.names() == ["divide", "get_forecast", "slow"]
    schema = registry.get("get_forecast").schema()
    assert schema == {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "Get the weather forecast for the next days.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "units": {"type": ["string", "null"]}},
                "required": ["city"],
            },
        },
    }  # fmt: skip
    with pytest.raises(TypeError, match="parameter 'x' has no type annotation"):
        registry.register(lambda x: x)
    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):

        @registry.register
        def spread(**kwargs: int) -> int:
            return 0

    with pytest.raises(TypeError, match="is not one of str, int"):

        @registry.register
        def odd(x: complex) -> str:
            return ""

    with pytest.raises(ValueError, match="already registered"):
        registry.register(name="divide")(lambda a: a)


def test_parsing_formats():
    rlla = '<think> two calls </think>\n<tool_call>\n{"name": "a", "parameters": {"x": 1}}\n{"name": "b", "parameters": {}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(rlla)] == [("a", {"x": 1}), ("b", {})]
    listed = '<tool_call>[{"name": "a", "arguments": {"x": 2}}, {"name": "b", "arguments": "{\\"y\\": 3}"}]</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(listed)] == [("a", {"x": 2}), ("b", {"y": 3})]
    two_blocks = '<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_tool_calls(two_blocks)] == ["a", "b"]
    assert parse_tool_calls("no calls here") == [] and parse_tool_calls("<tool_call>{unclosed") == []
    bad = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"x": }}</tool_call>')
    assert len(bad) == 1 and bad[0].error.startswith("the tool call is not valid JSON (Expecting value at column")
    assert "must be {" in parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error
    assert "must be a JSON object" in parse_tool_calls('<tool_call>{"name": "a", "arguments": 5}</tool_call>')[0].error


def test_every_failure_is_an_observation():
    registry = registry_with_tools()
    text = (
        '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Oslo"}}\n'
        '{"name": "divide", "arguments": {"a": 1, "b": 0}}\n'
        '{"name": "divide", "arguments": {"a": "1", "b": 2}}\n'
        '{"name": "divide", "arguments": {"a": 1}}\n'
        '{"name": "divide", "arguments": {"a": 1, "b": 2, "c": 3}}\n'
        '{"name": "teleport", "arguments": {}}\n'
        '{"name": "slow", "arguments": {"seconds": 5}}\n'
        '{"name": "divide" "arguments"}\n'
        '{"name": "divide", "arguments": {"a": 9, "b": 3}}\n</tool_call>'
    )
    observations = run(registry, text, timeout_s=0.2)
    assert observations == [
        '{"city": "Oslo", "days": 3}',
        "error: tool 'divide' raised ZeroDivisionError: division by zero",
        "error: tool 'divide': argument 'a' must be number, got \"1\"",
        "error: tool 'divide': missing required arguments ['b']",
        "error: tool 'divide': unknown arguments ['c']; the parameters are ['a', 'b']",
        "error: unknown tool 'teleport'; available tools: ['divide', 'get_forecast', 'slow']",
        "error: tool 'slow' timed out after 0.2 s",
        'error: the tool call is not valid JSON (Expecting \',\' delimiter at column 19): "{\\"name\\": \\"divide\\" \\"arguments\\"}"',
        "3.0",
    ]
    assert run(registry, '<tool_call>{"name": "slow", "arguments": {"seconds": 0.01}}</tool_call>') == ["done"]
    assert run(
        registry, '<tool_call>{"name": "get_forecast", "arguments": {"city": "Oslo", "units": null}}</tool_call>'
    )[0].startswith("{")
    assert (
        "must be boolean"
        not in run(registry, '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 2}}</tool_call>')[0]
    )
    assert (
        "must be number, got true"
        in run(registry, '<tool_call>{"name": "divide", "arguments": {"a": true, "b": 2}}</tool_call>')[0]
    )


def test_observation_format():
    assert format_observations(["a", "b" * 10], max_chars=4) == "\n<obs> a </obs>\n<obs> bbbb...(truncated) </obs>\n"


def test_tool_call_format_by_name():
    """`rollout.multi_turn.format` (verl's key, default hermes) picks the parser and the stop string."""
    from verl.envs.tools import get_tool_call_format

    hermes = get_tool_call_format("hermes")
    assert get_tool_call_format(None) is hermes and hermes.stop == "</tool_call>"
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert hermes.parse(text) == parse_tool_calls(text) and hermes.parse(text)[0].name == "add"
    assert get_tool_call_format("qwen3_coder").stop == "</tool_call>"  # verl's parsers (tool_formats.py)
    known = r"known: \['deepseek_v4', 'gemma4', 'glm', 'gpt-oss', 'hermes', 'kimi', 'minimax', 'qwen3_coder', 'seed'\]"
    with pytest.raises(ValueError, match=r"multi_turn.format='nope' is not a known tool-call format; " + known):
        get_tool_call_format("nope")
