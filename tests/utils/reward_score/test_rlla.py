"""ToolRL's RLLA reward: real records score the maximum, perturbations score what the spec's formulas give.

Every expected value below is worked out by hand from ToolRL's reward rules (verl/utils/reward_score/rlla.py's
docstrings, ToolRL's paper); the derivation is written next to it.
"""

import json
import os

import pytest

from verl.utils.reward_score import default_compute_score
from verl.utils.reward_score.rlla import (
    FLAG_NAMES,
    compute_score,
    extract_prediction,
    match_score,
    resolve_flags,
)

SHARED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "..", "shared"
)
RLLA_PATH = os.path.join(SHARED, "data", "rlla", "rlla_sft.json")  # ../shared beside the repository


@pytest.fixture(autouse=True)
def _no_flags_from_the_environment(monkeypatch):
    for name in FLAG_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def rlla_records():
    if not os.path.exists(RLLA_PATH):
        pytest.skip(f"real RLLA data not found at {RLLA_PATH}")
    with open(RLLA_PATH, encoding="utf-8") as handle:
        return json.load(handle)


def _think_mentions_tags(output: str) -> bool:
    return "<tool_call>" in output.split("</think>")[0]


# ------------------------------------------------------------------------------------------ real data
def test_every_real_record_scores_the_maximum_against_itself(rlla_records):
    assert len(rlla_records) == 400
    clean = [r["output"] for r in rlla_records if not _think_mentions_tags(r["output"])]
    assert len(clean) == 383
    for output in clean:
        score, fmt, correctness, length = compute_score(output, output)
        assert fmt == 1.0, output[-300:]
        assert correctness == (3.0 if "<tool_call>" in output else 0.0)  # no call in the label: 0 whatever
        assert length == 0
        assert score == fmt + correctness
    assert sum("<tool_call>" in o for o in clean) == 329


def test_real_records_whose_think_mentions_tool_call(rlla_records):
    """Documented decision: such a label raises ValueError (ToolRL crashes); its answer part is a fine label.

    Scored against the answer after </think>, the full output (whose think mentions <tool_call>) gets
    format 0 (the tag occurs twice) and correctness -3 (the first <tool_call> opens prose, not JSON),
    which is ToolRL's verdict on such a prediction.
    """
    odd = [r["output"] for r in rlla_records if _think_mentions_tags(r["output"])]
    assert len(odd) == 17
    for output in odd:
        with pytest.raises(ValueError, match="not JSON.*pass the answer after </think>"):
            compute_score(output, output)
        answer = output.split("</think>")[-1].strip()
        assert compute_score(output, answer) == (-3.0, 0.0, -3.0, 0)
        # a prediction that keeps the think free of tags scores the maximum against that label
        clean_prediction = "<think> plan the calls </think>\n" + answer
        assert compute_score(clean_prediction, answer) == (4.0, 1.0, 3.0, 0)


def test_chat_marker_extraction_on_a_real_record(rlla_records):
    record = rlla_records[0]
    output = record["output"]
    qwen = (
        f"<|im_start|>system\n{record['instruction']}<|im_end|>\n<|im_start|>user\n{record['input']}<|im_end|>\n"
        f"<|im_start|>assistant\n{output}<|im_end|>\n"
    )
    llama = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"{record['instruction']}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{record['input']}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{output}<|eot_id|>"
    )
    for wrapped in (qwen, llama):
        assert extract_prediction(wrapped) == output
        assert compute_score(wrapped, output) == (4.0, 1.0, 3.0, 0)


def test_extraction_takes_the_last_assistant_turn():
    text = "<|im_start|>assistant\nold<|im_end|><|im_start|>user\nq<|im_end|><|im_start|>assistant\n  new  "
    assert extract_prediction(text) == "new"
    assert extract_prediction("  bare text \n") == "bare text"


# ------------------------------------------------------------------------------------------ hand-made cases
THINK = "<think> The user wants weather and time. </think>\n"
GW = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}
GT_TIME = {"name": "get_time", "parameters": {"tz": "CET"}}


def calls(*items) -> str:
    return "<tool_call>\n" + "\n".join(json.dumps(item) for item in items) + "\n</tool_call>"


LABEL = THINK + calls(GW, GT_TIME)
# Smax = 1 (names) + (1 + 2 params) + (1 + 1 param) = 6;  correctness = 6 * S / 6 - 3 = S - 3


