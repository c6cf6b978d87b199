"""HTTP client of a SandboxFusion `/run_code` service and the per-test-case verdicts (verl's sandbox_fusion.utils).

Owns `call_sandbox_api` (retried on HTTP 504 only) and `check_correctness` (threads, bounded by
`concurrent_semaphore`). Verdicts: True, False (wrong answer), -1 (request failed / sandbox error), -2 (runtime
error), -3 (time limit), -4 (compile error; later cases too). Expected output None passes any program that
finishes. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["SUPPORTED_LANGUAGES", "call_sandbox_api", "check_correctness"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10  # seconds, compile and run (each)
DEFAULT_MEMORY_LIMIT_MB = 1024
MAX_RETRIES = 3  # attempts per request; only HTTP 504 (gateway timeout) is retried
INITIAL_RETRY_DELAY = 1  # seconds; the n-th retry waits n * INITIAL_RETRY_DELAY
API_TIMEOUT = 10  # seconds added to compile + run timeouts for the whole HTTP request

SUPPORTED_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket",
)  # fmt: skip

# Call-based (LeetCode-style, `fn_name`) cases: the program is wrapped so that each stdin line is one
# JSON-encoded argument of `fn_name` (a global function or a method of `Solution()`), and the result is
# printed (JSON for dict/list/tuple/None/bool, else str). The common standard-library names are in scope,
# as in verl's wrapper. Unlike verl's, a global that the prelude brought in (e.g. operator's `add`) does not
# hide a `Solution` method of the same name, and blank stdin lines are skipped.
_PRELUDE_MODULES = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
    "itertools", "functools", "operator", "io", "sys", "json", "typing",
)  # fmt: skip
_CALL_WRAPPER = """\
{prelude}
from builtins import *
_sandbox_prelude = dict(globals())

{code}

def _sandbox_call():
    import json as _json
    import sys as _sys
    import traceback as _traceback
    _lines = [line for line in _sys.stdin.read().split("\\n") if line.strip()]
    try:
        _args = [_json.loads(line) for line in _lines]
    except ValueError as _err:
        _sys.stderr.write("WrapperError: input is not one JSON value per line: %s\\n" % _err)
        return None, True
    try:
        if {fn_name!r} in globals() and globals()[{fn_name!r}] is not _sandbox_prelude.get({fn_name!r}):
            _target = globals()[{fn_name!r}]
        elif "Solution" in globals():
            _target = getattr(globals()["Solution"](), {fn_name!r})
        else:
            _sys.stderr.write("WrapperError: function or method %r not found\\n" % {fn_name!r})
            return None, True
        return _target(*_args), False
    except Exception:
        _sys.stderr.write(_traceback.format_exc())
        return None, True

if __name__ == "__main__":
    _result, _failed = _sandbox_call()
    if not _failed:
        if _result is None or isinstance(_result, (dict, list, tuple, bool)):
            print(json.dumps(_result))
        else:
            print(str(_result))
