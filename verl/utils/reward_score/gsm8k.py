"""GSM8K reward: the final number of a solution against the reference, as verl scores "openai/gsm8k".

Owns `extract_solution(solution_str, method)`, `extract_ground_truth(answer)` and
`compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)`.
Pure Python: no tensors, no Ray.

Methods (verl's): "strict" takes the number after the last `#### `; "flexible" takes the last number in
the text. Only the last 300 characters are searched (verl clips long solutions the same way). Commas and
`$` are removed from both sides. Unlike verl, a trailing "." is removed too ("#### 18." reads as "18") and
"flexible" skips matches without a digit (verl would take a lone "," as the answer).
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_ground_truth", "extract_solution"]

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("strict", "flexible")


def _normalize_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The solution's final number as a string (commas removed), or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r}; allowed: {METHODS}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return _normalize_number(found[-1]) if found else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if any(char.isdigit() for char in candidate):
            return _normalize_number(candidate)
    return None


def extract_ground_truth(answer: str) -> str:
    """The reference number of a GSM8K `answer` field (worked steps ending in `#### N`)."""
    if "####" not in answer:
        raise ValueError(f"gsm8k answer has no '#### N' line: {answer[-200:]!r}")
    return _normalize_number(answer.split("####")[-1])


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if one was found, else 0.0."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == _normalize_number(str(ground_truth)) else format_score