def test_exact_answer():
    assert compute_score(LABEL, LABEL) == (4.0, 1.0, 3.0, 0)


def test_wrong_value():
    # names equal: 1; get_weather keys equal 1 + one equal value 1 = 2; get_time 1 + 1 = 2 -> S = 5
    pred = THINK + calls({"name": "get_weather", "parameters": {"city": "Paris", "unit": "F"}}, GT_TIME)
    assert compute_score(pred, LABEL) == pytest.approx((3.0, 1.0, 2.0, 0))


def test_dropped_parameter():
    # get_weather keys [city, unit] vs [city]: 1 / (2 + 1 - 1) = 0.5, plus city equal 1 -> 1.5; S = 1 + 1.5 + 2
    pred = THINK + calls({"name": "get_weather", "parameters": {"city": "Paris"}}, GT_TIME)
    assert compute_score(pred, LABEL) == pytest.approx((2.5, 1.0, 1.5, 0))


def test_extra_call():
    # names [w, t] vs [w, t, n]: 2 / (2 + 3 - 2) = 2/3; both calls exact 3 + 2 -> S = 17/3, corr = 8/3
    pred = THINK + calls(GW, GT_TIME, {"name": "get_news", "parameters": {"topic": "x"}})
    assert compute_score(pred, LABEL) == pytest.approx((1 + 8 / 3, 1.0, 8 / 3, 0))


def test_wrong_tool_name():
    # names [w, t] vs [f, t]: 1/3; get_weather has no same-name candidate (0); get_time 2 -> S = 7/3
    pred = THINK + calls({"name": "get_forecast", "parameters": GW["parameters"]}, GT_TIME)
    assert compute_score(pred, LABEL) == pytest.approx((1 - 2 / 3, 1.0, -2 / 3, 0))


def test_swapped_call_order_gets_full_partial_credit():
    # lists differ, but names match as multisets (1.0) and each call finds its twin: S = 6 -> 3.0
    pred = THINK + calls(GT_TIME, GW)
    assert compute_score(pred, LABEL) == pytest.approx((4.0, 1.0, 3.0, 0))


def test_broken_json_and_blank_line_and_missing_tags_give_the_minimum():
    broken = THINK + '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"\n</tool_call>'
    assert compute_score(broken, LABEL) == (-2.0, 1.0, -3.0, 0)  # the format only looks at tags
    blank = THINK + "<tool_call>\n" + json.dumps(GW) + "\n\n" + json.dumps(GT_TIME) + "\n</tool_call>"
    assert compute_score(blank, LABEL)[2] == -3.0
    assert compute_score(THINK + "no call at all", LABEL) == (-3.0, 0.0, -3.0, 0)
    no_params = THINK + calls({"name": "get_weather"}, GT_TIME)
    assert compute_score(no_params, LABEL)[2] == -3.0
    dropped_call = THINK + calls(GT_TIME)
    # names [w, t] vs [t]: 1 / (2 + 1 - 1) = 0.5; get_weather unmatched 0; get_time 2 -> S = 2.5 -> -0.5
    assert compute_score(dropped_call, LABEL) == pytest.approx((0.5, 1.0, -0.5, 0))
    list_params = THINK + calls({"name": "get_time", "parameters": ["CET"]})
    assert compute_score(list_params, LABEL)[2] == -3.0


def test_missing_think_block():
    # format needs ^<think>: 0; the calls are exact: 3
    assert compute_score(calls(GW, GT_TIME), LABEL) == (3.0, 0.0, 3.0, 0)


def test_value_equality_is_python_equality():
    label = THINK + calls({"name": "f", "parameters": {"n": 1}})
    as_float = THINK + calls({"name": "f", "parameters": {"n": 1.0}})
    as_string = THINK + calls({"name": "f", "parameters": {"n": "1"}})
    assert compute_score(as_float, label)[2] == 3.0  # 1 == 1.0: the lists are equal
    # Smax = 1 + (1 + 1) = 3; names 1 + keys 1 + value 0 -> S = 2 -> 6 * 2/3 - 3 = 1
    assert compute_score(as_string, label)[2] == pytest.approx(1.0)


