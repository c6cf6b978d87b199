"""ToolRL's RLLA reward: format + tool-call correctness + optional length, exactly as ToolRL computes it.

Owns `compute_score(solution_str, ground_truth, step=0, **flags) -> (score, format, correctness, length)`
and its parts (`extract_prediction`, `format_reward`, `correctness_reward`, `length_reward`,
`tool_call_reward`, `match_score`). The precise rules are ToolRL's, stated in each function's docstring
(paper: "ToolRL: Reward is All Tool Learning Needs", Qian et al., 2025). Pure Python: imports no
tensors, no Ray, no other verl layer.

Variants are switched by environment variables equal to "1", read at call time: WITHLENGTH,
SCHEDULELENGTH, REFINEDREWARD, COARSEREWARD, CORRECTMAX1, MAX1STEP30MAX3, SCHEDULEREWARD,
INTERMEDIATEREWARD. The same switches may be given as keyword arguments with lower-case names
(`withlength=True`, ...); a keyword that is not None wins over the environment.

Decisions where ToolRL has no defined result (documented, tested):
- A ground truth whose tool-call block does not parse (ToolRL lets `json.JSONDecodeError` escape; the
  real SFT records whose `<think>` mentions `<tool_call>` hit this) raises `ValueError` naming the line
  and how to fix it (pass the answer after `</think>` as the ground truth). A ground-truth call that is
  not `{"name": ..., "parameters": {...}}` raises `ValueError` too: a bad label is a data bug, never
  silently scored.
- A predicted call must be a JSON object with `name` (a JSON scalar) and `parameters` (an object);
  anything else scores the correctness minimum, as the spec says for a missing name/parameters.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

__all__ = [
    "FLAG_NAMES",
    "compute_score",
    "correctness_reward",
    "extract_prediction",
    "format_reward",
    "length_reward",
    "match_score",
    "matches_format",
    "parse_ground_truth_calls",
    "parse_predicted_calls",
    "resolve_flags",
    "tool_call_reward",
]

FLAG_NAMES = (
    "WITHLENGTH",
    "SCHEDULELENGTH",
    "REFINEDREWARD",
    "COARSEREWARD",
    "CORRECTMAX1",
    "MAX1STEP30MAX3",
    "SCHEDULEREWARD",
    "INTERMEDIATEREWARD",
)
STEP_BOUNDARY = 30  # MAX1STEP30MAX3 switches the reward ranges at this step
SCHEDULE_STEPS = 150  # SCHEDULEREWARD interpolates the ranges over this many steps

QWEN_ASSISTANT, QWEN_END = "<|im_start|>assistant", "<|im_end|>"
LLAMA_ASSISTANT, LLAMA_END = "<|start_header_id|>assistant<|end_header_id|>", "<|eot_id|>"

# ToolRL's format patterns by ground-truth category (has <response>, has <tool_call>), for re.search + DOTALL.
# `format_reward` evaluates them through `_FORMAT_PIECES` in linear time (the regex is quadratic on tag soups).
_FORMAT_PATTERNS = {
    (True, False): r"^<think>.*?</think>\n<response>.*?</response>$",
    (False, True): r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>$",
    (True, True): r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>\n<response>.*?</response>$",
    (False, False): r"^<think>.*?</think>$",
}
# The same patterns as literal pieces (head, middles, tail): the text starts with head, holds the middles in
# order after it, and ends with tail (or tail + one "\n", as `$` allows); any text fills the gaps (`.*?`).
_FORMAT_PIECES = {
    (True, False): ("<think>", ("</think>\n<response>",), "</response>"),
    (False, True): ("<think>", ("</think>\n<tool_call>\n",), "\n</tool_call>"),
    (True, True): ("<think>", ("</think>\n<tool_call>\n", "\n</tool_call>\n<response>"), "</response>"),
    (False, False): ("<think>", (), "</think>"),
}
# Tags that must each occur exactly once in the prediction, by category.
_SINGLE_TAGS = {
    (True, False): ("<response>", "</response>"),
    (False, True): ("<tool_call>", "</tool_call>"),
    (True, True): ("<tool_call>", "</tool_call>", "<response>", "</response>"),
    (False, False): (),
}


def resolve_flags(**overrides: bool | None) -> dict[str, bool]:
    """The eight ToolRL switches: keyword (lower-case name) if not None, else env var == "1"."""
    allowed = {name.lower() for name in FLAG_NAMES}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise TypeError(f"unknown rlla reward flag(s) {unknown}; allowed: {sorted(allowed)}")
    flags = {}
    for name in FLAG_NAMES:
        value = overrides.get(name.lower())
        if value is None:
            flags[name] = os.environ.get(name) == "1"
        elif isinstance(value, bool) or value in (0, 1):
            flags[name] = bool(value)
        else:
            raise TypeError(f"rlla flag {name.lower()}={value!r}; allowed: true, false, 1, 0 or None (read ${name})")
    return flags


def extract_prediction(solution_str: str) -> str:
    """The assistant turn: after the last Qwen/Llama-3 assistant header up to its end marker, stripped."""
    if QWEN_ASSISTANT in solution_str:
        solution_str = solution_str.split(QWEN_ASSISTANT)[-1].split(QWEN_END)[0]
    elif LLAMA_ASSISTANT in solution_str:
        solution_str = solution_str.split(LLAMA_ASSISTANT)[-1].split(LLAMA_END)[0]
    return solution_str.strip()


def _category(ground_truth: str) -> tuple[bool, bool]:
    return "<response>" in ground_truth, "<tool_call>" in ground_truth


def format_reward(prediction: str, ground_truth: str, step: int, flags: dict[str, bool]) -> float:
    """1.0 (the maximum) when `prediction` has the tag layout of the ground truth's category, else 0.0."""
    max_r, min_r = 1.0, 0.0
    if flags["MAX1STEP30MAX3"] and step >= STEP_BOUNDARY:
        max_r, min_r = max_r / 2, min_r / 2
    if flags["SCHEDULEREWARD"]:
        max_r = max(2 - (2 - max_r) * step / SCHEDULE_STEPS, 1.0)
        min_r = min(-2 + (2 + min_r) * step / SCHEDULE_STEPS, -1.0)
    category = _category(ground_truth)
    if not matches_format(prediction, category):
        return min_r
    if any(prediction.count(tag) != 1 for tag in _SINGLE_TAGS[category]):
        return min_r
    return max_r


