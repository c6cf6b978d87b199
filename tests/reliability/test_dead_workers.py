"""Dead and stuck workers: a worker process killed mid-step ends the run within a bounded time with the role
and rank named and the last checkpoint intact; a reward call that hangs is cut off by `reward_model.timeout_s`;
an LLM-judge endpoint that refuses connections or answers garbage is retried, then scored per `on_error`.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ppo_e2e import grpo_args, run_ppo, wait_until_gone, write_data
from tests.reliability.fault_rewards import tree_hashes
from verl.protocol import DataProto
from verl.trainer.ppo import checkpoint as ckpt
from verl.utils.tokenizer import hf_tokenizer
from verl.workers.reward_manager import BatchRewardManager, NaiveRewardManager, RewardFunctionError
from verl.workers.reward_manager.base import call_with_timeout

FAULT_REWARDS = Path(__file__).resolve().parent / "fault_rewards.py"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return hf_tokenizer(tiny_model_dir)


def _batch(tokenizer, ground_truths: list, data_source: str = "gsm8k") -> DataProto:
    """One step's reward inputs: every response is "the answer is 4", scored against `ground_truths`."""
    ids = tokenizer.encode("the answer is 4", add_special_tokens=False)
    n = len(ground_truths)
    responses = torch.tensor([ids] * n)
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": torch.ones_like(responses)},
        non_tensors={
            "data_source": np.array([data_source] * n, dtype=object),
            "reward_model": np.array([{"ground_truth": gt} for gt in ground_truths], dtype=object),
        },
    )


# ------------------------------------------------------------------------------------------ hanging rewards
def _hangs_on_row_one(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "hang":
        time.sleep(600)
    if ground_truth == "spin":
        while True:
            pass
    return 1.0


@pytest.mark.parametrize("hang", ["hang", "spin"])
def test_hanging_reward_is_cut_off_and_scored_per_on_error(tokenizer, hang):
    batch = _batch(tokenizer, ["4", hang, "4"])
    manager = NaiveRewardManager(tokenizer, 0, compute_score=_hangs_on_row_one, timeout_s=0.5, on_error="zero")
    start = time.monotonic()
    out = manager(batch, return_dict=True)
    assert time.monotonic() - start < 5
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0]
    assert out["reward_extra_info"]["reward_errors"] == [0, 1, 0]

    strict = NaiveRewardManager(tokenizer, 0, compute_score=_hangs_on_row_one, timeout_s=0.5)
    with pytest.raises(RewardFunctionError, match=r"row 1 .*TimeoutError: scoring took longer than 0.5 s"):
        strict(batch)


def test_hanging_batch_reward_is_cut_off(tokenizer):
    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        time.sleep(600)

    manager = BatchRewardManager(tokenizer, 0, compute_score=batch_score, timeout_s=0.3, on_error="zero")
    start = time.monotonic()
    out = manager(_batch(tokenizer, ["4", "4"]), return_dict=True)
    assert time.monotonic() - start < 5
    assert out["reward_tensor"].sum().item() == 0.0 and out["reward_extra_info"]["reward_errors"] == [1, 1]


def test_timeout_restores_the_callers_alarm_and_needs_the_main_thread():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert call_with_timeout(0.5, lambda x: x + 1, (1,)) == 2
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 29.0 < remaining <= 30.0 and fired == []
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    errors = []
    thread = threading.Thread(target=lambda: _record(errors, lambda: call_with_timeout(1.0, print)))
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match=r"reward_model.timeout_s=0; allowed: null \(no limit\) or seconds > 0"):
        NaiveRewardManager(None, 0, timeout_s=0)


def _record(errors: list, fn) -> None:
    try:
        fn()
    except Exception as err:
        errors.append(err)


# ------------------------------------------------------------------------------------------ the LLM judge
class _GarbageJudge(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        payload = b"<html>502 upstream hiccup</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def garbage_judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GarbageJudge)
    server.requests = 0
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _refused_url() -> str:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once this socket is closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def test_judge_refusing_connections_is_retried_then_scored_per_on_error(tokenizer):
    config = {"url": _refused_url(), "model": "judge", "max_retries": 2, "backoff_s": 0.01}
    batch = _batch(tokenizer, ["4", "5"], data_source="llm_judge")
    manager = NaiveRewardManager(tokenizer, 0, on_error="zero", config=config)
    out = manager(batch, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [0.0, 0.0]
    assert out["reward_extra_info"]["reward_errors"] == [1, 1]
    with pytest.raises(RewardFunctionError, match=r"row 0 .*llm_judge.*after 3 attempt\(s\): cannot reach"):
        NaiveRewardManager(tokenizer, 0, config=config)(batch)
    # the judge's own on_error: a number is the score, and the sample is not an error
    scored = NaiveRewardManager(tokenizer, 0, on_error="zero", config={**config, "on_error": -1.0})
    out = scored(batch, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [-1.0, -1.0] and out["reward_extra_info"]["reward_errors"] == [0, 0]


def test_judge_answering_garbage_is_retried_then_scored_per_on_error(tokenizer, garbage_judge):
    url = f"http://127.0.0.1:{garbage_judge.server_address[1]}/v1"
    config = {"url": url, "model": "judge", "max_retries": 2, "backoff_s": 0.01}
    manager = NaiveRewardManager(tokenizer, 0, on_error="zero", config=config)
    out = manager(_batch(tokenizer, ["4"], data_source="llm_judge"), return_dict=True)
    assert garbage_judge.requests == 3  # the first try and 2 retries
    assert out["reward_tensor"].sum().item() == 0.0 and out["reward_extra_info"]["reward_errors"] == [1]


# ------------------------------------------------------------------------------------------ a dead worker
@pytest.mark.slow
@pytest.mark.ray
def test_worker_killed_mid_step_fails_fast_naming_role_and_rank(tiny_model_dir, tmp_path):
    data_dir = write_data(tmp_path, n_train=16)
    run_dir, fault_log, tag = tmp_path / "run", tmp_path / "fault.json", uuid.uuid4().hex
    args = grpo_args(
        tiny_model_dir,
        data_dir,
        run_dir,
        "trainer.total_training_steps=4",
        f"custom_reward_function.path={FAULT_REWARDS}",
        "custom_reward_function.name=rlla_or_kill_worker",
    )
    env = {"KILL_WORKER_AT_STEP": "2", "FAULT_RUN_DIR": str(run_dir), "FAULT_LOG": str(fault_log)}
    proc = run_ppo(args, cwd=tmp_path, check=False, tag=tag, **env)
    ended = time.time()

    assert proc.returncode == 1, proc.stderr[-3000:]
    record = json.loads(fault_log.read_text())
    assert record["pids"], "no worker process was found to kill"
    assert ended - record["killed_at"] < 60, "the driver did not fail within 60 s of the worker's death"
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: WorkerDiedError: step 2: 'compute_log_prob' on role 'actor_rollout_ref'"), last
    assert "rank 0 failed: the worker died" in last
    # the checkpoint of step 1 is the latest, complete, and unchanged since the moment of the kill
    assert record["latest"] == ckpt.step_dir(str(run_dir), 1) == ckpt.find_latest_checkpoint(str(run_dir))
    assert ckpt.is_complete(record["latest"]) and tree_hashes(record["latest"]) == record["hashes"]
    assert ckpt.complete_steps(str(run_dir)) == [1]
    assert wait_until_gone(tag) == [], "the failed run left processes behind"
