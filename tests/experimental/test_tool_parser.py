"""Tests of verl's tool-call parsers (verl/experimental/agent_loop/tool_parser.py) and the text readers they share
with the multi_turn_tool workflow (verl/envs/tool_formats.py): one real-looking turn per format, parsed by hand;
malformed turns never raise, verl's parser drops (and logs) what the workflow reports as an error."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import verl.envs.tool_formats as tool_formats
import verl.envs.tools as tools
from verl.envs.tool_formats import TOOL_CALL_FORMATS, get_tool_call_format
from verl.envs.tools import ToolRegistry
from verl.experimental.agent_loop import tool_parser
from verl.experimental.agent_loop.tool_parser import (
    FunctionCall,
    Gemma4ToolParser,
    HermesToolParser,
    KimiToolParser,
    Qwen3XMLToolParser,
    ToolParser,
)

VERL_PARSERS = {"hermes", "gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4"}


class FakeTokenizer:
    """Decodes any ids to `text` and records how it was asked to."""

    pad_token = "<pad>"

    def __init__(self, text: str):
        self.text = text
        self.decode_kwargs: list[dict] = []

    def decode(self, ids, **kwargs):
        self.decode_kwargs.append(kwargs)
        return self.text

    def convert_tokens_to_ids(self, token):
        return {"<|im_end|>": 163586, "<|observation|>": 151338, "<tool_call|>": 262145}.get(token, -1)


def extract(name: str, text: str, tools=None) -> tuple[str, list[FunctionCall]]:
    parser = ToolParser.get_tool_parser(name, FakeTokenizer(text))
    return asyncio.run(parser.extract_tool_calls([1, 2, 3], tools=tools))


def calls_of(found: list[FunctionCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in found]


def weather_tools() -> list[dict]:
    registry = ToolRegistry()

    @registry.register
    def get_weather(city: str, days: int = 1, metric: bool | None = None, ratio: float = 1.0) -> str:
        """Weather."""
        return city

    @registry.register
    def search(query: str, filters: dict | None = None, ids: list | None = None) -> str:
        """Search."""
        return query

    return registry.schemas()


# One turn per format, with what verl's parser returns for it (content, calls).
SAMPLES = {
    "hermes": (
        '<think>\nweather first\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": '
        '"café"}}\n</tool_call><|im_end|>',
        "<think>\nweather first\n</think>\n\nLet me check.\n\n<|im_end|>",
        [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "café"})],
    ),
    "qwen3_coder": (
        "I'll look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=ratio>\n2.0\n"
        "</parameter>\n</function>\n</tool_call>",
        "I'll look that up.\n",
        [("get_weather", {"city": "San Francisco", "days": 3, "metric": True, "ratio": 2})],
    ),
    "glm": (
        "<think>plan</think>I will search.<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>verl agent loop"
        '</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{"year": 2025}</arg_value>\n</tool_call>',
        "I will search.",
        [("search", {"query": "verl agent loop", "filters": {"year": 2025}})],
    ),
    "seed": (
        "Sure.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Berlin</parameter>\n<parameter=days>2"
        "</parameter>\n</function>\n</seed:tool_call>",
        "Sure.",
        [("get_weather", {"city": "Berlin", "days": 2})],
    ),
    "minimax": (
        'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Tokyo</parameter>\n'
        '</invoke>\n<invoke name="search">\n<parameter name="query">"Tokyo time"</parameter>\n<parameter name='
        '"ids">[1, 2]</parameter>\n</invoke>\n</minimax:tool_call>',
        "Checking.\n",
        [("get_weather", {"city": "Tokyo"}), ("search", {"query": "Tokyo time", "ids": [1, 2]})],
    ),
    "kimi": (
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
        '{"query": "fjords"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "Let me check.",
        [("get_weather", {"city": "Oslo"}), ("search", {"query": "fjords"})],
    ),
    "deepseek_v4": (
        'The user wants weather.</think>Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n<｜DSML｜parameter name="days" '
        'string="false">4</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>',
        "Let me check.",
        [("get_weather", {"city": "Rome", "days": 4})],
    ),
    "gemma4": (
        'Sure.<|tool_call>call:get_weather{city:<|"|>New York, NY<|"|>,days:3,metric:true,ratio:0.5,note:null,'
        "unit:celsius}<tool_call|><pad><pad>",
        "Sure.",
        [
            (
                "get_weather",
                {"city": "New York, NY", "days": 3, "metric": True, "ratio": 0.5, "note": None, "unit": "celsius"},
            )
        ],
    ),  # fmt: skip
    "gpt-oss": (
        "<|start|>assistant<|channel|>analysis<|message|>Call to=functions.search <|constrain|>json<|message|>{}"
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Tokyo"}<|call|><pad>',
        "",
        [("get_weather", {"city": "Tokyo"})],
    ),
}


def test_the_registry_holds_verls_parsers_and_the_workflow_formats():
    assert set(ToolParser._registry) == VERL_PARSERS == set(TOOL_CALL_FORMATS)
    assert isinstance(ToolParser.get_tool_parser("qwen3_coder", None), Qwen3XMLToolParser)
    assert ToolParser._registry["kimi"] is KimiToolParser and ToolParser._registry["hermes"] is HermesToolParser
    with pytest.raises(ValueError, match="Unknown tool parser: nope"):
        ToolParser.get_tool_parser("nope", None)
    # verl.envs.tools keeps its names: the same objects as the shared module's
    assert (
        tools.parse_tool_calls is tool_formats.parse_tool_calls and tools.get_tool_call_format is get_tool_call_format
    )
    assert tools.TOOL_CALL_FORMATS is TOOL_CALL_FORMATS and tools.ParsedToolCall is tool_formats.ParsedToolCall


def test_a_user_parser_registers_by_name():
    @ToolParser.register("upper")
    class UpperParser(ToolParser):
        async def extract_tool_calls(self, responses_ids, tools=None):
            return "", [FunctionCall(name="shout", arguments=json.dumps({"n": len(responses_ids)}))]

    try:
        parser = ToolParser.get_tool_parser("upper", tokenizer="tok")
        assert parser.tokenizer == "tok" and parser.stop_token_ids == []
        assert asyncio.run(parser.extract_tool_calls([5, 6])) == (
            "",
            [FunctionCall(name="shout", arguments='{"n": 2}')],
        )
    finally:
        del ToolParser._registry["upper"]
    with pytest.raises(TypeError):
        ToolParser(None)  # abstract: extract_tool_calls is missing


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_format_reads_its_turn(name):
    text, content, expected = SAMPLES[name]
    found_content, found = extract(name, text, tools=weather_tools())
    assert found_content == content
    assert calls_of(found) == expected
    # the workflow reads the same calls from the same text, and its stop string ends them
    fmt = get_tool_call_format(name)
    parsed = fmt.parse(text.replace("<pad>", ""), weather_tools())
    assert [(c.name, c.arguments) for c in parsed] == expected and all(c.error is None for c in parsed)
    assert fmt.stop in text


def test_arguments_are_json_text_with_unicode_kept():
    _, found = extract("hermes", SAMPLES["hermes"][0])
    assert found[1] == FunctionCall(name="search", arguments='{"query": "café"}')
    assert found[1].model_dump() == {"arguments": '{"query": "café"}', "name": "search", "tool_call_id": None}
    _, found = extract("gpt-oss", SAMPLES["gpt-oss"][0])
    assert found[0].arguments == '{"city":"Tokyo"}'  # gpt-oss arguments pass on exactly as written


def test_decoding_follows_verl():
    """hermes and qwen3_coder decode with the tokenizer's defaults; the others keep special tokens."""
    for name, kwargs in (("hermes", {}), ("qwen3_coder", {}), ("kimi", {"skip_special_tokens": False})):
        tokenizer = FakeTokenizer("plain answer")
        parser = ToolParser.get_tool_parser(name, tokenizer)
        assert asyncio.run(parser.extract_tool_calls([7])) == ("plain answer", [])
        assert tokenizer.decode_kwargs == [kwargs]