def test_format_by_ground_truth_category():
    response_label = "<think> a </think>\n<response> Hello </response>"
    assert compute_score("<think> b </think>\n<response> Hi </response>", response_label) == (1.0, 1.0, 0.0, 0)
    for bad in (
        "<think> b </think>\r\n<response> Hi </response>",  # CRLF
        "<think> b </think>\n\n<response> Hi </response>",  # blank line
        "<think> b </think> \n<response> Hi </response>",  # space after </think>
        "<think> b </think>\n<response> Hi </response><response> again </response>",  # two responses
        "<think> b </think>\n" + calls(GW),  # a call where a response was expected
    ):
        assert compute_score(bad, response_label)[:3] == (0.0, 0.0, 0.0), bad
    both_label = LABEL + "\n<response> Done </response>"
    assert compute_score(LABEL + "\n<response> ok </response>", both_label) == (4.0, 1.0, 3.0, 0)
    assert compute_score(LABEL, both_label)[1] == 0.0
    neither_label = "<think> nothing to do </think>"
    assert compute_score("<think> x </think>", neither_label) == (1.0, 1.0, 0.0, 0)
    assert compute_score("<think> x </think>\n<response> y </response>", neither_label)[1] == 0.0


def test_match_score():
    assert match_score(["a", "b"], ["a", "b"]) == 1.0
    assert match_score(["a", "a", "b"], ["a", "c"]) == pytest.approx(1 / 4)  # 1 / (3 + 2 - 1)
    assert match_score([], ["a"]) == 0.0
    assert match_score(["a", "b"], ["b", "a"]) == 1.0
    assert match_score(["a", "b"], ["b", "a"], refined=True) == 0.0


# ------------------------------------------------------------------------------------------ flag variants
WRONG_VALUE = THINK + calls({"name": "get_weather", "parameters": {"city": "Paris", "unit": "F"}}, GT_TIME)
DROPPED = THINK + calls({"name": "get_weather", "parameters": {"city": "Paris"}}, GT_TIME)


def _think(words: int) -> str:
    return "<think> " + " ".join(["w"] * words) + " </think>\n" + calls(GW, GT_TIME)


def test_withlength(monkeypatch):
    monkeypatch.setenv("WITHLENGTH", "1")
    assert compute_score(_think(64), LABEL) == pytest.approx((4.12, 1.0, 3.0, 0.12))  # round(0.125, 2) = 0.12
    assert compute_score(_think(64), LABEL)[3] == 0.12
    assert compute_score(_think(600), LABEL)[3] == 1.0  # 600/512 capped at 1
    assert compute_score(calls(GW, GT_TIME), LABEL)[3] == 0.0  # no think
    monkeypatch.setenv("SCHEDULELENGTH", "1")
    assert compute_score(_think(64), LABEL, step=0)[3] == 0.17  # L = 384: 0.1666 -> 0.17
    assert compute_score(_think(64), LABEL, step=105)[3] == 0.1  # L = 384 + 256 = 640
    monkeypatch.setenv("WITHLENGTH", "0")
    assert compute_score(_think(64), LABEL, step=105)[3] == 0


def test_refinedreward(monkeypatch):
    monkeypatch.setenv("REFINEDREWARD", "1")
    # keys [city, unit] vs [city] -> 0 instead of 0.5: get_weather 0 + 1 = 1; S = 1 + 1 + 2 = 4 -> 1.0
    assert compute_score(DROPPED, LABEL)[2] == pytest.approx(1.0)
    # order now counts for names: 0; each call still matches fully: S = 0 + 3 + 2 = 5 -> 2.0
    assert compute_score(THINK + calls(GT_TIME, GW), LABEL)[2] == pytest.approx(2.0)


def test_coarsereward(monkeypatch):
    monkeypatch.setenv("COARSEREWARD", "1")
    assert compute_score(WRONG_VALUE, LABEL)[2] == -3.0
    assert compute_score(LABEL, LABEL)[2] == 3.0


def test_correctmax1(monkeypatch):
    monkeypatch.setenv("CORRECTMAX1", "1")
    assert compute_score(WRONG_VALUE, LABEL)[2] == pytest.approx(2 * 5 / 6 - 1)  # S = 5 of 6 in [-1, 1]
    assert compute_score(THINK, LABEL)[2] == -1.0


