"""verl/utils/reward_score/sandbox_fusion: code scored through a SandboxFusion-style `/run_code` HTTP API.

The sandbox is a loopback server started here (127.0.0.1, an ephemeral port) that really runs the submitted
Python program in a subprocess with the requested time limit and answers in SandboxFusion's JSON shape. It
records every request, the most requests it had in flight at once, and can answer the next requests with
given HTTP error codes (fault injection).
"""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.reward import compute_reward, load_reward_manager, sandbox_fusion_compute_score
from verl.utils.reward_score import default_compute_score, sandbox_fusion
from verl.utils.reward_score.sandbox_fusion import utils as sf_utils
from verl.workers.reward_manager import BatchRewardManager, NaiveRewardManager, PrimeRewardManager

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "verl", "trainer", "config"))

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
SUB = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
ALWAYS_3 = "```python\ninput()\nprint(3)\n```"
CRASH = "```python\nraise RuntimeError('boom')\n```"
SUM_CASES = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}


class _SandboxHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output quiet
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        server = self.server
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append({"path": self.path, **payload})
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            fault = server.faults.pop(0) if server.faults else None
        try:
            if self.path != "/run_code":
                status, body = 404, {"detail": "Not Found"}
            elif fault is not None:
                status, body = fault, {"detail": f"injected {fault}"}
            else:
                status, body = 200, _run(payload)
        finally:
            with server.lock:  # before answering: the client may send its next request as soon as it reads this
                server.in_flight -= 1
        self._send(status, body)


def _run(payload):
    """Run the payload's Python program like SandboxFusion does and answer in its JSON shape."""
    if payload["language"] != "python":
        return {"status": "SandboxError", "message": f"language {payload['language']} not served here"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", payload["code"]],
            input=payload["stdin"] or "",
            capture_output=True,
            text=True,
            timeout=payload["run_timeout"],
        )
        run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    except subprocess.TimeoutExpired as err:
        run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": err.stdout or "", "stderr": ""}
    run["execution_time"] = time.monotonic() - start
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": run,
        "executor_pod_name": None,
        "files": {},
    }


@pytest.fixture
def sandbox(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sf_utils, "INITIAL_RETRY_DELAY", 0.05)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SandboxHandler)
    server.daemon_threads = True
    server.lock = threading.Lock()
    server.requests, server.faults = [], []
    server.in_flight = server.max_in_flight = 0
    server.url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _score(server, completion, cases, **kwargs):
    return sandbox_fusion.compute_score(server.url, None, 256, completion, cases, **kwargs)


def test_correct_wrong_and_partial_programs_on_stdin_stdout_cases(sandbox):
    assert _score(sandbox, ADD, json.dumps(SUM_CASES))[0] == 1.0  # test cases as a JSON string, as in verl
    first = sandbox.requests[0]
    assert first["path"] == "/run_code" and first["code"].strip() == "a, b = map(int, input().split())\nprint(a + b)"
    assert {k: first[k] for k in ("language", "compile_timeout", "run_timeout", "memory_limit_MB")} == {
        "language": "python",
        "compile_timeout": 10,
        "run_timeout": 10,
        "memory_limit_MB": 256,
    }
    assert sorted(r["stdin"] for r in sandbox.requests) == ["1 2\n", "3 4\n"]
    assert first["files"] == {} and first["fetch_files"] == []

    score, metadata = _score(sandbox, SUB, SUM_CASES)
    assert score == 0.0 and [m["status"] for m in metadata] == ["wrong_answer", "wrong_answer"]
    assert _score(sandbox, ALWAYS_3, SUM_CASES)[0] == 0.5  # verl's score is the pass fraction
    score, metadata = _score(sandbox, CRASH, SUM_CASES)
    assert score == 0.0 and metadata[0]["status"] == "runtime_error" and "boom" in metadata[0]["stderr"]

    requests_before = len(sandbox.requests)
    assert _score(sandbox, "print(3)", SUM_CASES) == (0.0, [{"error": "Invalid completion (missing code block)"}])
    assert _score(sandbox, ADD, {"inputs": ["1 2"]})[0] == 0.0  # no outputs
    assert len(sandbox.requests) == requests_before