def matches_format(prediction: str, category: tuple[bool, bool]) -> bool:
    """`re.search(_FORMAT_PATTERNS[category], prediction, re.DOTALL)` as a bool, in linear time.

    Taking the earliest occurrence of each middle piece leaves the most room for the rest, so one left-to-right
    scan decides whether the lazy `.*?` gaps can be filled.
    """
    head, middles, tail = _FORMAT_PIECES[category]
    if not prediction.startswith(head):
        return False
    position = len(head)
    for piece in middles:
        found = prediction.find(piece, position)
        if found < 0:
            return False
        position = found + len(piece)
    ends = [len(prediction)] + ([len(prediction) - 1] if prediction.endswith("\n") else [])
    return any(prediction.endswith(tail, 0, end) and end - len(tail) >= position for end in ends)


def _call_block_lines(text: str) -> list[str]:
    """Lines between the first `<tool_call>` and the next `</tool_call>` (or the end), block stripped."""
    return text.split("<tool_call>")[1].split("</tool_call>")[0].strip().split("\n")


def parse_ground_truth_calls(ground_truth: str) -> list[dict[str, Any]]:
    """The ground truth's calls; ValueError naming the line when one is not `{"name", "parameters": {}}`."""
    calls = []
    for number, line in enumerate(_call_block_lines(ground_truth), start=1):
        try:
            call = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"rlla ground truth: line {number} of its <tool_call> block is not JSON ({err}): {line[:200]!r}. "
                "A ground truth whose <think> mentions <tool_call> hits this (ToolRL crashes on it); "
                "pass the answer after </think> as the ground truth."
            ) from None
        if not (isinstance(call, dict) and "name" in call and isinstance(call.get("parameters"), dict)):
            raise ValueError(
                f"rlla ground truth: line {number} of its <tool_call> block is {line[:200]!r}; "
                'each line must be {"name": ..., "parameters": {...}}'
            )
        calls.append(call)
    return calls


def _is_valid_predicted_call(call: Any) -> bool:
    return (
        isinstance(call, dict)
        and "name" in call
        and not isinstance(call["name"], (list, dict))
        and isinstance(call.get("parameters"), dict)
    )


def parse_predicted_calls(prediction: str) -> list[dict[str, Any]] | None:
    """The prediction's calls, or None (scored the minimum) for a missing tag, a non-JSON line or a bad call."""
    if "<tool_call>" not in prediction or "</tool_call>" not in prediction:
        return None
    calls = []
    for line in _call_block_lines(prediction):
        try:
            call = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: brackets nested ~1000 deep
            return None
        if not _is_valid_predicted_call(call):
            return None
        calls.append(call)
    return calls


def match_score(gt_items: list, pd_items: list, refined: bool = False) -> float:
    """1.0 for equal lists (order counts); REFINEDREWARD: else 0.0; else multiset intersection over union."""
    if gt_items == pd_items:
        return 1.0
    if refined or not gt_items or not pd_items:
        return 0.0
    intersection = sum((Counter(gt_items) & Counter(pd_items)).values())
    return intersection / (len(gt_items) + len(pd_items) - intersection)