def test_stop_token_ids():
    tokenizer = FakeTokenizer("")
    stops = {name: ToolParser.get_tool_parser(name, tokenizer).stop_token_ids for name in VERL_PARSERS}
    assert stops == {name: [] for name in VERL_PARSERS} | {"kimi": [163586], "glm": [151338], "gemma4": [262145]}
    assert Gemma4ToolParser(SimpleNamespace(convert_tokens_to_ids=lambda t: -1)).stop_token_ids == []


def test_hermes_malformed_calls_are_dropped_by_verls_parser_and_reported_to_the_workflow(caplog):
    text = (
        'a<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"query": "ok"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": 5}</tool_call>'
    )
    with caplog.at_level(logging.WARNING, logger=tool_parser.__name__):
        content, found = extract("hermes", text)
    assert content == "a"
    assert [(c.name, c.arguments) for c in found] == [("search", '{"query": "ok"}'), ("search", "5")]  # as verl
    assert "Failed to decode tool call: the tool call is not valid JSON (Expecting value at column 47)" in caplog.text
    errors = [c.error for c in get_tool_call_format("hermes").parse(text)]
    assert errors == ['the tool call is not valid JSON (Expecting value at column 47): "{\\"name\\": \\"get_weather\\", '
                      '\\"arguments\\": {\\"city\\": }}"', None, "arguments of 'search' must be a JSON object"]  # fmt: skip
    assert extract("hermes", 'half <tool_call>{"name": "search"')[1] == []  # no closing tag: no call
    rlla = '<tool_call>\n{"name": "search", "parameters": {"query": "a"}}\n{"name": "search"}\n</tool_call>'
    assert calls_of(extract("hermes", rlla)[1]) == [("search", {"query": "a"}), ("search", {})]