def test_max1step30max3(monkeypatch):
    monkeypatch.setenv("MAX1STEP30MAX3", "1")
    # before step 30 correctness lives in [-1, 1], format in [0, 1]
    assert compute_score(WRONG_VALUE, LABEL, step=29) == pytest.approx((1 + 2 / 3, 1.0, 2 / 3, 0))
    # from step 30: correctness back to [-3, 3], format halved to [0, 0.5]
    assert compute_score(WRONG_VALUE, LABEL, step=30) == pytest.approx((2.5, 0.5, 2.0, 0))


def test_schedulereward(monkeypatch):
    monkeypatch.setenv("SCHEDULEREWARD", "1")
    # step 0: format [-2, 2], correctness [-2, 2]; S = 5/6 -> 4 * 5/6 - 2 = 4/3
    assert compute_score(WRONG_VALUE, LABEL, step=0) == pytest.approx((2 + 4 / 3, 2.0, 4 / 3, 0))
    assert compute_score(calls(GW, GT_TIME), LABEL, step=0)[1] == -2.0
    # step 75: format max 2 - 1 * 0.5 = 1.5, min -2 + 2 * 0.5 = -1; correctness [-2.5, 2.5]
    assert compute_score(LABEL, LABEL, step=75) == pytest.approx((4.0, 1.5, 2.5, 0))
    assert compute_score(calls(GW, GT_TIME), LABEL, step=75)[1] == pytest.approx(-1.0)
    assert compute_score(THINK, LABEL, step=75)[2] == pytest.approx(-2.5)
    # step 300: format max 0 -> raised to 1, min 2 -> lowered to -1; correctness 4 -> 3, -4 -> -3
    assert compute_score(LABEL, LABEL, step=300) == pytest.approx((4.0, 1.0, 3.0, 0))
    assert compute_score(calls(GW, GT_TIME), LABEL, step=300)[1] == -1.0
    assert compute_score(THINK, LABEL, step=300)[2] == -3.0


def test_schedulereward_with_max1step30max3(monkeypatch):
    monkeypatch.setenv("SCHEDULEREWARD", "1")
    monkeypatch.setenv("MAX1STEP30MAX3", "1")
    # step 0: correctness [-1, 1] then scheduled: (1 - 2) * 0 + 2 = 2 and (-1 + 2) * 0 - 2 = -2
    assert compute_score(LABEL, LABEL, step=0)[2] == 2.0
    # step 60: format [0, 0.5] then 2 - 1.5 * 0.4 = 1.4; correctness [-3, 3] then (1) * 0.4 + 2 = 2.4
    assert compute_score(LABEL, LABEL, step=60) == pytest.approx((3.8, 1.4, 2.4, 0))


def test_intermediatereward(monkeypatch):
    monkeypatch.setenv("INTERMEDIATEREWARD", "1")
    # Smax = 1 + 2 calls = 3; names 1; get_weather differs -> 0; get_time exact -> 1; S = 2 -> 6 * 2/3 - 3 = 1
    assert compute_score(WRONG_VALUE, LABEL)[2] == pytest.approx(1.0)


def test_keyword_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("COARSEREWARD", "1")
    assert compute_score(WRONG_VALUE, LABEL, coarsereward=False)[2] == pytest.approx(2.0)
    monkeypatch.setenv("COARSEREWARD", "true")  # only "1" switches a flag on
    assert compute_score(WRONG_VALUE, LABEL)[2] == pytest.approx(2.0)
    assert compute_score(WRONG_VALUE, LABEL, coarsereward=True)[2] == -3.0
    assert resolve_flags(withlength=1)["WITHLENGTH"] is True
    with pytest.raises(TypeError, match="unknown rlla reward flag.*withlenght"):
        compute_score(LABEL, LABEL, withlenght=True)
    with pytest.raises(TypeError, match="allowed: true, false"):
        compute_score(LABEL, LABEL, withlength="yes")


def test_bad_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match='each line must be {"name"'):
        compute_score(LABEL, THINK + '<tool_call>\n{"tool": "x"}\n</tool_call>')
    with pytest.raises(TypeError, match="ground_truth must be a str"):
        compute_score(LABEL, {"calls": []})


def test_default_compute_score_routes_rlla_to_a_dict():
    result = default_compute_score("rlla", WRONG_VALUE, LABEL, extra_info={"index": 0}, step=3)
    assert result == pytest.approx({"score": 3.0, "format": 1.0, "correctness": 2.0, "length": 0})
    with_length = default_compute_score("rlla_toolace", _think(64), LABEL, withlength=True)
    assert with_length["length"] == 0.12
