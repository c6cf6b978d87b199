"""`python -m verl.rollout_server`: an OpenAI-compatible HTTP server over a rollout engine, on 127.0.0.1.

Routes (a FastAPI app, `create_app`, served by uvicorn): POST /v1/chat/completions and /v1/completions (sampling
arguments as in verl.envs.openai_client), GET /v1/models, /health and /stats. Requests go to one
`AsyncRolloutEngine` on its own event-loop thread, so concurrent requests are batched (`--window-ms`). Responses
carry `prompt_token_ids` and per choice `token_ids`; no streaming; errors are JSON `{"error": {...}}` with 400, 404
or 500. `--engine vllm` (picked by `auto` where vLLM is installed) runs vLLM's own OpenAI server as a child
process instead, with the `TokenIdsByDefault` middleware (no /stats).
Layer 8 (an entry point): must not import Ray or the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

LOCAL_HOSTS = ("127.0.0.1", "localhost")


class RolloutService:
    """The engine, the client and the event loop behind the HTTP routes."""

    def __init__(self, model_path: str, model_name: str, max_tokens: int, device: str = "cpu", seed: int = 0,
                 window_ms: float = 5.0, max_batch_size: int | None = None, dtype: str = "float32"):  # fmt: skip
        import torch
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl.envs.openai_client import OpenAIClient
        from verl.workers.rollout.async_engine import AsyncRolloutEngine
        from verl.workers.rollout.hf_rollout import HFRollout

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        module = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
        config = OmegaConf.create({"response_length": int(max_tokens), "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                   "do_sample": True, "seed": int(seed), "calculate_log_probs": True})  # fmt: skip
        self.engine = AsyncRolloutEngine(HFRollout(module, config, self.tokenizer), {},
                                         window_s=window_ms / 1000.0, max_batch_size=max_batch_size)  # fmt: skip
        self.client = OpenAIClient(self.engine, self.tokenizer, model=model_name, record=False)
        self.model_name = model_name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-engine", daemon=True)
        self.thread.start()

    async def run(self, coro) -> Any:
        """Await a coroutine run on the engine's loop (from another loop: uvicorn's)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def chat(self, body: dict) -> dict:
        return (await self.run(self.client.chat.completions.create(**body))).model_dump()

    async def completion(self, body: dict) -> dict:
        return (await self.run(self.client.completions.create(**body))).model_dump()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "verl"}]}

    def stats(self) -> dict:
        return {"requests": self.engine.num_requests, "generate_calls": self.engine.num_generate_calls}

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def create_app(service: RolloutService) -> Any:
    """The FastAPI app of the routes above; trailing slashes stripped (an ASGI app to give uvicorn)."""

    class JSON(JSONResponse):  # rendered as json.dumps does (ASCII; a non-finite log-prob is not a 500)
        def render(self, content: Any) -> bytes:
            return json.dumps(content).encode()

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSON:
        return JSON({"error": {"message": message, "type": kind}}, status_code=status)

    app = FastAPI(title="verl.rollout_server", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # fmt: skip

    @app.exception_handler(HTTPException)  # no route for this path (404) or this method (405): both a JSON 404
    async def no_route(request: Request, _: HTTPException) -> JSON:
        method, path = request.method, request.scope["path"]
        routes = sorted(route.path for route in app.routes if method in getattr(route, "methods", ()))
        return error(404, f"no route {method} {path}; routes: {routes}", "not_found")

    async def answer(request: Request, create: Any) -> JSON:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as err:
            return error(400, f"the request body is not valid JSON: {err}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        try:
            return JSON(await create(body))
        except (ValueError, TypeError, KeyError) as err:
            return error(400, f"{type(err).__name__}: {err}")
        except Exception as err:  # an engine failure: report it, keep serving
            return error(500, f"{type(err).__name__}: {err}", "server_error")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSON:
        return await answer(request, service.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSON:
        return await answer(request, service.completion)

    @app.get("/v1/models")
    async def models() -> JSON:
        return JSON(service.models())

    @app.get("/health")
    async def health() -> JSON:
        return JSON({"status": "ok"})

    @app.get("/stats")
    async def stats() -> JSON:
        return JSON(service.stats())

    async def strip_slash(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "path": scope["path"].rstrip("/") or "/"}
        await app(scope, receive, send)

    return strip_slash


# ---------------------------------------------------------------------------------------------- vLLM's server
TOKEN_ID_ROUTES = ("/v1/chat/completions", "/v1/completions")


class TokenIdsByDefault:
    """ASGI middleware for vLLM's OpenAI server (`--middleware verl.rollout_server.TokenIdsByDefault`): a POST to
    `TOKEN_ID_ROUTES` whose JSON body does not say `return_token_ids` gets `return_token_ids: true`, so the response
    carries `prompt_token_ids` and each choice's `token_ids`, as this package's own server always does."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in TOKEN_ID_ROUTES:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request = json.loads(body or b"{}")
        except ValueError:  # vLLM answers a body that is not JSON with its own error
            request = None
        if isinstance(request, dict) and "return_token_ids" not in request:
            request["return_token_ids"] = True
            body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def vllm_server_command(args: argparse.Namespace, name: str, port: int, device: str) -> list[str]:
    """The command line of vLLM's OpenAI server for this server's arguments."""
    from transformers import AutoConfig

    from verl.workers.rollout.base import engine_dtype
    from verl.workers.rollout.vllm_rollout import cpu_kv_cache_bytes

    seqs = int(args.max_batch_size or 64)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", args.host,
        "--port", str(port), "--served-model-name", name, "--dtype", args.dtype, "--seed", str(args.seed),
        "--max-num-seqs", str(seqs), "--middleware", "verl.rollout_server.TokenIdsByDefault",
        "--override-generation-config", json.dumps({"max_new_tokens": int(args.max_tokens)}),
    ]  # fmt: skip
    if device == "cpu":  # what VLLMRollout does on CPU (verl.workers.rollout.vllm_rollout.apply_platform_limits)
        hf_config = AutoConfig.from_pretrained(args.model)
        model_len = int(getattr(hf_config, "max_position_embeddings", 4096))
        kv_bytes = cpu_kv_cache_bytes(hf_config, engine_dtype(args.dtype), seqs, model_len, cap=8 << 30)
        cmd += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(model_len),
                "--kv-cache-memory-bytes", str(kv_bytes)]  # fmt: skip
    return cmd


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_with_vllm(args: argparse.Namespace, name: str, device: str, ready_timeout_s: float = 600.0) -> int:
    """Run vLLM's OpenAI server as a child process until it exits or this process is stopped; returns its code."""
    host = "127.0.0.1" if args.host == "localhost" else args.host
    port = args.port or _free_port(host)
    child = subprocess.Popen(vllm_server_command(args, name, port, device))

    def stop(*_: Any) -> None:
        child.terminate()

    signal.signal(signal.SIGTERM, stop)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + ready_timeout_s
    try:
        while child.poll() is None:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not answer {url}/health within {ready_timeout_s:.0f} s")
            time.sleep(0.5)
        else:
            print(f"error: vLLM's server exited with code {child.returncode} before serving", file=sys.stderr)
            return child.returncode or 1
        print(f"serving {name!r} on {url}/v1 (vLLM)", flush=True)
        return child.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def choose_engine(engine: str, device: str) -> str:
    """`--engine`: hf or vllm as asked (vllm where it cannot run here is an error), auto: vllm where it is
    installed for `device`, else hf."""
    from verl.workers.rollout import engine_device

    where = engine_device("vllm")
    runs_here = where == device
    if engine == "auto":
        return "vllm" if runs_here else "hf"
    if engine == "vllm" and not runs_here:
        found = "not installed" if where is None else f"installed for {where}"
        raise ValueError(f"--engine vllm: vllm is {found}, not for --device {device}; use --engine hf")
    return engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (causal LM + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="only 127.0.0.1 / localhost are allowed")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (printed at start)")
    parser.add_argument("--served-model-name", default=None, help="model name in responses (default: folder name)")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens one completion may generate")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="base seed of generation")
    parser.add_argument("--window-ms", type=float, default=5.0, help="how long a request waits for others to batch")
    parser.add_argument("--max-batch-size", type=int, default=None, help="most requests per generate call")
    parser.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"],
                        help="hf: this package's server; vllm: vLLM's OpenAI server; auto: vllm where installed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.host not in LOCAL_HOSTS:
        parser.error(f"--host {args.host!r}: this server binds only to {LOCAL_HOSTS} (no authentication)")
    if not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is not a directory (a Hugging Face model folder is needed)")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    try:
        engine = choose_engine(args.engine, args.device)
    except ValueError as err:
        parser.error(str(err))
    if engine == "vllm":
        sys.exit(serve_with_vllm(args, name, args.device))
    service = RolloutService(args.model, name, args.max_tokens, args.device, args.seed, args.window_ms,
                             args.max_batch_size, args.dtype)  # fmt: skip
    sock = socket.socket()  # bound and listening before the "serving" line: a request sent then waits, then is served
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False))
    print(f"serving {name!r} on http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        server.run(sockets=[sock])  # SIGTERM / Ctrl-C: finish the requests in flight, then stop
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        service.close()


if __name__ == "__main__":
    main()
