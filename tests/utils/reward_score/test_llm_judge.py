"""The LLM judge against a real HTTP server on 127.0.0.1 that speaks /v1/chat/completions."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verl.utils.fsdp_utils import free_port
from verl.utils.reward_score import default_compute_score, llm_judge
from verl.utils.reward_score.llm_judge import JudgeError, compute_score, resolve_config


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            reply = server.replies.pop(0) if len(server.replies) > 1 else server.replies[0]
        status, content, delay = reply
        time.sleep(delay)
        with server.lock:
            server.in_flight -= 1
        if content is None:  # a body that is not a chat completion
            payload = b"<html>oops</html>"
        else:
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def judge_server():
    """Start a server; `server.replies` is a list of (status, content, delay_s), the last one repeats."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.lock = threading.Lock()
    server.requests, server.replies = [], [(200, "Score: 1", 0.0)]
    server.in_flight = server.max_in_flight = 0
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield server
    server.shutdown()
    server.server_close()


def _cfg(server, **extra):
    return {"url": server.base_url, "model": "judge-1", "backoff_s": 0.01, "timeout_s": 5, **extra}


def test_correct_score_and_request_shape(judge_server):
    judge_server.replies = [(200, "Looks right.\nScore: 0 would be wrong, so Score: 1", 0.0)]
    score = compute_score("x = 4", "4", extra_info={"question": "2+2?"}, config=_cfg(judge_server, api_key="k"))
    assert score == 1.0  # the last match wins
    (request,) = judge_server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["auth"] == "Bearer k"
    assert request["body"]["model"] == "judge-1"
    prompt = request["body"]["messages"][0]["content"]
    assert "2+2?" in prompt and "Reference answer: 4" in prompt and "Response: x = 4" in prompt


def test_custom_template_and_regex(judge_server):
    judge_server.replies = [(200, "grade=7/10", 0.0)]
    cfg = _cfg(judge_server, prompt_template="Grade {solution} vs {ground_truth}", score_regex=r"grade=(\d+)/10")
    assert compute_score("a", "b", config=cfg) == 7.0
    assert judge_server.requests[0]["body"]["messages"][0]["content"] == "Grade a vs b"


def test_garbage_answer_is_retried_then_raises_or_scores_on_error(judge_server):
    judge_server.replies = [(200, "I cannot decide.", 0.0)]
    with pytest.raises(JudgeError, match="after 3 attempt"):
        compute_score("a", "b", config=_cfg(judge_server, max_retries=2))
    assert len(judge_server.requests) == 3
    judge_server.replies = [(200, None, 0.0)]  # not even JSON
    assert compute_score("a", "b", config=_cfg(judge_server, max_retries=1, on_error=0.0)) == 0.0
    assert len(judge_server.requests) == 5


def test_transient_server_error_then_success(judge_server):
    judge_server.replies = [(503, "busy", 0.0), (200, "Score: 0.5", 0.0)]
    assert compute_score("a", "b", config=_cfg(judge_server)) == 0.5
    assert len(judge_server.requests) == 2


def test_client_error_is_not_retried(judge_server):
    judge_server.replies = [(400, "bad request", 0.0)]
    with pytest.raises(JudgeError, match="HTTP 400"):
        compute_score("a", "b", config=_cfg(judge_server, max_retries=3))
    assert len(judge_server.requests) == 1


def test_refused_connection_is_retried_then_raises():
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    with pytest.raises(JudgeError, match="after 3 attempt.*cannot reach"):
        compute_score("a", "b", config={"url": url, "model": "m", "max_retries": 2, "backoff_s": 0.05})
    assert time.monotonic() - start >= 0.05 + 0.1  # backoff 0.05 then 0.1
    assert compute_score("a", "b", url=url, model="m", max_retries=0, on_error=-1) == -1.0


def test_slow_server_times_out(judge_server):
    judge_server.replies = [(200, "Score: 1", 1.0)]
    with pytest.raises(JudgeError, match="cannot reach"):
        compute_score("a", "b", config=_cfg(judge_server, timeout_s=0.2, max_retries=1))
    assert len(judge_server.requests) == 2


def test_concurrency_is_limited_per_process(judge_server):
    judge_server.replies = [(200, "Score: 1", 0.15)]
    cfg = _cfg(judge_server, max_concurrency=2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(compute_score("a", "b", config=cfg))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [1.0] * 6
    assert judge_server.max_in_flight == 2


def test_settings_from_env_and_errors(judge_server, monkeypatch):
    monkeypatch.setenv("VERL_JUDGE_URL", judge_server.base_url + "/chat/completions")
    monkeypatch.setenv("VERL_JUDGE_MODEL", "env-model")
    assert compute_score("a", "b") == 1.0
    assert judge_server.requests[-1]["body"]["model"] == "env-model"
    assert resolve_config({"model": "cfg"}, model="kw").model == "kw"  # kwargs > config > env
    monkeypatch.delenv("VERL_JUDGE_URL")
    with pytest.raises(ValueError, match="VERL_JUDGE_URL"):
        resolve_config()
    with pytest.raises(ValueError, match="unknown llm_judge setting.*temprature"):
        resolve_config({"url": "u", "model": "m", "temprature": 0})
    with pytest.raises(ValueError, match="on_error"):
        resolve_config({"url": "u", "model": "m", "on_error": "zero"})
    with pytest.raises(ValueError, match="allowed fields"):
        compute_score("a", "b", config=_cfg(judge_server, prompt_template="{answer}"))


def test_default_compute_score_routes_to_the_judge(judge_server):
    assert default_compute_score("llm_judge", "a", "b", config=_cfg(judge_server)) == 1.0
    assert llm_judge.DEFAULT_SCORE_REGEX
