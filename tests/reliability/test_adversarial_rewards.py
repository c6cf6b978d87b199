"""Adversarial responses against every reward function of verl/utils/reward_score/: megabyte responses, deeply
nested JSON, invalid UTF-8 round trips, tag soups and control characters. Each call must return a finite score
(or a dict with one) within a few seconds and never raise: a response is model output, not a data bug.

Also: rlla's linear-time format check gives exactly ToolRL's regex verdicts (the regex is quadratic on tag soups).
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verl.utils.reward_score import default_compute_score, rlla

MB = 1 << 20
TIME_LIMIT_S = 5.0  # ToolRL's regex took about 1100 s on a 1 MB tag soup; a bounded scorer takes milliseconds

_rng = random.Random(0)
_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>", "\n", "{", "}", '"']
RESPONSES = {
    "megabyte_words": "lorem ipsum dolor " * (MB // 18),
    "megabyte_one_line": "x" * MB,
    "deep_json_array": "[" * 200_000 + "]" * 200_000,
    "deep_json_in_tool_call": "<think>a</think>\n<tool_call>\n"
    + '{"a": ' * 50_000
    + "1"
    + "}" * 50_000
    + "\n</tool_call>",
    "deep_json_fenced": "```json\n" + "[" * 100_000 + "]" * 100_000 + "\n```",
    "many_tool_calls": "<think>a</think>\n<tool_call>\n"
    + "\n".join(json.dumps({"name": "f", "parameters": {"a": i}}) for i in range(20_000))
    + "\n</tool_call>",
    "tag_soup_think_then_calls": "<think>a" + "</think>\n<tool_call>\n" * (MB // 20),
    "tag_soup_calls_then_response": "<think>a</think>\n<tool_call>\n" + "x\n</tool_call>\n<response>" * (MB // 26),
    "tag_soup_random": "".join(_rng.choice(_TAGS) for _ in range(MB // 6)),
    "unclosed_tags": "<think>" * (MB // 7),
    "invalid_utf8_surrogates": bytes(_rng.randrange(256) for _ in range(MB)).decode("utf-8", "surrogateescape"),
    "invalid_utf8_replaced": bytes(_rng.randrange(256) for _ in range(MB)).decode("utf-8", "replace"),
    "control_characters": "\x00\x1b[31m\r\x7f\u202e\ufeff" * (MB // 8),
    "hash_soup": "#### " * (MB // 5),
    "huge_number": "#### " + "9" * MB,
    "boxed_nesting": "\\boxed{" * 100_000 + "1" + "}" * 100_000,
    "boxed_unclosed": "\\boxed{" * (MB // 7),
    "latex_soup": "\\boxed{" + "\\frac\\sqrt" * 50_000 + "}",
    "code_fence_soup": "```python\n" * (MB // 10),
}

RLLA_TRUTHS = {
    "tool_call": '<tool_call>\n{"name": "f", "parameters": {"a": 1}}\n</tool_call>',
    "response": "<response>hello</response>",
    "both": '<tool_call>\n{"name": "f", "parameters": {}}\n</tool_call>\n<response>hi</response>',
}
IFEVAL_TRUTH = {
    "instructions": [
        {"type": "word_count", "min": 5, "max": 50},
        {"type": "keywords", "include": ["ocean"], "exclude": ["sky"]},
        {"type": "json_format"},
        {"type": "bullet_points", "count": 2},
        {"type": "placeholders", "min": 1},
        {"type": "title"},
        {"type": "quotation"},
        {"type": "no_commas"},
        {"type": "paragraph_count", "min": 1, "max": 3},
        {"type": "sentence_count", "min": 1, "max": 3},
    ]
}


def _finite_score(result) -> float:
    score = result["score"] if isinstance(result, dict) else result
    assert isinstance(score, (int, float)) and math.isfinite(score), result
    return float(score)


def _pure_scorers() -> list[tuple[str, object]]:
    from verl.utils.reward_score import KNOWN_DATA_SOURCES

    scorers = [("gsm8k", "42"), ("math", "\\frac{1}{2}")] + [("rlla", truth) for truth in RLLA_TRUTHS.values()]
    if "ifeval" in KNOWN_DATA_SOURCES:
        scorers.append(("ifeval", IFEVAL_TRUTH))
    return scorers


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_rule_based_rewards_are_bounded_on_adversarial_responses(name):
    for data_source, truth in _pure_scorers():
        start = time.monotonic()
        _finite_score(default_compute_score(data_source, RESPONSES[name], truth))
        assert time.monotonic() - start < TIME_LIMIT_S, (name, data_source)


SANDBOX_RESPONSES = ("megabyte_one_line", "deep_json_array", "invalid_utf8_surrogates", "code_fence_soup")


def test_code_sandbox_is_bounded_on_adversarial_responses():
    for name in SANDBOX_RESPONSES:
        start = time.monotonic()
        score = default_compute_score("code", RESPONSES[name], {"inputs": ["1 2"], "outputs": ["3"]}, timeout_s=2.0)
        assert score == 0.0 and time.monotonic() - start < 2.0 + 11.0, name  # the sandbox's own bound


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.prompt_sizes.append(len(body["messages"][0]["content"]))
        payload = json.dumps({"choices": [{"message": {"content": "Score: 1"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_llm_judge_is_bounded_on_adversarial_responses():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.prompt_sizes = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = {"url": f"http://127.0.0.1:{server.server_address[1]}/v1", "model": "judge", "timeout_s": 10}
    try:
        for name in ("megabyte_words", "invalid_utf8_surrogates", "control_characters", "tag_soup_random"):
            start = time.monotonic()
            assert default_compute_score("llm_judge", RESPONSES[name], "4", config=config) == 1.0, name
            assert time.monotonic() - start < TIME_LIMIT_S, name
        assert min(server.prompt_sizes) > MB // 2  # the whole response reached the judge
    finally:
        server.shutdown()
        server.server_close()


def test_rlla_format_check_equals_toolrl_regex():
    """The linear-time check against the spec's regexes on 50,000 random and near-valid layouts."""
    rng = random.Random(1)
    valid = [
        "<think>a</think>\n<tool_call>\nx\n</tool_call>",
        "<think>a</think>\n<response>r</response>",
        "<think>a</think>\n<tool_call>\nx\n</tool_call>\n<response>r</response>",
        "<think>a</think>",
    ]
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>", "\n", "a", " "]
    matches = 0
    for _ in range(50_000):
        if rng.random() < 0.5:
            text = list(rng.choice(valid))
            for _ in range(rng.randint(0, 3)):
                at = rng.randint(0, len(text))
                text[at:at] = rng.choice(pieces)
            text = "".join(text) + rng.choice(["", "\n", "\n\n", " "])
        else:
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 9)))
        for category, pattern in rlla._FORMAT_PATTERNS.items():
            expected = bool(re.search(pattern, text, re.DOTALL))
            matches += expected
            assert rlla.matches_format(text, category) == expected, (text, category)
    assert matches > 1000  # the corpus exercises both verdicts
