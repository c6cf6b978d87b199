"""Reward workers as Ray actors: one group per reward type scores its rows (several actors per type), rows come back
in the batch's order with the scorer's exact values, a domain that names a data source is scored as it, the judge
group scores in parallel against a loopback OpenAI-compatible server, and every actor reports system metrics."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.domains import DomainSpec
from verl.utils.dataset.rlla_synthetic import generate_records
from verl.utils.reward_score.reward_types import make_compute_score
from verl.workers.reward_workers import DomainRewardFn, RewardWorkerPool, check_reward_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JUDGE_DELAY_S = 1.5


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        with self.server.lock:
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        time.sleep(JUDGE_DELAY_S)
        with self.server.lock:
            self.server.in_flight -= 1
        score = 1 if "Response: yes" in prompt else 0
        payload = json.dumps({"choices": [{"message": {"content": f"Score: {score}"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.lock, server.in_flight, server.max_in_flight = threading.Lock(), 0, 0
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


RLLA = generate_records(2, seed=4)
CODE_TESTS = json.dumps({"inputs": ["1\n", "5\n"], "outputs": ["2\n", "6\n"]})
IFEVAL = json.dumps([{"type": "lowercase"}, {"type": "word_count", "max": 3}])
# (domain, data_source, response, ground truth, intended score)
ROWS = [
    ("math", "openai/gsm8k", "so #### 42", "42", 1.0),
    ("tools", "rlla", RLLA[0]["output"], RLLA[0]["output"], None),
    ("code", "code", "```python\nprint(int(input()) + 1)\n```", CODE_TESTS, 1.0),
    ("math", "openai/gsm8k", "#### 7", "8", 0.0),
    ("inst", "ifeval", "all lower case", IFEVAL, 1.0),
    ("boxed", "openai/gsm8k", "it is \\boxed{3}", "3", 1.0),  # scored as data source "math", not gsm8k
    ("code", "code", "```python\nprint(0)\n```", CODE_TESTS, 0.0),
    ("inst", "ifeval", "Too Many Words Here", IFEVAL, 0.0),
    ("tools", "rlla", "no tags at all", RLLA[1]["output"], None),
    ("math", "openai/gsm8k", "#### 1", "1", 1.0),
]
SPECS = [
    DomainSpec("math", ("m",), (), "math_rule", None),
    DomainSpec("tools", ("t",), (), "rlla", None),
    DomainSpec("code", ("c",), (), "code_sandbox", None),
    DomainSpec("inst", ("i",), (), "ifeval", None),
    DomainSpec("boxed", ("b",), (), "math_rule", "math"),
    DomainSpec("judged", ("j",), (), "llm_judge", None),
]


def _config(judge_server):
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {"on_error": "raise"},
            "actor_rollout_ref": {"model": {"trust_remote_code": False}},
            "reward": {
                "math_rule": {"num_workers": 1},
                "code_sandbox": {"num_workers": 1, "score_kwargs": {"timeout_s": 10}},
                "llm_judge": {
                    "num_workers": 2,
                    "score_kwargs": {"url": f"http://127.0.0.1:{judge_server.server_address[1]}/v1", "model": "j"},
                },
            },
        }
    )


@pytest.fixture(scope="module")
def pool(ray_session, tiny_model_dir, judge_url):
    pool = RewardWorkerPool(_config(judge_url), SPECS, tiny_model_dir)
    pool.wait_ready()
    return pool


def _batch(tokenizer, rows, response_length=256):
    bs = len(rows)
    responses = torch.full((bs, response_length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(bs, response_length, dtype=torch.long)
    for i, (_, _, text, _, _) in enumerate(rows):
        ids = tokenizer.encode(text, add_special_tokens=False)[: response_length - 1] + [tokenizer.eos_token_id]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return DataProto.from_single_dict(
        {
            "responses": responses,
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones(bs, 3, dtype=torch.long), mask], dim=1),
            "domain": np.array([r[0] for r in rows], dtype=object),
            "data_source": np.array([r[1] for r in rows], dtype=object),
            "reward_model": np.array([{"ground_truth": r[3]} for r in rows], dtype=object),
            "extra_info": np.array([{"index": i} for i in range(bs)], dtype=object),
        }
    )


def test_rows_are_scored_by_their_domains_type_in_the_original_order(pool, tiny_model_dir):
    from verl.utils.tokenizer import hf_tokenizer

    tokenizer = hf_tokenizer(tiny_model_dir)
    batch = _batch(tokenizer, ROWS)
    result = pool.reward_fn()(batch, return_dict=True)
    tensor, extra = result["reward_tensor"], result["reward_extra_info"]
    types = {spec.name: (spec.reward_type, spec.data_source) for spec in SPECS}
    for row, (domain, source, _, truth, intended) in enumerate(ROWS):
        length = int(batch.batch["response_mask"][row].sum())
        text = tokenizer.decode(batch.batch["responses"][row, :length].tolist(), skip_special_tokens=True)
        reward_type, forced = types[domain]
        expected = make_compute_score(reward_type)(forced or source, text, truth, {"index": row})
        expected = expected["score"] if isinstance(expected, dict) else expected
        assert tensor[row].sum().item() == pytest.approx(expected), (row, domain)
        assert tensor[row, length - 1].item() == pytest.approx(expected)  # at the last response token
        if intended is not None:
            assert expected == intended, (row, text)  # the test data means what it says
    assert tensor[1].sum().item() > tensor[8].sum().item()  # the right tool call beats no tags at all
    # rlla's extra fields for rlla rows, None for the others; ifeval's acc for ifeval rows
    assert extra["format"][1] == 1.0 and extra["format"][0] is None
    assert extra["acc"][4] == 1.0 and extra["acc"][7] == 0.0 and extra["acc"][2] is None


@pytest.mark.serial  # asserts wall time or CPU share: run alone (scripts/run_tests.sh)
def test_judge_group_scores_in_parallel_and_workers_report_system_metrics(pool, tiny_model_dir, judge_url):
    from verl.utils.tokenizer import hf_tokenizer

    rows = [("judged", "llm_judge", text, "yes", None) for text in ("yes", "no", "yes", "no")]
    batch = _batch(hf_tokenizer(tiny_model_dir), rows)
    start = time.perf_counter()
    scores = pool.reward_fn()(batch).sum(-1).tolist()
    elapsed = time.perf_counter() - start
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert judge_url.max_in_flight == 2  # two actors, each asking for one row at a time
    assert elapsed < 4 * JUDGE_DELAY_S - 0.5, elapsed  # one actor alone would need 4 x 1.5 s
    metrics = pool.system_metrics()
    for name in ("reward_math_rule_0", "reward_llm_judge_0", "reward_llm_judge_1", "reward_ifeval_0"):
        assert metrics[f"system/{name}/rss_gb"] > 0.05 and f"system/{name}/cpu_percent" in metrics


def test_bad_reward_worker_settings_are_clear_errors():
    with pytest.raises(ValueError, match="reward.rlla.num_workers=0 must be a positive integer"):
        check_reward_config(OmegaConf.create({"reward": {"rlla": {"num_workers": 0}}}), ["rlla"])
    with pytest.raises(ValueError, match="reward.ifeval.score_kwargs must be a mapping"):
        check_reward_config(OmegaConf.create({"reward": {"ifeval": {"score_kwargs": [1]}}}), ["ifeval"])
    for config in (
        {"reward": {"custom_reward_function": {"path": "r.py"}}},
        {"custom_reward_function": {"path": "r.py"}},
    ):
        with pytest.raises(ValueError, match="custom_reward_function.path is set together with data.domains"):
            check_reward_config(OmegaConf.create(config), ["rlla"])
    for config in ({"reward": {"reward_manager": {"name": "dapo"}}}, {"reward_model": {"reward_manager": "dapo"}}):
        with pytest.raises(ValueError, match="reward.reward_manager.name='dapo' with data.domains"):
            check_reward_config(OmegaConf.create(config), ["rlla"])
    check_reward_config(OmegaConf.create({"reward": {"reward_manager": {"name": "naive"}}}), ["rlla"])
    batch = DataProto.from_single_dict({"domain": np.array(["poetry"], dtype=object)})
    with pytest.raises(KeyError, match="row 0 has domain 'poetry', not one of data.domains \\['math'\\]"):
        DomainRewardFn({}, {"math": ("math_rule", None)})._rows_by_type(batch)
