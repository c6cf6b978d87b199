"""Tests of `python -m verl.rollout_server` (verl/rollout_server.py): a real server process on 127.0.0.1 serving
the tiny Qwen2 model. Plain HTTP (urllib) always; the `openai` package's own clients when it is installed,
including a verifiers-style `GSM8KEnv` driving a rollout over HTTP. Greedy answers are compared with the
in-process client on the same model; concurrent requests are batched into fewer generate calls."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.envs.openai_client import OpenAIClient
from verl.rollout_server import main
from verl.workers.rollout.hf_rollout import HFRollout

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.rollout_server", "--model", tiny_model_dir, "--port", "0", "--max-tokens", "12",
         "--window-ms", "200", "--served-model-name", "tiny", "--engine", "hf"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:  # model-loading progress comes first, then "serving 'tiny' on http://..."
        seen.append(line)
        if line.startswith("serving"):
            break
    else:
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(seen))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
    yield line.strip().split(" on ")[-1]
    proc.terminate()
    proc.wait(timeout=30)


def request(url, path, body=None):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(
        url.removesuffix("/v1") + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def in_process(tiny_model_dir):
    """An in-process client over the same model: the reference for greedy answers."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    config = OmegaConf.create({"response_length": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                               "do_sample": True, "seed": 0})  # fmt: skip
    return OpenAIClient(HFRollout(model, config, tokenizer), tokenizer)


def test_plain_http_chat_and_completions(server, in_process):
    status, models = request(server, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    status, chat = request(server, "/v1/chat/completions",
                           {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 8, "logprobs": True})  # fmt: skip
    assert status == 200, chat
    reference = asyncio.run(
        in_process.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=8)
    )
    choice = chat["choices"][0]
    assert choice["message"]["content"] == reference.choices[0].message.content
    assert (
        choice["token_ids"] == reference.choices[0].token_ids and chat["prompt_token_ids"] == reference.prompt_token_ids
    )
    assert chat["usage"]["completion_tokens"] == len(choice["token_ids"]) <= 8
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        in_process.records[-1].logprobs, abs=1e-5
    )
    assert choice["finish_reason"] in ("stop", "length") and chat["object"] == "chat.completion"

    status, completion = request(server, "/v1/completions",
                                 {"model": "tiny", "prompt": ["Hello", "Bye"], "n": 2, "max_tokens": 4})  # fmt: skip
    assert status == 200 and [c["index"] for c in completion["choices"]] == [0, 1, 2, 3]
    assert all(1 <= len(c["token_ids"]) <= 4 for c in completion["choices"])


def test_bad_requests_get_json_errors(server):
    status, body = request(server, "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
    assert status == 400 and "stream=True is not supported" in body["error"]["message"]
    status, body = request(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 50})
    assert status == 400 and "max_new_tokens=50 exceeds" in body["error"]["message"]
    status, body = request(server, "/v1/chat/completions", {"messages": MESSAGES, "best_of": 3})
    assert status == 400 and "best_of" in body["error"]["message"]
    status, body = request(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = request(server, "/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["type"] == "not_found"
    status, _ = request(server, "/health")
    assert status == 200


def test_concurrent_requests_are_batched(server):
    _, before = request(server, "/stats")
    results = []

    def ask(i):
        results.append(request(server, "/v1/completions", {"prompt": f"Question {i}", "max_tokens": 4}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, after = request(server, "/stats")
    assert [status for status, _ in results] == [200] * 8
    assert after["requests"] - before["requests"] == 8
    assert after["generate_calls"] - before["generate_calls"] < 8


def test_host_other_than_localhost_is_refused(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", tiny_model_dir, "--host", "0.0.0.0"])
    assert exit_info.value.code == 2 and "binds only to" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "missing")])
    assert "is not a directory" in capsys.readouterr().err


def test_openai_client_and_an_environment_over_http(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server, api_key="unused")
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6)
    assert isinstance(chat.choices[0].message.content, str) and chat.usage.completion_tokens <= 6
    assert chat.model_extra.get("prompt_token_ids") or chat.prompt_token_ids  # the extras survive the client
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=99)

    from verl.envs.gsm8k import GSM8KEnv

    env = GSM8KEnv(sampling_args={"max_tokens": 8}, model="tiny")
    result = asyncio.run(env.run(openai.AsyncOpenAI(base_url=server, api_key="unused"), MESSAGES, "13"))
    assert result.completion[0]["role"] == "assistant" and set(result.metrics) == {"correct_answer", "answer_format"}
    assert result.reward == result.metrics["correct_answer"] + 0.1 * result.metrics["answer_format"]
