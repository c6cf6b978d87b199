"""Tests of verl/tools/schemas.py: the OpenAI tool schema as pydantic models, decoding a model's call, and
ToolResponse's checks."""

import pytest
from pydantic import ValidationError

from verl.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what to look for"},
                "top_k": {"type": ["integer", "null"], "items": {"type": "integer"}},  # `items` is not kept
                "mode": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["query"],
        },
    },
}


def test_a_schema_round_trips_through_the_models():
    schema = OpenAIFunctionToolSchema.model_validate(SEARCH)
    assert schema.function.name == "search" and schema.function.strict is False
    assert schema.function.parameters.properties["top_k"].type == ["integer", "null"]
    dumped = schema.model_dump(exclude_unset=True, exclude_none=True)
    expected = {**SEARCH, "function": {**SEARCH["function"], "parameters": {
        **SEARCH["function"]["parameters"],
        "properties": {**SEARCH["function"]["parameters"]["properties"], "top_k": {"type": ["integer", "null"]}},
    }}}  # fmt: skip
    assert dumped == expected


def test_defaults_no_parameters_and_no_required():
    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "now", "description": "The time."}}
    )
    assert schema.function.parameters.model_dump() == {"type": "object", "properties": {}, "required": []}
    params = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }  # fmt: skip
    ).function.parameters
    assert params.required == []


def test_a_schema_without_a_description_is_refused():
    with pytest.raises(ValidationError, match="description"):
        OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "f"}})


def test_parsed_call_decodes_its_arguments():
    call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name="search", arguments='{"query": "pydantic", "top_k": 2}')
    )
    assert (call.name, call.arguments, bad) == ("search", {"query": "pydantic", "top_k": 2}, False)
    for text in ['{"query": ', "[1, 2]", '"a string"', "null"]:  # not JSON, or JSON but not an object
        call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
            OpenAIFunctionParsedSchema(name="search", arguments=text)
        )
        assert (call.name, call.arguments, bad) == ("search", {}, True), text
    tool_call = OpenAIFunctionToolCall(id="call_0", function=call)
    assert tool_call.type == "function"


def test_tool_response_checks_and_predicates():
    assert ToolResponse().is_empty() and not ToolResponse().is_text_only()
    assert ToolResponse(text="hi").is_text_only() is True
    assert not ToolResponse(text="hi", image=["img"]).is_text_only()
    assert not ToolResponse(video=["v"]).is_empty()
    assert ToolResponse(text="x", image=None).image is None  # None is "no image", not a bad value
    with pytest.raises(ValidationError, match=r"ToolResponse.image must be a list, got str: wrap a single image"):
        ToolResponse(image="picture.png")
    with pytest.raises(ValidationError, match=r"ToolResponse.video must be a list, got dict"):
        ToolResponse(video={"frames": []})