def test_assert_cases_fn_name_local_forms_and_continuous(sandbox):
    inc = "```python\ndef f(x):\n    return x + 1\n```"
    assert _score(sandbox, inc, {"assert_case": ["assert f(1) == 2", "assert f(2) == 5"]})[0] == 0.5
    assert _score(sandbox, inc, {"asserts": ["assert f(1) == 2"]})[0] == 1.0  # the local sandbox's form
    pairs = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "4\n"}]
    assert _score(sandbox, ADD, pairs)[0] == 1.0
    method = "```python\nclass Solution:\n    def add(self, a: List[int], b):\n        return [a[0] + b]\n```"
    # call-based: one JSON argument per stdin line; `add` is also operator.add in the wrapper's prelude
    assert _score(sandbox, method, {"fn_name": "add", "inputs": ["[1]\n2"], "outputs": ["[3]"]})[0] == 1.0
    twice = "```python\ndef twice(s):\n    return s * 2\n```"
    assert _score(sandbox, twice, {"fn_name": "twice", "inputs": ['"ab"', "3"], "outputs": ["abab", "7"]})[0] == 0.5

    # 12 cases, the program passes the first 10: continuous scores the first 10 only, as in verl
    echo_small = "```python\nn = int(input())\nprint(n if n < 10 else -1)\n```"
    cases = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(12)]}
    assert _score(sandbox, echo_small, cases, continuous=True)[0] == 1.0
    assert _score(sandbox, echo_small, cases)[0] == pytest.approx(10 / 12)


def test_time_limit(sandbox):
    start = time.monotonic()
    score, metadata = _score(
        sandbox, "```python\nwhile True:\n    pass\n```", {"inputs": [""], "outputs": [""]}, timeout=1
    )
    assert score == 0.0 and metadata[0]["status"] == "timeout"
    assert sandbox.requests[0]["run_timeout"] == 1 and time.monotonic() - start < 8


def test_504_is_retried_other_errors_are_not(sandbox):
    case = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    sandbox.faults[:] = [504]
    assert _score(sandbox, ADD, case)[0] == 1.0
    assert len(sandbox.requests) == 2

    sandbox.faults[:] = [504, 504, 504]  # every attempt (3) answered 504
    score, metadata = _score(sandbox, ADD, case)
    assert score == 0.0 and metadata[0]["status"] == "api_error" and "504" in metadata[0]["api_request_error"]
    assert len(sandbox.requests) == 5

    sandbox.faults[:] = [500]  # verl retries only 504
    score, metadata = _score(sandbox, ADD, case)
    assert score == 0.0 and metadata[0]["status"] == "api_error" and "HTTP 500" in metadata[0]["api_request_error"]
    assert len(sandbox.requests) == 6

    wrong_path = sandbox.url.replace("/run_code", "/nowhere")
    assert sandbox_fusion.compute_score(wrong_path, None, 256, ADD, case)[0] == 0.0


def test_refused_connection_scores_zero(sandbox):
    host, port = sandbox.server_address
    sandbox.shutdown()
    sandbox.server_close()  # nothing listens on this loopback port any more
    score, metadata = sandbox_fusion.compute_score(f"http://{host}:{port}/run_code", None, 256, ADD, SUM_CASES)
    assert score == 0.0 and metadata[0]["status"] == "api_error"


def test_concurrency_capped_by_semaphore(sandbox):
    sleepy = "```python\nimport time\ntime.sleep(0.3)\nprint(input())\n```"
    cases = {"inputs": [f"{i}\n" for i in range(6)], "outputs": [f"{i}\n" for i in range(6)]}
    assert sandbox_fusion.compute_score(sandbox.url, threading.Semaphore(2), 256, sleepy, cases)[0] == 1.0
    assert sandbox.max_in_flight == 2
    sandbox.max_in_flight = 0
    assert sandbox_fusion.compute_score(sandbox.url, None, 256, sleepy, cases)[0] == 1.0
    assert sandbox.max_in_flight > 2  # without the cap the cases do run at the same time


def test_default_compute_score_routes_code_sources_to_the_url(sandbox):
    semaphore = threading.Semaphore(1)
    for source in ("codecontests", "apps", "codeforces", "taco"):
        score = default_compute_score(source, ALWAYS_3, SUM_CASES, None, sandbox.url, semaphore, 300)
        assert score == 0.5 and isinstance(score, float)
    assert len(sandbox.requests) == 8 and {r["memory_limit_MB"] for r in sandbox.requests} == {300}
    assert sandbox.max_in_flight == 1
    # other data sources ignore the sandbox arguments
    assert default_compute_score("openai/gsm8k", "#### 3", "3", sandbox_fusion_url=sandbox.url) == 1.0
    assert len(sandbox.requests) == 8