def _candidate_score(gt_call: dict, pd_call: dict, flags: dict[str, bool]) -> float:
    """Partial credit of one same-name predicted call: key match plus the number of equal values."""
    gt_params, pd_params = gt_call["parameters"], pd_call["parameters"]
    key_score = match_score(list(gt_params.keys()), list(pd_params.keys()), flags["REFINEDREWARD"])
    value_score = sum(1.0 for key, value in gt_params.items() if key in pd_params and pd_params[key] == value)
    return key_score + value_score


def tool_call_reward(
    gt_calls: list[dict], pd_calls: list[dict], max_r: float, min_r: float, flags: dict[str, bool]
) -> float:
    """ToolRL's correctness of `pd_calls` against `gt_calls`, in [min_r, max_r]."""
    if gt_calls == pd_calls:
        return max_r
    if flags["COARSEREWARD"]:
        return min_r
    gt_names = [call["name"] for call in gt_calls]
    pd_names = [call["name"] for call in pd_calls]
    score = match_score(gt_names, pd_names, flags["REFINEDREWARD"])
    max_score = 1.0
    used: set[int] = set()
    for gt_call in gt_calls:
        if flags["INTERMEDIATEREWARD"]:
            max_score += 1.0
        else:
            max_score += 1.0 + len(gt_call["parameters"])
        best_index, best_score = -1, 0.0
        for index, pd_call in enumerate(pd_calls):
            if index in used or pd_call["name"] != gt_call["name"]:
                continue
            if flags["INTERMEDIATEREWARD"]:
                if pd_call == gt_call:
                    best_index, best_score = index, 1.0
                    break
                continue
            candidate = _candidate_score(gt_call, pd_call, flags)
            if candidate > best_score:
                best_index, best_score = index, candidate
        if best_index >= 0:
            used.add(best_index)
            score += best_score
    return (max_r - min_r) * score / max_score + min_r


def correctness_reward(prediction: str, ground_truth: str, step: int, flags: dict[str, bool]) -> float:
    """Tool-call correctness in [-3, 3] (scaled by the flags); 0.0 when the ground truth has no call."""
    max_r, min_r = (1.0, -1.0) if flags["CORRECTMAX1"] else (3.0, -3.0)
    if flags["MAX1STEP30MAX3"] and step < STEP_BOUNDARY:
        max_r, min_r = max_r / 3, min_r / 3
    if flags["SCHEDULEREWARD"]:
        max_r = min((max_r - 2) * step / SCHEDULE_STEPS + 2, 3.0)
        min_r = max((min_r + 2) * step / SCHEDULE_STEPS - 2, -3.0)
    if "<tool_call>" not in ground_truth:
        return 0.0
    gt_calls = parse_ground_truth_calls(ground_truth)
    pd_calls = parse_predicted_calls(prediction)
    if pd_calls is None:
        return min_r
    return tool_call_reward(gt_calls, pd_calls, max_r, min_r, flags)


def length_reward(prediction: str, step: int, flags: dict[str, bool]) -> float | int:
    """Think length in words over L (512, or 384 + 256*step/105 with SCHEDULELENGTH), rounded, capped at 1.

    Returns the integer 0 when WITHLENGTH is off (as ToolRL does).
    """
    if not flags["WITHLENGTH"]:
        return 0
    if "<think>" not in prediction or "</think>" not in prediction:
        return 0.0
    think = prediction.split("<think>")[-1].split("</think>")[0].strip()
    max_len = 384 + 256 * step / 105 if flags["SCHEDULELENGTH"] else 512
    return min(round(len(think.split()) / max_len, 2), 1.0)


def compute_score(
    solution_str: str, ground_truth: str, step: int = 0, **flags: bool | None
) -> tuple[float, float, float, float | int]:
    """ToolRL's reward of one response: `(score, format, correctness, length)`, score the sum of the parts.

    Args:
        solution_str: the response, bare or with its prompt and Qwen / Llama-3 chat markers.
        ground_truth: the reference answer (`<think>`, `<tool_call>` JSON lines and/or `<response>`).
        step: the training step (schedules of SCHEDULEREWARD, SCHEDULELENGTH, MAX1STEP30MAX3).
        **flags: lower-case ToolRL switches (`withlength=True`, ...); None or absent = read the env var.
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"rlla solution_str must be a str, got {type(solution_str).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(f"rlla ground_truth must be a str, got {type(ground_truth).__name__}: {ground_truth!r:.200}")
    resolved = resolve_flags(**flags)
    prediction = extract_prediction(solution_str)
    fmt = format_reward(prediction, ground_truth, step, resolved)
    correctness = correctness_reward(prediction, ground_truth, step, resolved)
    length = length_reward(prediction, step, resolved)
    return fmt + correctness + length, fmt, correctness, length
