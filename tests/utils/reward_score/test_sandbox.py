"""The code sandbox: test-case formats, correct programs pass, limits are checked.

Hostile programs (loops, bombs, escapes, detached children) are in tests/reliability/test_hostile_code.py."""

import json

import pytest

from verl.utils.reward_score.sandbox import (
    compute_score,
    extract_code,
    namespaces_available,
    parse_test_cases,
    run_code_tests,
    run_tests,
)

ADD = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
ADD_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"
MODES = [pytest.param(False, id="process")]
if namespaces_available():
    MODES.append(pytest.param(True, id="namespaces"))


def test_parse_test_cases_formats_and_errors():
    assert parse_test_cases('{"inputs": ["1"], "outputs": ["2"]}') == [{"kind": "stdio", "input": "1", "output": "2"}]
    assert parse_test_cases([{"input": ["a", "b"], "output": "c"}]) == [
        {"kind": "stdio", "input": "a\nb", "output": "c"}
    ]
    assert parse_test_cases({"asserts": "assert 1"}) == [{"kind": "assert", "code": "assert 1"}]
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_test_cases({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="unrecognised sandbox test cases"):
        parse_test_cases({"tests": []})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_test_cases("{oops")
    with pytest.raises(ValueError, match="fn_name"):
        parse_test_cases({"fn_name": "f", "inputs": [[1]], "outputs": [[2]]})


def test_extract_code_takes_last_fenced_block():
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


@pytest.mark.parametrize("use_ns", MODES)
def test_correct_program_passes(use_ns):
    assert run_code_tests(ADD_CODE, ADD, timeout_s=5, use_namespaces=use_ns) == 1.0


def test_partial_and_assert_programs():
    use_ns = None
    # right on the first two tests only: 2/3 (trailing spaces and a missing final newline are ignored)
    partial = "a, b = map(int, input().split())\nprint(str(a + b) + '  ', end='') if a < 5 else print(0)\n"
    assert run_code_tests(partial, ADD, timeout_s=5, use_namespaces=use_ns) == pytest.approx(2 / 3)
    asserts = {"asserts": ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"]}
    assert run_code_tests(
        "def f(x):\n    return x + 1\n", asserts, timeout_s=5, use_namespaces=use_ns
    ) == pytest.approx(2 / 3)


def test_ordinary_solutions_still_work():
    programs = [
        "import numpy\nprint(int(numpy.arange(3).sum()))\n",  # numpy imports ctypes: allowed
        "from collections import namedtuple\nP = namedtuple('P', 'a b')\nprint(P(1, 2).a + 2)\n",
        "import threading, sys\nsys.setrecursionlimit(10**5)\nt = threading.Thread(target=lambda: print(3))\n"
        "t.start()\nt.join()\n",
        "import sys\nout = open(1, 'w')\nout.write(str(sum(map(int, sys.stdin.read().split()))))\nout.flush()\n",
    ]
    for code in programs:
        result = run_tests(code, {"inputs": ["1 2"], "outputs": ["3"]}, timeout_s=10)
        assert result.statuses == ["passed"], (code, result.details)


def test_exiting_before_the_asserts_does_not_pass():
    asserts = {"asserts": ["assert f(1) == 2"]}
    for code in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
        result = run_tests(code, asserts, timeout_s=5)
        assert result.statuses == ["no_completion"] or result.statuses[0].startswith("runtime_error"), code
        assert result.pass_fraction == 0.0


def test_compute_score_reads_code_block_and_json_ground_truth():
    response = f"Here is my solution:\n```python\n{ADD_CODE}```\n"

    assert compute_score(response, json.dumps(ADD), timeout_s=5) == 1.0
    assert compute_score("```python\nprint(0)\n```", {"inputs": ["1 2"], "outputs": ["3"]}, timeout_s=5) == 0.0


@pytest.mark.skipif(not namespaces_available(), reason="needs root and a working `unshare --net --pid`")
def test_namespaces_hide_the_network():
    # /proc/net/dev lists the interfaces of the reader's network namespace: only loopback inside ours
    code = "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
    assert run_code_tests(code, {"inputs": [""], "outputs": ["['lo']"]}, timeout_s=5, use_namespaces=True) == 1.0


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_tests(ADD_CODE, ADD, timeout_s=0)
    with pytest.raises(TypeError, match="must be a str"):
        run_tests(b"print(1)", ADD)
