"""MATH reward: the last `\\boxed{...}` answer of a solution against the reference, after normalisation.

Owns `last_boxed_only_string`, `remove_boxed`, `strip_string` (the Hendrycks MATH normaliser: fracs,
sqrt, units, degrees, dollars, percent, "x = " prefixes, 0.5 -> \\frac{1}{2}), `is_equiv` and
`compute_score(solution_str, ground_truth) -> 1.0 | 0.0`. When the optional `math_verify` package is
installed it decides equivalence (symbolic); otherwise the normaliser plus a numeric comparison does.
Named `math_reward` so that it never shadows the standard `math` module. Pure Python: no tensors, no Ray.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "remove_boxed", "strip_string"]


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) in `text` with balanced braces, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        rest = text[start + len("\\boxed ") :]
        return "\\boxed " + re.split(r"[\s$]", rest, maxsplit=1)[0]
    depth = 0
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start : pos + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """`\\boxed{X}` / `\\fbox{X}` / `\\boxed X` -> `X`; ValueError for anything else."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    for prefix in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix) and boxed.endswith("}"):
            return boxed[len(prefix) : -1]
    raise ValueError(f"not a boxed expression: {boxed[:100]!r} (expected \\boxed{{...}} or \\fbox{{...}})")


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return text
        numerator, rest = part[0], part[1:]
        if rest[0] == "{":
            out += "{" + numerator + "}" + rest
        else:
            out += "{" + numerator + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_a_slash_b(text: str) -> str:
    """`3/4` (two integers) -> `\\frac{3}{4}`."""
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", text)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else text


def _fix_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)


def _remove_right_units(text: str) -> str:
    """`5 \\text{ cm}` -> `5`."""
    if "\\text{ " in text:
        return text.split("\\text{ ")[0]
    return text


def strip_string(text: str) -> str:
    """Normalise a MATH answer string so that equivalent answers compare equal as strings."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "")
    text = _remove_right_units(text)
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    lhs_rhs = text.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0].strip()) <= 2:
        text = lhs_rhs[1]
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _math_verify_equiv(answer: str, ground_truth: str) -> bool | None:
    """math_verify's verdict when that package is installed, else None."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        return bool(verify(parse(f"${ground_truth}$"), parse(f"${answer}$")))
    except Exception:  # math_verify raises on unparsable LaTeX: fall back to the normaliser
        return None


def is_equiv(answer: str | None, ground_truth: str | None) -> bool:
    """Whether two answer strings are equivalent (math_verify if installed, else normalised string/number)."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    verdict = _math_verify_equiv(answer, ground_truth)
    if verdict is not None:
        return verdict
    a, b = strip_string(answer), strip_string(ground_truth)
    if a == b:
        return True
    num_a, num_b = _as_number(a), _as_number(b)
    return num_a is not None and num_b is not None and abs(num_a - num_b) <= 1e-9 * max(1.0, abs(num_b))


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer of `solution_str` is equivalent to `ground_truth`, else 0.0.

    A `ground_truth` that is itself boxed (`\\boxed{3}`) is unboxed first.
    """
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    reference = ground_truth
    if (ref_boxed := last_boxed_only_string(ground_truth)) is not None:
        reference = remove_boxed(ref_boxed)
    return 1.0 if is_equiv(remove_boxed(boxed), reference) else 0.0
