"""GSM8K (strict / flexible final number) and MATH (boxed answer, normalised) rewards."""

import json
import os
import re

import pytest

from verl.utils.reward_score import default_compute_score, gsm8k, math_reward

SHARED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "..", "shared"
)
GSM8K_DIR = os.path.join(SHARED, "data", "gsm8k")  # ../shared beside the repository


def _gsm8k_rows(split: str) -> list[dict]:
    path = os.path.join(GSM8K_DIR, f"{split}.jsonl")
    if not os.path.exists(path):
        pytest.skip(f"real GSM8K data not found at {path}")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _corrupt(answer: str) -> str:
    """The same worked answer with its final number changed (N -> N + 1, digits kept with commas)."""
    head, number = answer.rsplit("#### ", 1)
    value = int(number.replace(",", "").strip())
    return f"{head}#### {value + 1}"


@pytest.mark.parametrize("split", ["train", "test"])
def test_real_gsm8k_answers_score_one_and_corrupted_ones_zero(split):
    rows = _gsm8k_rows(split)
    assert len(rows) == {"train": 7473, "test": 1319}[split]
    for row in rows:
        truth = gsm8k.extract_ground_truth(row["answer"])
        assert re.fullmatch(r"-?\d+", truth), truth  # "1,000" style labels are normalised
        assert gsm8k.compute_score(row["answer"], truth) == 1.0
        assert gsm8k.compute_score(row["answer"], truth, method="flexible") == 1.0
        corrupted = _corrupt(row["answer"])
        assert gsm8k.compute_score(corrupted, truth) == 0.0
        assert gsm8k.compute_score(corrupted, truth, format_score=0.1) == 0.1
    first = rows[0]
    truth = gsm8k.extract_ground_truth(first["answer"])
    assert default_compute_score("openai/gsm8k", first["answer"], truth) == 1.0


def test_gsm8k_strict_and_flexible_extraction():
    assert gsm8k.extract_solution("so #### 1,234.") == "1234"
    assert gsm8k.extract_solution("first #### 3 then #### $5") == "3"  # "$5" is not a number right after "#### "
    assert gsm8k.extract_solution("first #### 3 then #### 5") == "5"
    assert gsm8k.extract_solution("the answer is 42.") is None
    assert gsm8k.extract_solution("the answer is 42.", method="flexible") == "42"
    assert gsm8k.extract_solution("costs -7 dollars, then .", method="flexible") == "-7"  # "," and "." skipped
    assert gsm8k.compute_score("answer: 18", "18") == 0.0  # strict needs "#### "
    assert gsm8k.compute_score("answer: 18", "18", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 17", "18", score=2.0, format_score=0.5) == 0.5
    long = "#### 5 " + "x" * 400 + " #### 6"  # only the last 300 characters are searched
    assert gsm8k.extract_solution(long) == "6"
    with pytest.raises(ValueError, match="allowed: \\('strict', 'flexible'\\)"):
        gsm8k.extract_solution("#### 1", method="loose")
    with pytest.raises(ValueError, match="no '#### N' line"):
        gsm8k.extract_ground_truth("no marker")


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{5 \\text{ cm}}", "5", 1.0),
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{c}", 0.0),
        ("\\boxed{5.0}", "5", 1.0),
        ("\\boxed 7 is it", "7", 1.0),
        ("\\fbox{3}", "3", 1.0),
        ("no box: 5", "5", 0.0),
        ("unclosed \\boxed{5", "5", 0.0),
        ("\\boxed{\\{1, 2\\}}", "\\boxed{\\{1,2\\}}", 1.0),  # a boxed label is unboxed; nested braces
    ],
)
def test_math_boxed_answers(solution, truth, expected):
    assert math_reward.compute_score(solution, truth) == expected
    assert default_compute_score("lighteval/MATH", solution, truth) == expected


def test_math_helpers():
    assert math_reward.last_boxed_only_string("a \\boxed{b{c}} d") == "\\boxed{b{c}}"
    assert math_reward.remove_boxed("\\boxed{b{c}}") == "b{c}"
    with pytest.raises(ValueError, match="not a boxed expression"):
        math_reward.remove_boxed("b")
    assert math_reward.strip_string(" \\dfrac{1}{2} ") == "\\frac{1}{2}"
    assert math_reward.strip_string("\\frac1{2}") == "\\frac{1}{2}"
    assert math_reward.strip_string(".25") == "0.25"
    assert math_reward.is_equiv("2", "2.000")
    assert not math_reward.is_equiv("2", "3")


def test_unknown_data_source_names_the_known_ones_and_the_plug_in():
    with pytest.raises(ValueError) as err:
        default_compute_score("my/new_set", "x", "y")
    message = str(err.value)
    assert "'my/new_set'" in message and "openai/gsm8k" in message and "rlla" in message
    assert "custom_reward_function.path" in message and "custom_reward_function.name" in message


def test_kwargs_reach_the_scorer_and_step_only_rlla():
    assert default_compute_score("openai/gsm8k", "answer 18", "18", method="flexible", step=7) == 1.0
    with pytest.raises(TypeError):
        default_compute_score("openai/gsm8k", "#### 18", "18", withlength=True)
