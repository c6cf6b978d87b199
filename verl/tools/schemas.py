"""Pydantic models of verl's tool API: the OpenAI function-tool schema, a model's tool calls, a tool's response.

A property's `type` is a JSON type name or a list of them; `enum` may hold any JSON values; undeclared fields are
dropped on validation, as in verl. `OpenAIFunctionCallSchema.from_openai_function_parsed_schema` decodes a call's
JSON arguments and reports failure. `ToolResponse` holds text and/or lists of images and videos.
Layer 1: the standard library and pydantic (v2).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter: its JSON type (or a list of types), an optional description and allowed values."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The parameters object: `type` ("object"), the properties by name, and the required names."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


def _no_parameters() -> OpenAIFunctionParametersSchema:
    return OpenAIFunctionParametersSchema(type="object", properties={}, required=[])


class OpenAIFunctionSchema(BaseModel):
    """A function: name, description, parameters (none when omitted) and OpenAI's `strict` flag."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=_no_parameters)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool as the model sees it: `{"type": "function", "function": {...}}`."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from model text: the tool's name and its arguments as a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """(call, has_decode_error): arguments that are not JSON, or not a JSON object, become `{}` and flag
        the error; the caller decides what the model is told."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A call with its id, as in an OpenAI chat message's `tool_calls` list."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text, and/or images and videos (each a list, even for one item)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_must_be_lists(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}: wrap a single "
                        f"{key} as [{key}] in the tool's execute()"
                    )
        return values

    def is_empty(self) -> bool:
        """No text, no image and no video."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """Text and nothing else."""
        return bool(self.text) and not self.image and not self.video