"""


def _wrap_call_based(code: str, fn_name: str) -> str:
    prelude = "\n".join(f"from {name} import *\nimport {name}" for name in _PRELUDE_MODULES)
    return _CALL_WRAPPER.format(prelude=prelude, code=code, fn_name=fn_name)


def call_sandbox_api(
    sandbox_fusion_url: str,
    code: str,
    stdin: str | None,
    compile_timeout: int,
    run_timeout: int,
    memory_limit_mb: int,
    language: str = "python",
) -> tuple[dict[str, Any] | None, str | None]:
    """POST one program to the sandbox: (response JSON, None) or (None, error message).

    The HTTP request may take `compile_timeout + run_timeout + API_TIMEOUT` seconds. An HTTP 504 is retried
    up to MAX_RETRIES attempts in all, waiting 1 s, 2 s, ... (INITIAL_RETRY_DELAY) in between; any other
    HTTP error, a refused connection, a request timeout or a reply that is not JSON fails at once.
    """
    log_prefix = f"[sandbox request {uuid.uuid4()}] "
    if not str(sandbox_fusion_url).startswith(("http://", "https://")):
        message = f"sandbox_fusion_url={sandbox_fusion_url!r} is not an http:// or https:// URL"
        logger.error(log_prefix + message)
        return None, message
    if language not in SUPPORTED_LANGUAGES:
        message = f"Unsupported language: {language!r}; supported: {list(SUPPORTED_LANGUAGES)}"
        logger.error(log_prefix + message)
        return None, message
    payload = {
        "compile_timeout": compile_timeout,
        "run_timeout": run_timeout,
        "code": code,
        "stdin": stdin,
        "memory_limit_MB": memory_limit_mb,
        "language": language,
        "files": {},
        "fetch_files": [],
    }
    body = json.dumps(payload).encode("utf-8")
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    request_timeout = compile_timeout + run_timeout + API_TIMEOUT
    last_error = None
    for attempt in range(1, MAX_RETRIES + 1):
        try:
            request = urllib.request.Request(sandbox_fusion_url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=request_timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            if err.code != 504:
                last_error = f"HTTP {err.code} from {sandbox_fusion_url}: {err.read()[:300]!r}"
                break
            last_error = f"HTTP 504 (gateway timeout) from {sandbox_fusion_url} on attempt {attempt}/{MAX_RETRIES}"
            logger.warning(log_prefix + last_error)
            if attempt < MAX_RETRIES:
                time.sleep(INITIAL_RETRY_DELAY * attempt)
            continue
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:  # refused, DNS, timeout
            last_error = f"cannot reach {sandbox_fusion_url}: {err}"
            break
        try:
            return json.loads(raw), None
        except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
            last_error = f"reply of {sandbox_fusion_url} is not JSON ({err}): {raw[:300]!r}"
            break
    logger.error(f"{log_prefix}sandbox API call failed: {last_error}")
    return None, f"API Call Failed: {last_error}"


def _verdict(api_response: dict[str, Any], expected_output: Any, metadata: dict[str, Any]) -> bool | int:
    """True/False/-1/-2/-3/-4 from one sandbox response (see the module docstring); fills `metadata`."""
    compile_result = api_response.get("compile_result") or {}
    run_result = api_response.get("run_result") or {}
    metadata.update(
        api_response=api_response,
        api_status=api_response.get("status"),
        compile_status=compile_result.get("status"),
        compile_duration=compile_result.get("execution_time"),
        compile_stderr=compile_result.get("stderr"),
        run_status=run_result.get("status"),
        stdout=run_result.get("stdout"),
        stderr=run_result.get("stderr"),
        exit_code=run_result.get("return_code"),
        duration=run_result.get("execution_time"),
    )
    api_status, run_status = metadata["api_status"], metadata["run_status"]
    if api_status == "Success":
        if run_result and run_status == "Finished":
            actual = metadata["stdout"] if metadata["stdout"] is not None else ""
            if expected_output is None or str(actual).rstrip("\n") == str(expected_output).rstrip("\n"):
                metadata["status"] = "success"
                return True
            metadata["status"] = "wrong_answer"
            return False
        metadata["status"] = "unexpected_success_state"
        return -1
    if api_status == "SandboxError":
        metadata["status"] = "sandbox_error"
        return -1
    if api_status != "Failed":
        metadata["status"] = f"unknown_api_status_{api_status}"
        return -1
    compile_status = metadata["compile_status"]
    if compile_result and (
        compile_status in ("Error", "TimeLimitExceeded")
        or (compile_status == "Finished" and compile_result.get("return_code") != 0)
    ):
        metadata["status"] = "compile_timeout" if compile_status == "TimeLimitExceeded" else "compile_error"
        return -4
    if not run_result:
        metadata["status"] = "unknown_failure_state"
        return -1
    if run_status == "TimeLimitExceeded":
        metadata["status"] = "timeout"
        return -3
    if run_status == "Error" or (run_status == "Finished" and run_result.get("return_code") != 0):
        metadata["status"] = "runtime_error"
        return -2
    metadata["status"] = "unknown_failure"
    return -1


def _process_single_case(
    case_index: int,
    stdin_data: Any,
    expected_output: Any,
    sandbox_fusion_url: str,
    generation: str,
    timeout: int,
    memory_limit_mb: int,
    language: str,
    concurrent_semaphore: Any = None,
    fn_name: str | None = None,
) -> tuple[bool | int, dict[str, Any]]:
    """Run test case `case_index` in the sandbox: (verdict, metadata)."""
    code = _wrap_call_based(generation, fn_name) if fn_name and language == "python" else generation
    stdin = None if stdin_data is None else str(stdin_data)
    call = dict(
        sandbox_fusion_url=sandbox_fusion_url,
        code=code,
        stdin=stdin,
        compile_timeout=timeout,
        run_timeout=timeout,
        memory_limit_mb=memory_limit_mb,
        language=language,
    )
    api_response, error_msg = None, None
    try:
        if concurrent_semaphore is not None:
            with concurrent_semaphore:
                api_response, error_msg = call_sandbox_api(**call)
        else:
            api_response, error_msg = call_sandbox_api(**call)
    except Exception as err:  # e.g. a broken semaphore proxy: the case fails, the others go on
        error_msg = f"API Request Exception for case {case_index + 1}: {type(err).__name__}: {err}"
    metadata: dict[str, Any] = {
        "case_index": case_index,
        "input": stdin,
        "expected_output": str(expected_output) if expected_output else None,
        "api_request_error": error_msg,
        "api_response": None,
        "status": "unknown",
        "stdout": None,
        "stderr": None,
        "exit_code": None,
        "duration": None,
        "compile_duration": None,
        "compile_stderr": None,
        "api_status": None,
        "compile_status": None,
        "run_status": None,
    }
    if error_msg:
        metadata["status"] = "api_error"
        logger.error(f"case {case_index}: {error_msg}; code starts {generation[:200]!r}")
        return -1, metadata
    if not isinstance(api_response, dict):
        metadata["status"] = "unknown_api_state"
        return -1, metadata
    return _verdict(api_response, expected_output, metadata), metadata


def check_correctness(
    sandbox_fusion_url: str,
    in_outs: dict | None,
    generation: str,
    timeout: int = DEFAULT_TIMEOUT,
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    language: str = "python",
    concurrent_semaphore: threading.Semaphore | Any | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run `generation` on every test case of `in_outs` in the sandbox, concurrently.

    Args:
        in_outs: {"inputs": [...], "outputs": [...]} with optional "fn_name" (call-based cases) and
            "assert_case" (one code block per case, appended to the program; expected output None).
        timeout: compile and run time limit of each case, seconds.
        concurrent_semaphore: held around each request (a `threading.Semaphore`, or a multiprocessing
            manager's semaphore shared by processes): at most its count of requests are in flight.

    Returns:
        (verdicts, metadata), one each per case in input order; verdicts as in the module docstring.
        Malformed `in_outs` give ([-1], [{"error": ...}]) or -1 for every case; no cases give ([], []).
    """
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        logger.warning("check_correctness: in_outs lacks 'inputs'/'outputs'")
        return [-1], [{"error": "Invalid input/output data"}]
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    num_cases = len(inputs)
    assert_cases = in_outs.get("assert_case", [""] * num_cases)
    if num_cases == 0:
        return [], []
    if len(outputs) != num_cases or len(assert_cases) != num_cases:
        logger.warning(
            f"check_correctness: {num_cases} inputs, {len(outputs)} outputs, {len(assert_cases)} assert cases"
        )
        return [-1] * num_cases, [{"error": "Input/output count mismatch", "case_index": i} for i in range(num_cases)]
    memory_limit_mb = DEFAULT_MEMORY_LIMIT_MB if memory_limit_mb is None else memory_limit_mb
    fn_name = in_outs.get("fn_name")
    results: list[Any] = [-1] * num_cases
    metadata_list: list[dict[str, Any]] = [{} for _ in range(num_cases)]
    # Threads only wait on HTTP; the semaphore, not the pool size, caps requests in flight.
    with ThreadPoolExecutor(max_workers=max(32, (os.cpu_count() or 1) * 5)) as pool:
        futures = [
            pool.submit(
                _process_single_case,
                i,
                inputs[i],
                outputs[i],
                sandbox_fusion_url,
                generation + "\n\n" + assert_cases[i],
                timeout,
                memory_limit_mb,
                language,
                concurrent_semaphore,
                fn_name,
            )
            for i in range(num_cases)
        ]
        for i, future in enumerate(futures):
            try:
                results[i], metadata_list[i] = future.result()
            except Exception as err:
                results[i] = -1
                metadata_list[i] = {
                    "case_index": i,
                    "input": str(inputs[i]),
                    "expected_output": str(outputs[i]) if outputs[i] else None,
                    "api_request_error": f"Internal execution error: {type(err).__name__}: {err}",
                    "status": "internal_error",
                }
    if -4 in results:  # a compile error fails every later case too
        first = results.index(-4)
        for i in range(first + 1, num_cases):
            if results[i] != -4:
                results[i] = -4
                metadata_list[i]["status"] = "compile_error_skipped"
    return results, metadata_list