def test_qwen3_types_from_the_schema_and_cut_off_turns():
    cut = "Searching.\n<tool_call>\n<function=search>\n<parameter=query>\nrl for llms\n</parameter>\n<parameter=ids>\n[3, 4]"
    content, found = extract("qwen3_coder", cut, tools=weather_tools())
    assert content == "Searching.\n" and calls_of(found) == [("search", {"query": "rl for llms", "ids": [3, 4]})]
    # without tools every value stays text, except null
    text = "<tool_call><function=get_weather><parameter=days>3</parameter><parameter=note>null</parameter></function></tool_call>"
    assert calls_of(extract("qwen3_coder", text)[1]) == [("get_weather", {"days": "3", "note": None})]
    # values that do not fit their type stay text; booleans other than true/false are false
    text = (
        "<tool_call><function=get_weather><parameter=days>three</parameter><parameter=ratio>inf</parameter>"
        "<parameter=metric>yes</parameter><parameter=city>12</parameter></function></tool_call>"
    )
    args = json.loads(extract("qwen3_coder", text, tools=weather_tools())[1][0].arguments)
    assert args == {"days": "three", "ratio": "inf", "metric": False, "city": "12"}
    # a header cut before '>' is dropped by verl's parser and an error for the workflow
    assert extract("qwen3_coder", "<tool_call>\n<function=sea", tools=weather_tools()) == ("", [])
    (parsed,) = get_tool_call_format("qwen3_coder").parse("<tool_call>\n<function=sea")
    assert parsed.name is None and parsed.error.startswith("the tool call has no '>' after the function name")


def test_qwen3_never_evaluates_model_text():
    call = Qwen3XMLToolParser(None)._parse_xml_function_call(
        'search><parameter=ids>__import__("os").getcwd()</parameter>', weather_tools()
    )
    assert json.loads(call.arguments) == {"ids": '__import__("os").getcwd()'}


def test_qwen3_reads_attribute_style_schemas():
    """verl passes pydantic schemas (attributes, `model_dump()` on properties); dicts work the same."""
    prop = SimpleNamespace(model_dump=lambda: {"type": "integer"})
    tool = SimpleNamespace(type="function", function=SimpleNamespace(
        name="count", parameters=SimpleNamespace(properties={"n": prop}, required=["n"])))  # fmt: skip
    call = Qwen3XMLToolParser(None)._parse_xml_function_call("count><parameter=n>7</parameter>", [tool])
    assert call == FunctionCall(name="count", arguments='{"n": 7}')
    assert Qwen3XMLToolParser(None)._get_function_calls("<function=a>x</function> <function=b>y") == ["a>x", "b>y"]


def test_kimi_ids_names_and_bad_arguments():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        "{not json}<|tool_call_end|><|tool_call_begin|>call_7<|tool_call_argument_begin|>"
        '{"query": "x"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    content, found = extract("kimi", text, tools=weather_tools())
    assert content == ""
    assert [(c.name, c.arguments, c.tool_call_id) for c in found] == [
        ("get_weather", "{}", "functions.get_weather:0"),  # verl passes bad arguments on as {}
        ("search", '{"query": "x"}', "call_7"),  # the one tool whose required parameters were all given
    ]
    assert [c.name for c in extract("kimi", text)[1]] == ["functions.get_weather:0", "call_7"]  # no tools: the id
    parsed = get_tool_call_format("kimi").parse(text, weather_tools())
    assert (
        parsed[0].error
        == "arguments of 'functions.get_weather:0' are not valid JSON (Expecting property name enclosed in double quotes)"
    )


def test_other_malformed_turns_never_raise():
    assert extract("seed", "<seed:tool_call>get_weather(city=Berlin)</seed:tool_call>") == ("", [])
    assert get_tool_call_format("seed").parse("<seed:tool_call>x</seed:tool_call>")[0].error.startswith("no <function")
    bad_dsml = (
        '<｜DSML｜tool_calls><｜DSML｜invoke name="search"><｜DSML｜parameter name="filters" string="false">{bad'
        "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>"
    )
    assert calls_of(extract("deepseek_v4", bad_dsml)[1]) == [("search", {"filters": "{bad"})]
    assert extract("deepseek_v4", "reasoning</think>Just an answer.<｜end▁of▁sentence｜>") == ("Just an answer.", [])
    gpt_bad = "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{q}<|call|>"
    assert [(c.name, c.arguments) for c in extract("gpt-oss", gpt_bad)[1]] == [("search", "{q}")]  # as written
    assert get_tool_call_format("gpt-oss").parse(gpt_bad)[0].error.startswith("arguments of 'search' are not valid")
    assert extract("gemma4", '<|tool_call>call:broken{city:<|"|>x') == ('<|tool_call>call:broken{city:<|"|>x', [])
    assert extract("glm", "<tool_call>lonely</tool_call>") == ("", [FunctionCall(name="lonely", arguments="{}")])
    assert extract("minimax", "<minimax:tool_call>nothing</minimax:tool_call>") == ("", [])


def test_the_parser_modules_import_only_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"__future__", "verl"}
    for module in (tool_formats, tool_parser):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        names = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert {name.split(".")[0] for name in names} <= allowed, module.__name__
        assert {name for name in names if name.startswith("verl")} <= {"verl.envs.tool_formats"}
