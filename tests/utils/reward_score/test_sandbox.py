"""The code sandbox: correct programs pass, hostile ones score 0 within the time bound and leave nothing behind."""

import json
import os
import time
import uuid

import pytest

from verl.utils.reward_score import sandbox
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


def _processes_with(token: str) -> list[int]:
    """Pids whose command line contains `token`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if token.encode() in handle.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def _runner_processes() -> list[int]:
    return [pid for pid in _processes_with(sandbox.RUNNER_PATH) if pid != os.getpid()]


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


HOSTILE = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_past_limit": "import time\ntime.sleep(60)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n",
    "huge_alloc": "x = bytearray(1 << 40)\n",
    "huge_stdout": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "socket": "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(3)\n",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(3)\n",
    "subprocess": "import subprocess\nsubprocess.run(['sleep', '30'])\n",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()\n",
    "raw_fork_exec": "import _posixsubprocess\nprint(3)\n",  # fork_exec has no audit event of its own
    "raise_limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nprint(3)\n",
}


# every program under the default isolation; the ones that test process cleanup also without namespaces
HOSTILE_CASES = [pytest.param(name, None, id=name) for name in sorted(HOSTILE)] + [
    pytest.param(name, False, id=f"{name}-process") for name in ("fork_bomb", "infinite_loop", "kill_parent")
]


@pytest.mark.parametrize(("name", "use_ns"), HOSTILE_CASES)
def test_hostile_program_scores_zero_fast_and_leaves_nothing(name, use_ns):
    timeout_s = 1.0 if name in ("infinite_loop", "sleep_past_limit") else 5.0  # the rest must fail on their own
    start = time.monotonic()
    result = run_tests(
        HOSTILE[name],
        {"inputs": ["1 2\n"], "outputs": ["3\n"]},
        timeout_s=timeout_s,
        memory_mb=256,
        max_output_bytes=1 << 20,
        use_namespaces=use_ns,
    )
    elapsed = time.monotonic() - start
    assert result.pass_fraction == 0.0, result.details
    assert elapsed < timeout_s + sandbox.PER_TEST_GRACE_S + sandbox.STARTUP_GRACE_S
    expected = {
        "infinite_loop": "timeout",
        "sleep_past_limit": "timeout",
        "huge_stdout": "output_limit",
    }.get(name, "runtime_error(1)")
    assert result.statuses == [expected], result.details
    assert _runner_processes() == []


def test_write_outside_temp_dir_is_refused():
    use_ns = None
    target = f"/tmp/verl_sandbox_escape_{uuid.uuid4().hex}"
    programs = [
        f"open({target!r}, 'w').write('x')\nprint(3)\n",
        f"import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))\nprint(3)\n",
        "import os\nd = os.path.basename(os.getcwd())\nopen('../' + d + '_escape', 'w').write('x')\nprint(3)\n",
        f"import shutil\nshutil.copyfile('/etc/hostname', {target!r})\nprint(3)\n",
        f"import os\nos.symlink('/tmp', 'up')\nopen('up/{os.path.basename(target)}', 'w')\nprint(3)\n",
    ]
    for code in programs:
        result = run_tests(code, {"inputs": [""], "outputs": ["3"]}, timeout_s=5, use_namespaces=use_ns)
        assert result.statuses == ["runtime_error(1)"], (code, result.details)
        assert "PermissionError: sandbox" in result.details[0]["stderr_tail"]
        assert not os.path.exists(target)
    # writing inside the temp dir (cwd and HOME) is fine
    inside = "import os\nopen('a.txt', 'w').write('7')\nprint(open(os.path.expanduser('~/a.txt')).read())\n"
    assert run_code_tests(inside, {"inputs": [""], "outputs": ["7"]}, timeout_s=5, use_namespaces=use_ns) == 1.0


@pytest.mark.parametrize("use_ns", MODES)
def test_detached_grandchild_is_killed_when_processes_are_allowed(use_ns):
    token = f"{uuid.uuid4().int % 10**6}.4321"  # a unique `sleep` argument to find survivors by
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{token}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print(3)\n"
    )
    result = run_tests(
        code, {"inputs": [""], "outputs": ["3"]}, timeout_s=5, allow_processes=True, use_namespaces=use_ns
    )
    assert result.statuses == ["passed"], result.details  # the program itself is right; its detached child dies
    assert _processes_with(token) == []
    # with processes refused (the default) the same program fails at its first fork
    blocked = run_tests(code, {"inputs": [""], "outputs": ["3"]}, timeout_s=5, use_namespaces=use_ns)
    assert blocked.statuses == ["runtime_error(1)"] and _processes_with(token) == []


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
