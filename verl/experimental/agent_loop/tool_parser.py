"""verl's tool-call parsers (`verl.experimental.agent_loop.tool_parser`): `FunctionCall`, the `ToolParser` base
with its registry (`ToolParser.register(name)`, `ToolParser.get_tool_parser(name, tokenizer)`) and the parsers
verl 0.9.1 registers: hermes, gpt-oss, qwen3_coder (`Qwen3XMLToolParser`), glm, seed, minimax, kimi,
deepseek_v4 and gemma4.

A parser decodes a turn's token ids with its tokenizer and reads the calls with the text reader of the same
name in `verl.envs.tool_formats` (the one implementation, also behind `rollout.multi_turn.format` of the
`multi_turn_tool` workflow). `await parser.extract_tool_calls(response_ids, tools)` returns `(content, calls)`:
the text for the user and `FunctionCall`s whose `arguments` are a JSON string. A call the model wrote badly
is logged and left out, as verl does; nothing raises on model output.

Differences from verl, all on output verl drops or mangles: hermes also reads a JSON list of calls, one call
per line (RLLA), "parameters" for "arguments", JSON-string arguments (verl would quote them again) and a
missing "arguments" (as {}); qwen3_coder reads a `["x", "null"]` parameter type as x. `FunctionCall` is a
dataclass (keyword fields and `model_dump()`, like verl's pydantic model) and there is no rollout tracing.

Layer 1 (utilities): standard library and `verl.envs.tool_formats` only; no torch, no Ray at import time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from verl.envs.tool_formats import (
    ParsedToolCall,
    get_tool_call_format,
    parse_qwen3_function,
    qwen3_function_strings,
)

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = [
    "DeepSeekV4ToolParser",
    "FunctionCall",
    "GLMToolParser",
    "Gemma4ToolParser",
    "GptOssToolParser",
    "HermesToolParser",
    "KimiToolParser",
    "MiniMaxToolParser",
    "Qwen3XMLToolParser",
    "SeedToolParser",
    "ToolParser",
]


@dataclasses.dataclass(kw_only=True)
class FunctionCall:
    """One tool call: the function `name`, its `arguments` as the JSON text of an object (the model may
    still have written arguments the tool does not accept: check them before calling), and the call id the
    model wrote, where its format has one (`tool_call_id`)."""

    arguments: str
    name: str
    tool_call_id: str | None = None

    def model_dump(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def to_function_call(call: ParsedToolCall) -> FunctionCall | None:
    """The `FunctionCall` verl's parser makes of a parsed call, or None (logged) for one it drops."""
    if call.name is None or (call.arguments is None and call.raw_arguments is None):
        logger.error(f"Failed to decode tool call: {call.error}")
        return None
    if call.error is not None:
        logger.warning(f"Tool call of {call.name!r} passed on as written: {call.error}")
    if call.raw_arguments is not None:
        arguments = call.raw_arguments
    else:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
    return FunctionCall(name=call.name, arguments=arguments, tool_call_id=call.tool_call_id)


def to_function_calls(calls: list[ParsedToolCall]) -> list[FunctionCall]:
    return [fc for fc in map(to_function_call, calls) if fc is not None]


