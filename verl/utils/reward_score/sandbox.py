"""Code-execution reward: run model-written code against test cases in a contained process; score = pass fraction.

Owns `run_code_tests(code, test_cases, timeout_s, memory_mb, ...) -> float`, `run_tests(...) -> SandboxResult`
(per-test statuses), `parse_test_cases`, `extract_code` and `compute_score(solution_str, ground_truth, ...)`
for the data sources "code", "codecontests", "apps", "taco" and "sandbox". Pure Python: no tensors, no Ray.

Test cases: `{"inputs": [...], "outputs": [...]}` (stdin/stdout pairs, APPS/TACO style), a list of
`{"input": ..., "output": ...}`, or `{"asserts": ["assert f(1) == 2", ...]}` (each block runs after the
solution in the same namespace), as a dict or a JSON string. Output comparison ignores trailing spaces
on each line, CRLF, and leading/trailing blank lines.

What is guaranteed (see sandbox_runner.py for the in-process side):
- Each test runs in a fresh interpreter started with `start_new_session=True`, cwd and HOME a fresh
  temp dir (removed afterwards), a wall-time limit per test (`timeout_s`, counted from the interpreter's
  start), RLIMIT_AS = `memory_mb`, RLIMIT_CPU, RLIMIT_FSIZE = `max_output_bytes` (stdout goes to a file,
  so huge output ends the program), RLIMIT_NPROC (ignored by the kernel for root), no core dumps.
- With root and a working `unshare` (checked once per process; this machine has both), the supervisor
  runs in a fresh network namespace (no network at all) and a fresh pid namespace whose init it is:
  every process a test starts, setsid/double-forked or not, is killed after the test with
  `kill(-1, SIGKILL)` inside the namespace, and all of them die with the namespace at the end. Programs
  cannot see or signal any process outside it.
- Without namespaces: the supervisor is a child subreaper and kills the test's session and every
  descendant found in /proc; network is refused by the audit hook only.
- An audit hook in the test's interpreter refuses sockets, ctypes, signals, process creation (unless
  `allow_processes=True`), writes outside the temp dir, and reads outside the temp dir and the
  interpreter's library folders (so no other process's /proc entries: the expected outputs, kept only in
  the supervisor's memory, cannot be read). It is best effort: as root the program runs
  with root's file permissions (the interpreter lives under a 0700 /root, so dropping to another uid is
  not possible here); a program that defeats the hook could write where root can.
- `allow_processes=True` as root: RLIMIT_NPROC does not bind root, so a fork bomb is bounded only by the
  time limit (then killed with its namespace). Keep processes refused (the default) for untrusted code.
- stdin/stdout tests are compared outside the program, so they cannot be faked. Assert tests run inside
  the program's own interpreter and trust it: a hostile program can fake them (an object whose `__eq__`
  is always True, or printing the completion nonce it finds in its own memory). Prefer stdin/stdout tests
  for untrusted code.
- The caller is never signalled by the program, reads at most `max_output_bytes` of any output, and
  returns within about `len(tests) * (timeout_s + 1) + 10` seconds whatever the program does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

__all__ = ["SandboxResult", "compute_score", "extract_code", "parse_test_cases", "run_code_tests", "run_tests"]

RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
NAMESPACE_PREFIX = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
STARTUP_GRACE_S = 10.0
PER_TEST_GRACE_S = 1.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_MAX_OUTPUT_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_PROCESSES = 16
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class SandboxResult:
    """Outcome of one `run_tests` call: one status per test ("passed", "wrong_answer", "timeout", ...)."""

    statuses: list[str]
    pass_fraction: float
    isolation: str  # "namespaces" or "process"
    details: list[dict[str, Any]] = field(default_factory=list)


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare --net --pid --fork --kill-child` works here (needs root or CAP_SYS_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run([*NAMESPACE_PREFIX, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, list):  # some data sets store stdin/stdout as a list of lines
        return "\n".join(str(line) for line in value)
    if not isinstance(value, str):
        raise ValueError(f"sandbox test {what} must be a string or a list of lines, got {type(value).__name__}")
    return value


def parse_test_cases(test_cases: Any) -> list[dict[str, str]]:
    """Normalise test cases to `[{"kind": "stdio", "input", "output"} | {"kind": "assert", "code"}]`."""
    if isinstance(test_cases, str):
        try:
            test_cases = json.loads(test_cases)
        except json.JSONDecodeError as err:
            raise ValueError(f"sandbox test cases are not valid JSON ({err}): {test_cases[:200]!r}") from None
    if isinstance(test_cases, dict) and "fn_name" in test_cases:
        raise ValueError("call-based tests (fn_name) are not supported; give stdin/stdout pairs or 'asserts'")
    if isinstance(test_cases, dict) and "asserts" in test_cases:
        blocks = test_cases["asserts"]
        blocks = [blocks] if isinstance(blocks, str) else blocks
        tests = [{"kind": "assert", "code": _as_text(block, "assert block")} for block in blocks]
    elif isinstance(test_cases, dict) and "inputs" in test_cases and "outputs" in test_cases:
        inputs, outputs = test_cases["inputs"], test_cases["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"sandbox tests have {len(inputs)} inputs but {len(outputs)} outputs")
        tests = [
            {"kind": "stdio", "input": _as_text(i, "input"), "output": _as_text(o, "output")}
            for i, o in zip(inputs, outputs)
        ]
    elif isinstance(test_cases, list) and all(
        isinstance(t, dict) and {"input", "output"} <= set(t) for t in test_cases
    ):
        tests = [
            {"kind": "stdio", "input": _as_text(t["input"], "input"), "output": _as_text(t["output"], "output")}
            for t in test_cases
        ]
    else:
        raise ValueError(
            f"unrecognised sandbox test cases {str(test_cases)[:200]!r}; allowed: "
            '{"inputs": [...], "outputs": [...]}, [{"input": ..., "output": ...}], {"asserts": [...]} '
            "(a dict or its JSON string)"
        )
    if not tests:
        raise ValueError("sandbox test cases are empty; give at least one test")
    return tests


def extract_code(solution_str: str) -> str:
    """The last fenced code block (```python ... ```) of a response, else the whole response."""
    blocks = _CODE_BLOCK.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def _session_leftovers(session_id: int) -> list[int]:
    """Processes whose session id is `session_id` (what a killed supervisor may leave without namespaces)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session_id:
            found.append(int(name))
    return found


