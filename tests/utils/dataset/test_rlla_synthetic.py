"""Tests of verl/utils/dataset/rlla_synthetic.py: determinism, exact RLLA format, learnable-but-not-trivial mix."""

import json
import re
from collections import Counter

import pytest

from verl.utils.dataset.rlla_synthetic import TOOLS, corpus_texts, generate_records

# The format regexes of ToolRL's reward, written out independently.
TOOL_ONLY = re.compile(r"^<think>.*?</think>\n<tool_call>\n.*?\n</tool_call>$", re.DOTALL)
RESPONSE_ONLY = re.compile(r"^<think>.*?</think>\n<response>.*?</response>$", re.DOTALL)


def calls_of(output):
    block = output.split("<tool_call>")[1].split("</tool_call>")[0].strip()
    return [json.loads(line) for line in block.split("\n")]


def catalogue_of(instruction):
    """{tool name: parameters dict} read back from the system prompt."""
    names = re.findall(r"^\d+\. Name: (\S+)$", instruction, re.MULTILINE)
    params = re.findall(r"^Parameters: (.*)$", instruction, re.MULTILINE)
    assert len(names) == len(params)
    return {n: json.loads(p) for n, p in zip(names, params)}


@pytest.fixture(scope="module")
def records():
    return generate_records(2000, seed=11)


def test_deterministic_by_seed_and_prefix_stable():
    a = generate_records(60, seed=3)
    assert a == generate_records(60, seed=3)
    assert a[:25] == generate_records(25, seed=3)
    assert a != generate_records(60, seed=4)
    assert generate_records(0) == []
    with pytest.raises(ValueError):
        generate_records(-1)


def test_records_have_the_raw_shape(records):
    for r in records[:50]:
        assert set(r) == {"instruction", "input", "output"}
        assert r["input"].startswith("**Dialogue Records History**\n<user> ") and r["input"].endswith(" </user>")
        for tag in ("**Available Tools**", "<think>", "<tool_call>", "<response>"):
            assert tag in r["instruction"]


def test_outputs_match_the_reward_format_exactly(records):
    for r in records:
        out = r["output"]
        if "<tool_call>" in out:
            assert TOOL_ONLY.search(out), out
            assert out.count("<tool_call>") == 1 and out.count("</tool_call>") == 1 and "<response>" not in out
        else:
            assert RESPONSE_ONLY.search(out), out
            assert out.count("<response>") == 1 and out.count("</response>") == 1
        assert out.count("<think>") == 1 and "\r" not in out


def test_calls_use_shown_tools_and_copy_values(records):
    tools = {t.name: t for t in TOOLS}
    for r in records:
        shown = catalogue_of(r["instruction"])
        assert 3 <= len(shown) <= 4
        for params in shown.values():
            assert all(set(p) == {"type"} and p["type"] in ("string", "integer") for p in params.values())
        if "<tool_call>" not in r["output"]:
            continue
        user = r["input"]
        for call in calls_of(r["output"]):
            assert set(call) == {"name", "parameters"}
            assert call["name"] in shown
            assert list(call["parameters"]) == [p.name for p in tools[call["name"]].params]
            for name, value in call["parameters"].items():
                expected_type = int if shown[call["name"]][name]["type"] == "integer" else str
                assert type(value) is expected_type
                assert str(value) in user


def test_mix_of_one_two_and_no_calls(records):
    kinds = Counter(len(calls_of(r["output"])) if "<tool_call>" in r["output"] else 0 for r in records)
    assert set(kinds) == {0, 1, 2}
    assert 0.15 < kinds[0] / len(records) < 0.25
    assert 0.20 < kinds[2] / len(records) < 0.30
    # Every tool of the pool is called somewhere.
    used = Counter(c["name"] for r in records if "<tool_call>" in r["output"] for c in calls_of(r["output"]))
    assert set(used) == {t.name for t in TOOLS} and len(TOOLS) == 12


def test_two_calls_are_distinct_and_in_request_order(records):
    for r in records:
        if "<tool_call>" not in r["output"]:
            continue
        calls = calls_of(r["output"])
        if len(calls) == 2:
            assert calls[0] != calls[1]
            first_value = str(next(iter(calls[0]["parameters"].values())))
            assert " Also, " in r["input"] and first_value in r["input"].split(" Also, ")[0]


def test_corpus_texts():
    texts = list(corpus_texts(5, seed=2))
    assert len(texts) == 5 and all(isinstance(t, str) and "<think>" in t for t in texts)
    assert texts == list(corpus_texts(5, seed=2))


def test_prompt_length_with_the_tiny_tokenizer(tokenizer):
    lengths = []
    for r in generate_records(100, seed=5):
        messages = [{"role": "system", "content": r["instruction"]}, {"role": "user", "content": r["input"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    lengths.sort()
    assert 150 <= lengths[0] and lengths[-1] <= 360, lengths
    assert 200 <= lengths[len(lengths) // 2] <= 300


def test_ground_truth_earns_the_full_reward(records, monkeypatch):
    rlla = pytest.importorskip("verl.utils.reward_score.rlla")
    for flag in ("MAX1STEP30MAX3", "SCHEDULEREWARD", "CORRECTMAX1", "WITHLENGTH", "REFINEDREWARD"):
        monkeypatch.delenv(flag, raising=False)
    for r in records[:200]:
        score, fmt, correctness, length = rlla.compute_score(r["output"], r["output"], step=0)
        assert fmt == 1.0
        assert correctness == (3.0 if "<tool_call>" in r["output"] else 0.0)
        assert score == fmt + correctness + length


def test_stale_demonstrations_are_version_1_answers_the_reward_scores_lower(records, monkeypatch):
    import random

    from verl.utils.dataset.rlla_synthetic import P_STALE, V1_PARAM_NAMES, demonstration
    from verl.utils.reward_score import rlla

    for flag in rlla.FLAG_NAMES:
        monkeypatch.delenv(flag, raising=False)
    rng, stale, calls = random.Random(0), 0, 0
    for r in records:
        demo = demonstration(r, rng)
        if "<tool_call>" not in r["output"]:
            assert demo == r["output"]  # a <response> answer is never stale
            continue
        calls += 1
        if demo == r["output"]:
            continue
        stale += 1
        assert TOOL_ONLY.search(demo) and rlla.compute_score(demo, r["output"])[1] == 1.0  # the format is right
        assert rlla.compute_score(demo, r["output"])[0] < rlla.compute_score(r["output"], r["output"])[0]
        for right, old in zip(calls_of(r["output"]), calls_of(demo)):
            if right["name"] == "get_forecast":
                assert old["name"] == "get_weather" and "get_weather" in demo.split("</think>")[0]
                assert old["parameters"] == {"location": right["parameters"]["city"]}
                continue
            assert old["name"] == right["name"]
            assert old["parameters"] == {V1_PARAM_NAMES[k]: str(v) for k, v in right["parameters"].items()}
    assert abs(stale / calls - P_STALE) < 0.05