class ToolParser(ABC):
    """Reads tool calls out of a model turn. Subclasses register under a name with `@ToolParser.register(name)`;
    `ToolParser.get_tool_parser(rollout.multi_turn.format, tokenizer)` builds one."""

    _registry: ClassVar[dict[str, type[ToolParser]]] = {}

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that must end generation so the parser can run. Empty by default: models such as Qwen3
        end a tool-call turn with eos; a model that writes on after its calls (Gemma 4) names its closing token."""
        return []

    @abstractmethod
    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """`(content, calls)` of the turn `responses_ids`; `tools` are the OpenAI tool schemas offered."""
        raise NotImplementedError

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> ToolParser:
        if name not in cls._registry:
            raise ValueError(f"Unknown tool parser: {name} (known: {sorted(cls._registry)})")
        return cls._registry[name](tokenizer)

    @classmethod
    def register(cls, name: str):
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = subclass
            return subclass

        return decorator


class _FormatToolParser(ToolParser):
    """A parser over the text reader `TOOL_CALL_FORMATS[format_name]`: decode (in a thread, as verl does),
    drop the pad token where verl does, split into content and calls."""

    format_name: ClassVar[str]
    decode_kwargs: ClassVar[dict[str, Any]] = {"skip_special_tokens": False}
    strip_pad_token: ClassVar[bool] = False
    stop_token: ClassVar[str | None] = None  # a special token that must end generation (see stop_token_ids)

    @property
    def stop_token_ids(self) -> list[int]:
        if self.stop_token is None:
            return []
        token_id = self.tokenizer.convert_tokens_to_ids(self.stop_token)
        return [token_id] if isinstance(token_id, int) and token_id >= 0 else []

    async def _decode(self, responses_ids: list[int]) -> str:
        decode = functools.partial(self.tokenizer.decode, responses_ids, **self.decode_kwargs)
        text = await asyncio.get_running_loop().run_in_executor(None, decode)
        pad = getattr(self.tokenizer, "pad_token", None) if self.strip_pad_token else None
        return text.replace(pad, "") if pad else text

    def _split(self, text: str, tools: list | None) -> tuple[str, list[FunctionCall]]:
        fmt = get_tool_call_format(self.format_name)
        content, calls = fmt.split(text, tools) if fmt.split is not None else (text, fmt.parse(text))
        return content, to_function_calls(calls)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list | None = None
    ) -> tuple[str, list[FunctionCall]]:
        return self._split(await self._decode(responses_ids), tools)


@ToolParser.register("hermes")
class HermesToolParser(_FormatToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5 / Qwen3, Hermes); content is the
    text with the complete blocks removed."""

    format_name = "hermes"
    decode_kwargs = {}


@ToolParser.register("gpt-oss")
class GptOssToolParser(_FormatToolParser):
    """gpt-oss (harmony): `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{...}<|call|>`; analysis (reasoning) messages are removed first, arguments pass on as written."""

    format_name = "gpt-oss"
    strip_pad_token = True


@ToolParser.register("qwen3_coder")
class Qwen3XMLToolParser(_FormatToolParser):
    """Qwen3-Coder / Qwen3.5 XML: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
    </tool_call>`; values take the types of the tool's schema; a turn cut off inside a call still counts."""

    format_name = "qwen3_coder"
    decode_kwargs = {}

    def _parse_xml_function_call(self, function_call_str: str, tools: list | None) -> FunctionCall | None:
        """The call in the text after `<function=` (None for a header without `>`)."""
        return to_function_call(parse_qwen3_function(function_call_str, tools))

    def _get_function_calls(self, model_output: str) -> list[str]:
        """The texts after each `<function=` of the turn."""
        return qwen3_function_strings(model_output)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids)
        try:
            return self._split(text, tools)
        except Exception as err:  # a malformed tools schema, say: no calls, as verl answers
            logger.exception(f"Error in extracting tool call from response: {err}")
            return text, []


@ToolParser.register("glm")
class GLMToolParser(_FormatToolParser):
    """GLM: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`; stops on `<|observation|>`."""

    format_name = "glm"
    stop_token = "<|observation|>"


@ToolParser.register("seed")
class SeedToolParser(_FormatToolParser):
    """ByteDance Seed: `<seed:tool_call><function=NAME><parameter=K>V</parameter></function></seed:tool_call>`."""

    format_name = "seed"


@ToolParser.register("minimax")
class MiniMaxToolParser(_FormatToolParser):
    """MiniMax: `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>...`."""

    format_name = "minimax"


@ToolParser.register("kimi")
class KimiToolParser(_FormatToolParser):
    """Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...`; the id (`functions.NAME:0`) is kept as `tool_call_id` and mapped to a tool name."""

    format_name = "kimi"
    stop_token = "<|im_end|>"


@ToolParser.register("deepseek_v4")
class DeepSeekV4ToolParser(_FormatToolParser):
    """DeepSeek-V4 DSML: `<｜DSML｜tool_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter name="K"
    string="true|false">V</｜DSML｜parameter>...`; content leaves out the reasoning before `</think>`."""

    format_name = "deepseek_v4"
    strip_pad_token = True


@ToolParser.register("gemma4")
class Gemma4ToolParser(_FormatToolParser):
    """Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`; stops on `<tool_call|>` (the
    model does not end its turn after a call)."""

    format_name = "gemma4"
    strip_pad_token = True
    stop_token = "<tool_call|>"