def _kill_supervisor(proc: subprocess.Popen) -> None:
    """Kill the supervisor's process group and, without namespaces, anything left in its session."""
    for _ in range(50):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.poll()
        victims = [pid for pid in _session_leftovers(proc.pid) if pid not in (proc.pid, os.getpid())]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    proc.wait()


def run_tests(
    code: str,
    test_cases: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    allow_processes: bool = False,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    use_namespaces: bool | None = None,
) -> SandboxResult:
    """Run `code` against every test in a contained process; see the module docstring for the guarantees.

    Args:
        code: Python source of the solution.
        test_cases: stdin/stdout pairs or assert blocks (see `parse_test_cases`).
        timeout_s: wall-time limit of each test, seconds.
        memory_mb: address-space limit of the test's process.
        max_output_bytes: limit on what a test may write to stdout/stderr or to any file.
        allow_processes: let the program create processes (still killed at the end of each test).
        max_processes: RLIMIT_NPROC headroom above the processes the user already has (non-root only).
        use_namespaces: None = when available, True = require them (RuntimeError if absent), False = never.
    """
    if not isinstance(code, str):
        raise TypeError(f"sandbox code must be a str, got {type(code).__name__}")
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError(
            f"sandbox limits must be positive, got timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"max_output_bytes={max_output_bytes}"
        )
    tests = parse_test_cases(test_cases)
    namespaced = namespaces_available() if use_namespaces is None else bool(use_namespaces)
    if namespaced and not namespaces_available():
        raise RuntimeError("use_namespaces=True but `unshare --net --pid --fork` does not work here (needs root)")
    work_dir = os.path.realpath(tempfile.mkdtemp(prefix="verl_sandbox_"))
    spec = {
        "code": code,
        "tests": tests,
        "timeout_s": float(timeout_s),
        "memory_mb": int(memory_mb),
        "max_output_bytes": int(max_output_bytes),
        "max_processes": int(max_processes),
        "allow_processes": bool(allow_processes),
        "work_dir": work_dir,
    }
    # -S: the supervisor needs only the standard library (the test's interpreter keeps site-packages)
    command = [*(NAMESPACE_PREFIX if namespaced else []), sys.executable, "-I", "-S", RUNNER_PATH, "supervise"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": work_dir}
    budget_s = len(tests) * (timeout_s + PER_TEST_GRACE_S) + STARTUP_GRACE_S
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=work_dir,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(spec).encode("utf-8"), timeout=budget_s)
        report = _parse_report(stdout, stderr, proc.returncode)
    except subprocess.TimeoutExpired:
        report = None
    finally:
        _kill_supervisor(proc)
        shutil.rmtree(work_dir, ignore_errors=True)
    if report is None:
        details = [{"status": "supervisor_failed", "passed": False} for _ in tests]
    else:
        details = report["results"]
    statuses = [item["status"] for item in details]
    passed = sum(1 for item in details if item["passed"])
    return SandboxResult(statuses, passed / len(tests), "namespaces" if namespaced else "process", details)


def _parse_report(stdout: bytes, stderr: bytes, returncode: int) -> dict | None:
    """The supervisor's JSON report, or None when it died (e.g. killed by the program)."""
    try:
        report = json.loads(stdout.decode("utf-8", "replace").strip().split("\n")[-1])
    except (json.JSONDecodeError, IndexError):
        return None
    if returncode != 0 or not isinstance(report, dict) or "results" not in report:
        return None
    return report


def run_code_tests(
    code: str,
    test_cases: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    **limits: Any,
) -> float:
    """Pass fraction in [0, 1] of `code` on `test_cases` (see `run_tests` for the limits)."""
    return run_tests(code, test_cases, timeout_s=timeout_s, memory_mb=memory_mb, **limits).pass_fraction


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **limits: Any) -> float:
    """Pass fraction of the response's last code block on the tests in `ground_truth` (dict or JSON).

    `extra_info` is accepted for `default_compute_score`'s signature and not used; `**limits` go to `run_tests`.
    """
    return run_code_tests(extract_code(solution_str), ground_truth, **limits)
