"""Tool-call formats: reading the tool calls out of a model turn's text, one reader per model family.

Owns `ParsedToolCall`, `ToolCallFormat`, `TOOL_CALL_FORMATS` and `get_tool_call_format`, with a reader for every
tool parser of verl 0.9.1 (`hermes`, also RLLA's one-object-per-line form, `qwen3_coder`, `glm`, `seed`, `minimax`,
`kimi`, `deepseek_v4`, `gemma4`, `gpt-oss`), shared by the `multi_turn_tool` workflow and verl's `ToolParser`
classes. `split(text, tools=None) -> (content, calls)`; a call verl would drop comes back with `error` set.
Layer 1: standard library only.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = [
    "ParsedToolCall",
    "TOOL_CALL_FORMATS",
    "ToolCallFormat",
    "get_tool_call_format",
    "parse_qwen3_function",
    "parse_tool_calls",
    "qwen3_function_strings",
]


@dataclass(frozen=True)
class ParsedToolCall:
    """One call read from model text.

    `error` is what the model will be told when the call cannot run as written. `arguments` is the argument
    object; it stays set next to an error only where verl's parser still passes the call on (kimi: {} for
    arguments that are not JSON). `raw_arguments` is the argument text verl's parser passes on unparsed
    (gpt-oss always; hermes when the arguments are not an object). `tool_call_id` is the id the model wrote
    (kimi)."""

    name: str | None = None
    arguments: dict | None = None
    error: str | None = None
    tool_call_id: str | None = None
    raw_arguments: str | None = None


def _snippet(text: str, limit: int = 80) -> str:
    text = text.strip()
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")


def _json_or_text(raw: str) -> Any:
    """A parameter value: the JSON value it spells, else the stripped text (glm, seed, minimax)."""
    value = raw.strip()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _field(obj: Any, key: str) -> Any:
    """`obj[key]` of a dict, `obj.key` of anything else (verl passes pydantic tool schemas, we pass dicts)."""
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _functions(tools: list | None) -> list[Any]:
    """The `function` parts of the function tools in `tools`."""
    return [_field(t, "function") for t in tools or [] if _field(t, "type") == "function"]


# ------------------------------------------------------------------------- hermes: <tool_call>{json}</tool_call>
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call_from_object(obj: Any) -> ParsedToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedToolCall(
            error=f'a tool call must be {{"name": ..., "arguments": {{...}}}}, got {_snippet(json.dumps(obj))}'
        )
    name, given = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    raw = json.dumps(given, ensure_ascii=False)  # what verl's hermes parser passes on when it is no object
    arguments = given
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return ParsedToolCall(name=name, error=f"arguments of {name!r} are not valid JSON ({err.msg})",
                                  raw_arguments=raw)  # fmt: skip
    if not isinstance(arguments, dict):
        return ParsedToolCall(name=name, error=f"arguments of {name!r} must be a JSON object", raw_arguments=raw)
    return ParsedToolCall(name=name, arguments=arguments)


def _bad_json(text: str) -> ParsedToolCall:
    try:
        json.loads(text)
        reason = "unexpected format"
    except json.JSONDecodeError as err:
        reason = f"{err.msg} at column {err.colno}"
    return ParsedToolCall(error=f"the tool call is not valid JSON ({reason}): {_snippet(text)}")


def _parse_block(block: str) -> list[ParsedToolCall]:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        lines = [line for line in block.strip().splitlines() if line.strip()]
        if len(lines) <= 1:
            return [_bad_json(block)]
        calls = []
        for line in lines:  # RLLA / ToolRL: one JSON object per line
            try:
                calls.append(_call_from_object(json.loads(line)))
            except json.JSONDecodeError:
                calls.append(_bad_json(line))
        return calls
    items = obj if isinstance(obj, list) else [obj]
    return [_call_from_object(item) for item in items] or [ParsedToolCall(error="empty tool call list")]


def parse_tool_calls(text: str, tools: list | None = None) -> list[ParsedToolCall]:
    """Every call in the `<tool_call>` blocks of `text`, in order (empty when there is no complete block).

    A block is one JSON object, a JSON list of objects, or one object per line; an object is `{"name": ...,
    "arguments": {...}}` ("parameters" is accepted too, and OpenAI's JSON-string arguments). `tools` is unused."""
    del tools
    calls: list[ParsedToolCall] = []
    for block in TOOL_CALL_RE.findall(text):
        calls.extend(_parse_block(block))
    return calls


def _split_hermes(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return text, []
    return TOOL_CALL_RE.sub("", text), parse_tool_calls(text)


# ------------------------------------------------------------ qwen3_coder: <function=NAME><parameter=KEY>VALUE
_QWEN3_BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_QWEN3_FUNCTION_RE = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_QWEN3_PARAMETER_RE = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def qwen3_function_strings(text: str) -> list[str]:
    """What follows each `<function=` up to `</function>` (or the end of a truncated turn), inside the
    `<tool_call>` blocks (a truncated last block counts), or anywhere in `text` when it has no block."""
    blocks = [closed or opened for closed, opened in _QWEN3_BLOCK_RE.findall(text)] or [text]
    return [closed or opened for block in blocks for closed, opened in _QWEN3_FUNCTION_RE.findall(block)]


def _schema_type(prop: Any) -> str:
    """The lower-case type name of a parameter schema ("string" when it has none). A union with exactly one
    non-null type (`X | None`, written ["x", "null"]) is that type."""
    if not isinstance(prop, dict) or "type" not in prop:
        return "string"
    kind = prop["type"]
    if isinstance(kind, list | tuple):
        non_null = [k for k in kind if k != "null"]
        kind = non_null[0] if len(non_null) == 1 else kind
    return str(kind).strip().lower()


def _qwen3_value(value: str, key: str, props: dict, function: str) -> Any:
    """A parameter's text converted to the type its schema names; text it cannot convert stays text."""
    if value.lower() == "null":
        return None
    if key not in props:
        if props:
            logger.warning(f"parameter {key!r} is not in the schema of tool {function!r}; kept as text")
        return value
    kind = _schema_type(props[key])
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            logger.warning(f"parameter {key!r} of tool {function!r} is not an integer: {value!r}; kept as text")
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return int(number) if number == int(number) else number
        except (ValueError, OverflowError):  # not a number, or inf / nan
            logger.warning(f"parameter {key!r} of tool {function!r} is not a number: {value!r}; kept as text")
            return value
    if kind in ("boolean", "bool", "binary"):
        if value.lower() not in ("true", "false"):
            logger.warning(f"parameter {key!r} of tool {function!r} is not true/false: {value!r}; taken as false")
        return value.lower() == "true"
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    try:  # arrays and anything else: a Python literal; never eval (the text comes from the model)
        return ast.literal_eval(value)
    except Exception:  # literal_eval raises ValueError, SyntaxError, TypeError, RecursionError, ...
        logger.warning(f"parameter {key!r} of tool {function!r} is no literal: {value!r}; kept as text")
        return value


def _qwen3_properties(function: str, tools: list | None) -> dict:
    for fn in _functions(tools):
        if _field(fn, "name") == function:
            props = _field(_field(fn, "parameters") or {}, "properties") or {}
            return {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in props.items()}
    logger.warning(f"tool {function!r} is not in the tools list; its parameters stay text")
    return {}


def parse_qwen3_function(function_text: str, tools: list | None = None) -> ParsedToolCall:
    """One call from the text after `<function=`: `NAME>` then `<parameter=KEY>VALUE</parameter>` pairs. A
    header without `>` is an error; a parameter without `>` (cut off) is skipped, the others are kept."""
    end = function_text.find(">")
    if end == -1:
        logger.warning(f"skipping a function call without '>' after its name: {function_text!r}")
        return ParsedToolCall(error=f"the tool call has no '>' after the function name: {_snippet(function_text)}")
    name = function_text[:end]
    props = _qwen3_properties(name, tools)
    arguments = {}
    for closed, opened in _QWEN3_PARAMETER_RE.findall(function_text[end + 1 :]):
        param = closed or opened
        cut = param.find(">")
        if cut == -1:
            logger.warning(f"skipping a parameter without '>' in the call of {name!r}: {param!r}")
            continue
        value = param[cut + 1 :]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[param[:cut]] = _qwen3_value(value, param[:cut], props, name)
    return ParsedToolCall(name=name, arguments=arguments)


def _split_qwen3(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    functions = qwen3_function_strings(text)
    if not functions:
        return text, []
    return text[: text.find("<tool_call>")], [parse_qwen3_function(f, tools) for f in functions]


# ---------------------------------------------------- glm: <tool_call>NAME<arg_key>K</arg_key><arg_value>V ...
_GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _split_glm(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return text, []
    calls = []
    for block in TOOL_CALL_RE.findall(text):
        first = block.find("<arg_key>")
        name = (block if first < 0 else block[:first]).strip()
        pairs = [] if first < 0 else _GLM_ARG_RE.findall(block[first:])
        calls.append(ParsedToolCall(name=name, arguments={k.strip(): _json_or_text(v) for k, v in pairs}))
    content = re.sub(r"^\s*<think>.*?</think>", "", text[: text.find("<tool_call>")], flags=re.DOTALL)
    return re.sub(r"^\s*</think>", "", content), calls


# ---------------------------------------------------------------- seed: <seed:tool_call><function=NAME> ...
_SEED_BLOCK_RE = re.compile(r"<seed:tool_call>(.*?)</seed:tool_call>", re.DOTALL)
_SEED_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>\s*(.*?)</function>", re.DOTALL)
_SEED_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _split_seed(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if "<seed:tool_call>" not in text or "</seed:tool_call>" not in text:
        return text, []
    calls = []
    for block in _SEED_BLOCK_RE.findall(text):
        found = _SEED_FUNCTION_RE.search(block)  # one function per block, as verl reads it
        if found is None:
            calls.append(ParsedToolCall(error=f"no <function=NAME>...</function> in the tool call: {_snippet(block)}"))
            continue
        pairs = _SEED_PARAMETER_RE.findall(found.group(2))
        calls.append(ParsedToolCall(name=found.group(1).strip(),
                                    arguments={k.strip(): _json_or_text(v) for k, v in pairs}))  # fmt: skip
    return text[: text.find("<seed:tool_call>")], calls


# ----------------------------------------------------- minimax: <minimax:tool_call><invoke name="NAME"> ...
_MINIMAX_BLOCK_RE = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_MINIMAX_INVOKE_RE = re.compile(r'<invoke name="([^"]+)">\s*(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAMETER_RE = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _split_minimax(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if "<minimax:tool_call>" not in text or "</minimax:tool_call>" not in text:
        return text, []
    calls = []
    for block in _MINIMAX_BLOCK_RE.findall(text):
        for name, body in _MINIMAX_INVOKE_RE.findall(block):
            pairs = _MINIMAX_PARAMETER_RE.findall(body)
            calls.append(ParsedToolCall(name=name.strip(), arguments={k.strip(): _json_or_text(v) for k, v in pairs}))
    return text[: text.find("<minimax:tool_call>")], calls


# --------------------------------------- kimi: <|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>
_KIMI_SECTION = "<|tool_calls_section_begin|>"
_KIMI_CALL_RE = re.compile(
    r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL
)


def _kimi_tool_name(call_id: str, arguments: dict, tools: list | None) -> str:
    """The tool a kimi call id names: the id itself when it is a tool name, else the one tool whose name is
    in the id (`functions.get_weather:0`), else the one tool whose required parameters were all given."""
    if not tools:
        return call_id
    functions = _functions(tools)
    names = [_field(fn, "name") for fn in functions]
    if call_id in names:
        return call_id
    in_id = [n for n in names if n.lower() in call_id.lower().replace("-", "_")]
    if len(in_id) == 1:
        return in_id[0]
    fitting = [_field(fn, "name") for fn in functions
               if (req := set(_field(_field(fn, "parameters") or {}, "required") or [])) and req <= set(arguments)]  # fmt: skip
    return fitting[0] if len(fitting) == 1 else call_id


def _split_kimi(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    if _KIMI_SECTION not in text:
        return text, []
    calls = []
    for raw_id, raw_arguments in _KIMI_CALL_RE.findall(text):
        call_id, error = raw_id.strip(), None
        try:
            arguments = json.loads(raw_arguments.strip())
        except json.JSONDecodeError as err:
            arguments, error = {}, f"arguments of {call_id!r} are not valid JSON ({err.msg})"
        if not isinstance(arguments, dict):
            arguments, error = {}, f"arguments of {call_id!r} must be a JSON object"
        if error:
            logger.warning(f"kimi tool call: {error}; passing empty arguments on")
        name = _kimi_tool_name(call_id, arguments, tools)
        calls.append(ParsedToolCall(name=name, arguments=arguments, error=error, tool_call_id=call_id))
    return text[: text.find(_KIMI_SECTION)], calls


# ------------------------------------------ deepseek_v4: <｜DSML｜tool_calls><｜DSML｜invoke name="NAME"> ...
_DSML = "｜DSML｜"
_DSML_START = f"<{_DSML}tool_calls>"
_DSML_BLOCK_RE = re.compile(f"<{_DSML}tool_calls>(.*?)</{_DSML}tool_calls>", re.DOTALL)
_DSML_INVOKE_RE = re.compile(f'<{_DSML}invoke name="(.*?)">(.*?)</{_DSML}invoke>', re.DOTALL)
_DSML_PARAMETER_RE = re.compile(f'<{_DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{_DSML}parameter>',
                                re.DOTALL)  # fmt: skip
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


def _dsml_arguments(name: str, body: str) -> dict:
    arguments: dict[str, Any] = {}
    for key, is_string, value in _DSML_PARAMETER_RE.findall(body):
        if is_string == "true":
            arguments[key] = value
            continue
        try:
            arguments[key] = json.loads(value)
        except json.JSONDecodeError:
            logger.warning(f'parameter {key!r} of tool {name!r} is marked string="false" but is no JSON; kept as text')
            arguments[key] = value
    return arguments


def _split_deepseek_v4(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    text = text.replace(DEEPSEEK_EOS, "")
    if _DSML_START not in text:
        return text.rpartition("</think>")[2], []  # the reasoning of a thinking-mode turn is not content
    calls = [ParsedToolCall(name=name, arguments=_dsml_arguments(name, body))
             for block in _DSML_BLOCK_RE.findall(text) for name, body in _DSML_INVOKE_RE.findall(block)]  # fmt: skip
    content = text[: text.index(_DSML_START)].rpartition("</think>")[2]
    return content.removesuffix("\n\n"), calls


# -------------------------------------------------- gemma4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>
_GEMMA_CALL_RE = re.compile(r"<\|tool_call>call:(\w+)\{(.*?)\}<tool_call\|>", re.DOTALL)
_GEMMA_ARG_RE = re.compile(r'(\w+):(?:<\|"\|>(.*?)<\|"\|>|([^,}]*))')
_GEMMA_WORDS = {"true": True, "false": False, "null": None}


def _gemma_value(bare: str) -> Any:
    bare = bare.strip()
    if bare.lower() in _GEMMA_WORDS:
        return _GEMMA_WORDS[bare.lower()]
    for number in (int, float):
        try:
            return number(bare)
        except ValueError:
            pass
    return bare


def _split_gemma4(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    matches = _GEMMA_CALL_RE.findall(text) if "<|tool_call>" in text else []
    if not matches:
        return text, []
    calls = []
    for name, body in matches:
        arguments = {}
        for found in _GEMMA_ARG_RE.finditer(body):
            key, quoted, bare = found.groups()
            if quoted is not None:
                arguments[key] = quoted
            elif bare is not None:
                arguments[key] = _gemma_value(bare)
        calls.append(ParsedToolCall(name=name, arguments=arguments))
    return text[: text.find("<|tool_call>")], calls


# ------------------------------------ gpt-oss (harmony): <|start|>assistant<|channel|>... to=functions.NAME ...
_HARMONY_COT_RE = re.compile(r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
_HARMONY_OPEN_COT_RE = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", re.DOTALL)
_HARMONY_CALL_RE = re.compile(r"<\|start\|>assistant<\|channel\|>[^<]* to=functions\.([^<]+) "
                              r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", re.DOTALL)  # fmt: skip


def _harmony_call(name: str, raw: str) -> ParsedToolCall:
    """verl passes gpt-oss arguments on unchecked (`raw_arguments`); the workflow needs an object."""
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as err:
        return ParsedToolCall(
            name=name, error=f"arguments of {name!r} are not valid JSON ({err.msg})", raw_arguments=raw
        )
    if not isinstance(arguments, dict):
        return ParsedToolCall(name=name, error=f"arguments of {name!r} must be a JSON object", raw_arguments=raw)
    return ParsedToolCall(name=name, arguments=arguments, raw_arguments=raw)


def _split_gpt_oss(text: str, tools: list | None = None) -> tuple[str, list[ParsedToolCall]]:
    text = _HARMONY_OPEN_COT_RE.sub("", _HARMONY_COT_RE.sub("", text))  # calls inside reasoning do not count
    matches = _HARMONY_CALL_RE.findall(text)
    if not matches:
        return text, []
    return _HARMONY_CALL_RE.sub("", text), [_harmony_call(name, raw) for name, raw in matches]


# ----------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls.

    `parse(text, tools=None)` returns the calls of a turn; `stop` is the string that ends a turn's calls (the
    workflow stops generating there so the tools can run); `split(text, tools=None)` returns `(content,
    calls)`, what verl's `ToolParser.extract_tool_calls` returns (None for a format made of `parse` only)."""

    parse: Callable[..., list[ParsedToolCall]]
    stop: str
    split: Callable[..., tuple[str, list[ParsedToolCall]]] | None = None


def _format(split: Callable[..., tuple[str, list[ParsedToolCall]]], stop: str) -> ToolCallFormat:
    def parse(text: str, tools: list | None = None) -> list[ParsedToolCall]:
        return split(text, tools)[1]

    return ToolCallFormat(parse=parse, stop=stop, split=split)


# `actor_rollout_ref.rollout.multi_turn.format` (verl's key, default hermes) -> format; the same names as verl's
# `ToolParser.get_tool_parser(name, tokenizer)`.
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(parse=parse_tool_calls, stop="</tool_call>", split=_split_hermes),
    "qwen3_coder": _format(_split_qwen3, "</tool_call>"),
    "glm": _format(_split_glm, "</tool_call>"),
    "seed": _format(_split_seed, "</seed:tool_call>"),
    "minimax": _format(_split_minimax, "</minimax:tool_call>"),
    "kimi": _format(_split_kimi, "<|tool_calls_section_end|>"),
    "deepseek_v4": _format(_split_deepseek_v4, f"</{_DSML}tool_calls>"),
    "gemma4": _format(_split_gemma4, "<tool_call|>"),
    "gpt-oss": _format(_split_gpt_oss, "<|call|>"),
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