# ---------------------------------------------------------------------------------- reward manager path
class _CharTokenizer:
    """One token per character (its code point); 0 is padding."""

    eos_token = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def _batch(responses, ground_truths, data_sources):
    length = max(len(r) for r in responses)
    ids = torch.zeros((len(responses), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, text in enumerate(responses):
        ids[row, : len(text)] = torch.tensor([ord(c) for c in text])
        mask[row, : len(text)] = 1
    prompts = torch.full((len(responses), 2), ord("q"))
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": ids,
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones_like(prompts), mask], dim=1),
        },
        non_tensors={
            "data_source": np.array(data_sources, dtype=object),
            "reward_model": np.array([{"ground_truth": gt} for gt in ground_truths], dtype=object),
            "extra_info": np.array([{} for _ in responses], dtype=object),
        },
    )


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _sandbox_config(sandbox, *overrides):
    return _compose(f"++reward.sandbox_fusion.url={sandbox.url}", *overrides)


def test_load_reward_manager_scores_code_through_the_configured_sandbox(sandbox):
    config = _sandbox_config(
        sandbox, "++reward.sandbox_fusion.max_concurrent=1", "++reward.sandbox_fusion.memory_limit_mb=321"
    )
    manager = load_reward_manager(config, _CharTokenizer(), num_examine=0)
    assert isinstance(manager, NaiveRewardManager)
    data = _batch([ADD, SUB, ALWAYS_3], [json.dumps(SUM_CASES)] * 3, ["codecontests", "apps", "taco"])
    tensor, _ = compute_reward(data, manager)
    assert tensor.sum(-1).tolist() == [1.0, 0.0, 0.5]
    assert tensor[0, len(ADD) - 1] == 1.0  # at the last response token
    assert len(sandbox.requests) == 6 and {r["memory_limit_MB"] for r in sandbox.requests} == {321}
    assert sandbox.max_in_flight == 1


def test_batch_manager_gets_the_sandbox_bound_batch_scorer(sandbox):
    config = _sandbox_config(sandbox, "++reward.sandbox_fusion.max_concurrent=1", "++reward.reward_manager.name=batch")
    manager = load_reward_manager(config, _CharTokenizer(), num_examine=0)
    assert isinstance(manager, BatchRewardManager)
    data = _batch([ADD, ALWAYS_3], [SUM_CASES] * 2, ["codeforces", "openai/gsm8k"])
    assert compute_reward(data, manager)[0].sum(-1).tolist() == [1.0, 0.0]
    assert len(sandbox.requests) == 2 and sandbox.max_in_flight == 1
    assert {r["memory_limit_MB"] for r in sandbox.requests} == {1024}  # verl's default


def test_prime_manager_shares_a_process_safe_cap(sandbox):
    config = _sandbox_config(sandbox, "++reward.sandbox_fusion.max_concurrent=1")
    scorer = sandbox_fusion_compute_score(config, PrimeRewardManager)
    assert not isinstance(scorer.keywords["concurrent_semaphore"], type(threading.Semaphore()))
    manager = PrimeRewardManager(_CharTokenizer(), 0, compute_score=scorer, num_processes=2)
    sleepy = "```python\nimport time\ntime.sleep(0.2)\nprint(sum(map(int, input().split())))\n```"
    tensor, _ = compute_reward(_batch([sleepy, sleepy], [SUM_CASES] * 2, ["apps", "apps"]), manager)
    assert tensor.sum(-1).tolist() == [1.0, 1.0]
    assert len(sandbox.requests) == 4 and sandbox.max_in_flight == 1  # one cap across both processes


def test_sandbox_config_absent_or_invalid(sandbox):
    assert sandbox_fusion_compute_score(_compose(), NaiveRewardManager) is None  # no url: the local sandbox
    assert sandbox_fusion_compute_score({}, NaiveRewardManager) is None
    with pytest.raises(ValueError, match=r"reward.sandbox_fusion.max_concurrent=0; allowed: an integer >= 1"):
        sandbox_fusion_compute_score(
            _sandbox_config(sandbox, "++reward.sandbox_fusion.max_concurrent=0"), NaiveRewardManager
        )
    with pytest.raises(ValueError, match=r"reward.sandbox_fusion.memory_limit_mb='big'"):
        sandbox_fusion_compute_score(
            _sandbox_config(sandbox, "++reward.sandbox_fusion.memory_limit_mb=big"), NaiveRewardManager
        )
