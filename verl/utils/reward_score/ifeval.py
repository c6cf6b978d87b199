"""IFEval-style instruction-following reward: check a response against a list of verifiable constraints.

Owns `CONSTRAINTS` (name -> checker), `parse_instructions(ground_truth)`, `check(text, instruction)` and
`compute_score(solution_str, ground_truth, extra_info=None, strict=False) -> dict`. Layer 3: pure functions of
strings, standard library only.

Ground truth schema (a dict, a list, or the JSON text of either):

    {"instructions": [{"type": "word_count", "min": 20, "max": 60},
                      {"type": "keywords", "include": ["ocean"], "exclude": ["sky"]},
                      {"type": "json_format"}]}

or just the list. Each instruction is a dict with a `type` and that type's parameters:

| type               | parameters                              | followed when                                          |
|--------------------|-----------------------------------------|--------------------------------------------------------|
| word_count         | min, max (at least one)                 | min <= whitespace-separated words <= max               |
| sentence_count     | min, max                                | min <= sentences (text split after . ! ?) <= max       |
| paragraph_count    | min, max                                | min <= paragraphs (blocks between blank lines) <= max  |
| keywords           | include, exclude (lists; at least one)  | every `include` word present, no `exclude` word (case-insensitive, whole words) |
| keyword_frequency  | keyword, min, max                       | min <= occurrences of the keyword (whole word, any case) <= max |
| json_format        | -                                       | the response (``` fences removed) parses as JSON       |
| starts_with        | text                                    | the stripped response starts with `text`               |
| ends_with          | text                                    | the stripped response ends with `text`                 |
| lowercase          | -                                       | no uppercase letter                                    |
| uppercase          | -                                       | no lowercase letter                                    |
| no_commas          | -                                       | no ","                                                 |
| bullet_points      | count                                   | exactly `count` lines start with "* " or "- "          |
| placeholders       | min                                     | at least `min` placeholders like [address]             |
| title              | -                                       | a title wrapped in double angle brackets, <<like this>> |
| quotation          | -                                       | the stripped response starts and ends with a double quote |

Result: `{"score", "acc", "instruction_acc"}`: `instruction_acc` is the share of instructions followed
(IFEval's instruction-level accuracy), `acc` is 1.0 when all are followed (prompt-level strict accuracy),
and `score` is `instruction_acc` (a denser reward), or `acc` with `strict=True`. A malformed ground truth
(unknown type, missing or unknown parameter) raises ValueError naming it and what is allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["CONSTRAINTS", "check", "compute_score", "parse_instructions"]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_TITLE = re.compile(r"<<[^<>\n]+>>")


def _words(text: str) -> int:
    return len(text.split())


def _sentences(text: str) -> int:
    return len([s for s in _SENTENCE_END.split(text.strip()) if s.strip()])


def _paragraphs(text: str) -> int:
    return len([p for p in _PARAGRAPH_BREAK.split(text.strip()) if p.strip()])


def _occurrences(text: str, word: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE))


def _in_range(value: int, min: int | None = None, max: int | None = None) -> bool:
    return (min is None or value >= min) and (max is None or value <= max)


def _keywords(text: str, include: list[str] | None = None, exclude: list[str] | None = None) -> bool:
    return all(_occurrences(text, w) > 0 for w in include or []) and not any(
        _occurrences(text, w) > 0 for w in exclude or []
    )


def _json_format(text: str) -> bool:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a response nesting brackets ~1000 deep
        return False
    return True


def _bullets(text: str, count: int) -> int:
    return sum(1 for line in text.splitlines() if line.lstrip().startswith(("* ", "- "))) == count


# name -> (checker(text, **params) -> bool, required params, optional params)
CONSTRAINTS: dict[str, tuple[Callable[..., bool], tuple[str, ...], tuple[str, ...]]] = {
    "word_count": (lambda t, **p: _in_range(_words(t), **p), (), ("min", "max")),
    "sentence_count": (lambda t, **p: _in_range(_sentences(t), **p), (), ("min", "max")),
    "paragraph_count": (lambda t, **p: _in_range(_paragraphs(t), **p), (), ("min", "max")),
    "keywords": (_keywords, (), ("include", "exclude")),
    "keyword_frequency": (
        lambda t, keyword, **p: _in_range(_occurrences(t, keyword), **p),
        ("keyword",),
        ("min", "max"),
    ),
    "json_format": (_json_format, (), ()),
    "starts_with": (lambda t, text: t.strip().startswith(text), ("text",), ()),
    "ends_with": (lambda t, text: t.strip().endswith(text), ("text",), ()),
    "lowercase": (lambda t: t == t.lower(), (), ()),
    "uppercase": (lambda t: t == t.upper(), (), ()),
    "no_commas": (lambda t: "," not in t, (), ()),
    "bullet_points": (_bullets, ("count",), ()),
    "placeholders": (lambda t, min: len(_PLACEHOLDER.findall(t)) >= min, ("min",), ()),
    "title": (lambda t: _TITLE.search(t) is not None, (), ()),
    "quotation": (lambda t: len(t.strip()) >= 2 and t.strip()[0] == '"' and t.strip()[-1] == '"', (), ()),
}
# types whose optional parameters must not all be missing
_NEEDS_ONE_OPTIONAL = ("word_count", "sentence_count", "paragraph_count", "keywords", "keyword_frequency")


def _check_instruction(instruction: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(instruction, dict) or "type" not in instruction:
        raise ValueError(f"ifeval {where}: an instruction must be a dict with a 'type', got {instruction!r:.200}")
    kind = instruction["type"]
    if kind not in CONSTRAINTS:
        raise ValueError(f"ifeval {where}: unknown instruction type {kind!r}; allowed: {sorted(CONSTRAINTS)}")
    _, required, optional = CONSTRAINTS[kind]
    params = {k: v for k, v in instruction.items() if k != "type"}
    unknown = sorted(set(params) - set(required) - set(optional))
    missing = [k for k in required if params.get(k) is None]
    if unknown or missing:
        raise ValueError(
            f"ifeval {where} ({kind}): unknown parameters {unknown}, missing {missing}; "
            f"required {list(required)}, optional {list(optional)}"
        )
    if kind in _NEEDS_ONE_OPTIONAL and all(params.get(k) is None for k in optional):
        raise ValueError(f"ifeval {where} ({kind}): give at least one of {list(optional)}")
    return kind, {k: v for k, v in params.items() if v is not None}


def parse_instructions(ground_truth: Any) -> list[dict[str, Any]]:
    """The checked instruction list of a ground truth (dict with "instructions", list, or JSON of either)."""
    value = ground_truth
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"ifeval ground truth is not JSON: {ground_truth!r:.200}") from err
    if isinstance(value, dict):
        value = value.get("instructions")
    if hasattr(value, "tolist"):  # a numpy array from a parquet column
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"ifeval ground truth must be a non-empty list of instructions or {{'instructions': [...]}}, "
            f"got {ground_truth!r:.200}"
        )
    instructions = []
    for i, instruction in enumerate(value):
        kind, params = _check_instruction(instruction, f"instruction {i}")
        instructions.append({"type": kind, **params})
    return instructions


def check(text: str, instruction: dict[str, Any]) -> bool:
    """Whether `text` follows one (checked) instruction."""
    kind, params = _check_instruction(instruction, "instruction")
    return bool(CONSTRAINTS[kind][0](text, **params))


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, strict: bool = False
) -> dict[str, float]:
    """{"score", "acc", "instruction_acc"} of `solution_str` against the instructions in `ground_truth`."""
    instructions = parse_instructions(ground_truth)
    followed = [check(solution_str, instruction) for instruction in instructions]
    instruction_acc = sum(followed) / len(followed)
    acc = float(all(followed))
    return {"score": acc if strict else instruction_acc, "acc": acc, "instruction_acc": instruction_acc}
