"""The request-level engine API (AReaL-lite's `agenerate`) over any rollout engine, with request batching.

Owns `GenerationHyperparameters`, `ModelRequest` / `ModelResponse` and `AsyncRolloutEngine` (also AReaL-lite's
`InferenceEngine`): concurrent `agenerate` calls are queued, flushed after `window_s` in batches of up to
`max_batch_size`, grouped by sampling settings, one `generate_sequences` per group (requests of one event-loop turn
share a batch, in arrival order: deterministic for a seed); a smaller `max_new_tokens` or `stop` cuts a request's
output afterwards. Also `rollout_batch`, `set_version` / `get_version` (stamped on every token), `update_weights`
and `initialize`. Seeds: `meta_info["seed"]` for the first call, derived ones after.
Layer 5: must not import Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Literal

import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.utils.device import get_device_name
from verl.utils.packing import concat_padded_tensors
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.sampling import resolve_sampling, resolve_token_ids

__all__ = [
    "AsyncRolloutEngine",
    "GenerationHyperparameters",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "agenerate_samples",
    "get_async_engine",
    "policy_version",
    "run_sync",
    "token_ids",
]

# Seed stride between the generate calls of one AsyncRolloutEngine (a large prime keeps them apart from the
# per-step seeds `rollout.seed + step` the trainer uses).
_SEED_STRIDE = 1_000_000_007


@dataclass(frozen=True)
class GenerationHyperparameters:
    """Sampling knobs of one request (AReaL's name). `greedy` ignores temperature/top_p/top_k.

    n_samples: completions wanted for the prompt; `agenerate` makes one, `agenerate_samples` makes n_samples.
    max_new_tokens: output budget, at most the engine's `rollout.response_length`.
    stop: strings that end the output (kept in it, as the last tokens); eos always ends it.
    """

    n_samples: int = 1
    greedy: bool = False
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if int(self.n_samples) < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy:
            if self.temperature <= 0:
                raise ValueError(f"temperature must be > 0 when sampling (use greedy=True), got {self.temperature}")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
            if self.top_k == 0 or self.top_k < -1:
                raise ValueError(f"top_k must be -1 (off) or a positive int, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)}")

    def new(self, **changes: Any) -> GenerationHyperparameters:
        """A copy with `changes` applied (AReaL's `gconfig.new(...)`)."""
        return dataclasses.replace(self, **changes)

    def sampling_key(self) -> tuple:
        """Requests with equal keys can share one generate call."""
        if self.greedy:
            return (True, 1.0, 1.0, -1)
        return (False, float(self.temperature), float(self.top_p), int(self.top_k))


@dataclass
class ModelRequest:
    """One generation request: prompt token ids (no padding) and the sampling knobs. `input_ids` becomes a list of
    ints at construction (`token_ids`), so a request made from a tensor or a BatchEncoding fails here if at all."""

    input_ids: list[int]
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_ids = token_ids(self.input_ids)


def token_ids(value: Any) -> list[int]:
    """Prompt token ids as a list of ints, from a list or tuple of ints, a 1-D (or one-row) tensor or array, or a
    BatchEncoding / dict with `input_ids` (what `tokenizer.apply_chat_template(..., tokenize=True)` returns)."""
    ids = value["input_ids"] if isinstance(value, Mapping) and "input_ids" in value else value
    if hasattr(ids, "tolist") and not isinstance(ids, list | tuple):  # a tensor or numpy array
        ids = ids.tolist()
    if isinstance(ids, list | tuple) and len(ids) == 1 and isinstance(ids[0], list | tuple):
        ids = ids[0]  # the one row of a batch
    if isinstance(ids, list | tuple) and all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
        return [int(t) for t in ids]
    shown = f"{type(value).__name__} {value!r}"[:120]
    raise TypeError(
        "ModelRequest.input_ids takes token ids: a list/tuple of ints, a 1-D or one-row tensor, or a BatchEncoding/"
        f"dict with input_ids (apply_chat_template(..., tokenize=True)); got {shown}"
    )


@dataclass
class ModelResponse:
    """One completion. `output_logprobs[i]` is log p(output_tokens[i]) at the request's temperature (1.0 when
    greedy), `output_versions[i]` the policy version that produced it. stop_reason: "stop" (eos or a stop
    string) or "length" (the budget ran out)."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: Literal["stop", "length"]
    rid: str = ""

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


def policy_version(rollout: Any) -> int:
    """The policy version an engine's weights hold (`weight_version`; 0 when it does not track one)."""
    return int(getattr(rollout, "weight_version", 0) or 0)


class AsyncRolloutEngine:
    """`agenerate` over a `BaseRollout`, batching concurrent requests (see the module docstring).

    rollout: the engine (`generate_sequences`, `config`, `tokenizer`, `response_length`).
    meta_info: passed to every generate call (`eos_token_id`, `pad_token_id`, `seed`, `validate`,
        `do_sample`); the trainer's generation meta_info.
    window_s: how long the first request of a burst waits for others.
    max_batch_size: most requests per flush (None = no limit).
    """

    def __init__(
        self,
        rollout: Any,
        meta_info: dict | None = None,
        window_s: float = 0.005,
        max_batch_size: int | None = None,
    ):
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be a positive int or None, got {max_batch_size}")
        self.rollout = rollout
        self.config = rollout.config
        self.tokenizer = getattr(rollout, "tokenizer", None)
        self.meta_info = dict(meta_info or {})
        self.window_s = float(window_s)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.response_length = int(getattr(rollout, "response_length", None) or self.config.response_length)
        generation_config = getattr(getattr(rollout, "module", None), "generation_config", None)
        eos, self.pad_token_id = resolve_token_ids(self.meta_info, self.tokenizer, generation_config)
        self.eos_token_id = eos  # int or list of ints, as the engine takes it
        self.eos_token_ids = set(eos) if isinstance(eos, list) else {eos}
        self._pending: list[tuple[ModelRequest, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self.num_requests = 0
        self.num_generate_calls = 0

    # ------------------------------------------------------------------ knobs
    @property
    def version(self) -> int:
        """meta_info["policy_version"] when the caller knows it (the worker does), else the engine's own."""
        version = self.meta_info.get("policy_version")
        return policy_version(self.rollout) if version is None else int(version)

    def default_gconfig(self) -> GenerationHyperparameters:
        """The sampling the trainer would use for this call: `rollout.*` (or `val_kwargs` when validating,
        greedy when meta_info["do_sample"] is false), budget `rollout.response_length`."""
        sampling = resolve_sampling(self.config, self.meta_info)
        return GenerationHyperparameters(
            greedy=not sampling.do_sample,
            max_new_tokens=self.response_length,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )

    # ------------------------------------------------------------------ requests
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One completion for `req` (n_samples must be 1: use `agenerate_samples` for more)."""
        self._check_request(req)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((req, future))
        self.num_requests += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_loop())
        return await future

    def takes_all_at_once(self, num_requests: int) -> bool:
        """Whether `num_requests` requests of one sampling, made together now, would go into one generate call:
        nothing else is waiting and the batch cap (`max_batch_size`) holds them all."""
        return not self._pending and (self.max_batch_size is None or num_requests <= self.max_batch_size)

    def generate_all(self, requests: list[ModelRequest]) -> list[ModelResponse]:
        """One generate call for `requests` (one sampling, at most `max_batch_size`), now: what concurrent
        `agenerate` calls of them give (`RolloutWorkflow.run_batch` uses it), without the batching window."""
        for req in requests:
            self._check_request(req)
        if len({req.gconfig.sampling_key() for req in requests}) > 1:
            raise ValueError("generate_all takes requests of one sampling (gconfig); use agenerate for mixed ones")
        if not self.takes_all_at_once(len(requests)):
            raise ValueError(f"generate_all: {len(requests)} requests do not fit one call (max_batch_size "
                             f"{self.max_batch_size}, {len(self._pending)} agenerate requests waiting)")  # fmt: skip
        self.num_requests += len(requests)
        return self._generate(requests)

    def _check_request(self, req: ModelRequest) -> None:
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(
                f"agenerate makes one completion, got gconfig.n_samples={g.n_samples}; use "
                "agenerate_samples(engine, request) or n_samples=1"
            )
        if not req.input_ids:
            raise ValueError(f"request {req.rid}: input_ids is empty")
        if g.max_new_tokens > self.response_length:
            raise ValueError(
                f"request {req.rid}: max_new_tokens={g.max_new_tokens} exceeds the engine's "
                f"rollout.response_length={self.response_length}"
            )

    async def _flush_loop(self) -> None:
        while self._pending:
            await asyncio.sleep(self.window_s)
            take = len(self._pending) if self.max_batch_size is None else self.max_batch_size
            batch, self._pending = self._pending[:take], self._pending[take:]
            groups: dict[tuple, list] = {}
            for item in batch:
                groups.setdefault(item[0].gconfig.sampling_key(), []).append(item)
            for items in groups.values():
                self._run_group(items)

    def _run_group(self, items: list[tuple[ModelRequest, asyncio.Future]]) -> None:
        items = [(req, fut) for req, fut in items if not fut.done()]  # cancelled callers
        if not items:
            return
        try:
            responses = self._generate([req for req, _ in items])
        except Exception as err:  # every caller of this group sees the engine's error
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), resp in zip(items, responses):
            if not fut.done():
                fut.set_result(resp)

    # ------------------------------------------------------------------ a hand-written loop's API
    def initialize(self, addr: str | None = None, ft_spec: Any = None) -> None:
        """AReaL-lite's start-up call. The engine generates in this process and is ready once built, so `addr` must
        be None; `ft_spec` (a `FinetuneSpec`) is taken for the signature and not needed."""
        if addr is not None:
            raise ValueError(
                f"InferenceEngine.initialize(addr={addr!r}): this engine generates in this process (addr=None); it "
                "cannot attach to a server. Serve a model with `python -m verl.rollout_server` and talk to it with "
                "an OpenAI client instead"
            )

    @property
    def device(self) -> torch.device:
        """Where the engine's model is (for an engine without a torch module here, vLLM's: this process's device)."""
        module = getattr(self.rollout, "module", None)
        if isinstance(module, torch.nn.Module):
            return next(module.parameters()).device
        return torch.device(get_device_name())

    def set_version(self, version: int) -> None:
        """Tokens generated from now on carry `version` (`ModelResponse.output_versions`)."""
        self.meta_info.pop("policy_version", None)
        self.rollout.weight_version = int(version)

    def get_version(self) -> int:
        return self.version

    def update_weights(self, meta: Any) -> concurrent.futures.Future:
        """Take new weights as `meta` (a `WeightUpdateMeta`) says. `colocated`: the training engine streams them in
        (`upload_weights`), so there is nothing left to do here: the future is done. `disk`: the HF folder at
        `meta.path` is loaded when the future's `result()` is asked for (after the training engine wrote it), so
        both of AReaL-lite's orders work: `f = rollout.update_weights(m); actor.upload_weights(m); f.result()`."""
        if meta.type == "colocated":
            if meta.engine is not self:
                raise ValueError("update_weights: a colocated WeightUpdateMeta names another inference engine")
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return _DeferredLoad(self.rollout, meta.path)

    def rollout_batch(
        self, data: list[dict[str, Any]], workflow: Any, should_accept: Callable[[TensorDict], bool] | None = None
    ) -> TensorDict:
        """One `workflow.arun_episode(self, row)` per dict row, all at once (their requests share generate calls),
        stacked into one TensorDict right-padded to the longest row (`input_ids` with the pad id, the rest with 0).
        An episode returning None, or one `should_accept` refuses, is left out; nothing left raises."""
        return run_sync(self.arollout_batch(data, workflow, should_accept))

    async def arollout_batch(
        self, data: list[dict[str, Any]], workflow: Any, should_accept: Callable[[TensorDict], bool] | None = None
    ) -> TensorDict:
        if not isinstance(data, list | tuple) or not all(isinstance(row, dict) for row in data):
            raise TypeError(
                f"rollout_batch takes a list of dict rows (a DataLoader with collate_fn=lambda rows: rows), got "
                f"{type(data).__name__}"
            )
        results = await asyncio.gather(*(workflow.arun_episode(self, row) for row in data))
        kept = []
        for i, result in enumerate(results):
            if result is None:
                continue
            if isinstance(result, dict):
                result = TensorDict(result, batch_size=[next(iter(result.values())).shape[0]])
            if not isinstance(result, TensorDict):
                raise TypeError(
                    f"{type(workflow).__name__}.arun_episode on row {i} returned {type(result).__name__}; a dict row "
                    "needs a TensorDict (or dict of tensors) with batch size [1], or None"
                )
            if should_accept is None or should_accept(result):
                kept.append(result)
        if not kept:
            raise RuntimeError(f"rollout_batch: all {len(data)} episodes were rejected (None or should_accept)")
        return concat_padded_tensors(kept, pad_values={"input_ids": self.pad_token_id})

    # ------------------------------------------------------------------ one generate call
    def _generate(self, requests: list[ModelRequest]) -> list[ModelResponse]:
        prompts = self._prompt_batch(requests)
        output = self.rollout.generate_sequences(prompts)
        self.num_generate_calls += 1
        version = self.version
        responses = output.batch["responses"].cpu()
        lengths = output.batch["response_mask"].sum(-1).tolist()
        log_probs = output.batch["rollout_log_probs"].cpu() if "rollout_log_probs" in output.batch.keys() else None
        out = []
        for i, req in enumerate(requests):
            tokens = responses[i, : int(lengths[i])].tolist()
            lps = log_probs[i, : len(tokens)].tolist() if log_probs is not None else [0.0] * len(tokens)
            tokens, lps, reason = self._cut(tokens, lps, req.gconfig)
            out.append(ModelResponse(list(req.input_ids), tokens, lps, [version] * len(tokens), reason, req.rid))
        return out

    def _prompt_batch(self, requests: list[ModelRequest]) -> DataProto:
        """Left-padded prompts of `requests` plus the meta_info of one generate call."""
        width = max(len(r.input_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, req in enumerate(requests):
            ids[i, width - len(req.input_ids) :] = torch.tensor(req.input_ids, dtype=torch.long)
            mask[i, width - len(req.input_ids) :] = 1
        g = requests[0].gconfig
        meta = {k: v for k, v in self.meta_info.items() if k not in ("do_sample", "temperature", "top_p", "top_k")}
        meta.update(
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            do_sample=not g.greedy,
            calculate_log_probs=True,
        )
        if not g.greedy:
            meta.update(temperature=float(g.temperature), top_p=float(g.top_p), top_k=int(g.top_k))
        if self.meta_info.get("seed") is not None:
            base = int(self.meta_info["seed"])
            k = self.num_generate_calls
            meta["seed"] = base if k == 0 else (base + k * _SEED_STRIDE) % (2**62)
        return DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
            meta_info=meta,
        )

    def _cut(
        self, tokens: list[int], log_probs: list[float], g: GenerationHyperparameters
    ) -> tuple[list[int], list[float], str]:
        """Apply the request's stop strings and budget; return (tokens, log_probs, stop_reason)."""
        ended_by_eos = bool(tokens) and tokens[-1] in self.eos_token_ids
        keep = len(tokens)
        if g.stop and self.tokenizer is not None:
            stop_at = first_stop_position(self.tokenizer, tokens, g.stop)
            if stop_at is not None:
                keep, ended_by_eos = stop_at, True
        if keep > g.max_new_tokens:
            keep, ended_by_eos = g.max_new_tokens, tokens[g.max_new_tokens - 1] in self.eos_token_ids
        return tokens[:keep], log_probs[:keep], "stop" if ended_by_eos else "length"


InferenceEngine = AsyncRolloutEngine  # AReaL-lite's name for the engine a workflow's arun_episode receives


class _DeferredLoad(concurrent.futures.Future):
    """A future whose `result()` loads the HF weights at `path` into `rollout` (once)."""

    def __init__(self, rollout: Any, path: str):
        super().__init__()
        self._rollout, self._path = rollout, path

    def result(self, timeout: float | None = None) -> None:
        if not self.done():
            try:
                from safetensors.torch import load_file

                files = sorted(f for f in os.listdir(self._path) if f.endswith(".safetensors"))
                if not files:
                    raise FileNotFoundError(f"update_weights: no .safetensors files in {self._path!r}")
                state = {}
                for name in files:
                    state.update(load_file(os.path.join(self._path, name)))
                self._rollout.update_weights(_with_tied_weights(self._rollout, state))
                self.set_result(None)
            except Exception as err:
                self.set_exception(err)
        return super().result(timeout)


def _with_tied_weights(rollout: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` plus the tied copies the engine's module names but the file leaves out (an HF folder saves a tied
    output embedding once)."""
    module = getattr(rollout, "module", None)
    if module is None:
        return state
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    for names in by_id.values():
        present = [n for n in names if n in state]
        for name in names:
            if name not in state and present:
                state[name] = state[present[0]]
    return state


def run_sync(coro: Coroutine) -> Any:
    """Run a coroutine to completion from synchronous code (in a helper thread when a loop already runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def first_stop_position(tokenizer: Any, tokens: list[int], stop: tuple[str, ...]) -> int | None:
    """Smallest k such that decode(tokens[:k]) contains one of `stop`, or None (binary search on k)."""

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not tokens or not has_stop(len(tokens)):
        return None
    low, high = 1, len(tokens)
    while low < high:
        mid = (low + high) // 2
        if has_stop(mid):
            high = mid
        else:
            low = mid + 1
    return low


async def agenerate_samples(engine: Any, req: ModelRequest) -> list[ModelResponse]:
    """`req.gconfig.n_samples` completions of one prompt, requested together (they share a generate call)."""
    n = req.gconfig.n_samples
    one = req.gconfig.new(n_samples=1)
    requests = [ModelRequest(list(req.input_ids), one, f"{req.rid}-{i}", dict(req.metadata)) for i in range(n)]
    return list(await asyncio.gather(*(engine.agenerate(r) for r in requests)))


def get_async_engine(rollout: Any) -> AsyncRolloutEngine:
    """The engine's own `AsyncRolloutEngine` (made on first use, window/batch cap from `rollout.*`): what
    `BaseRollout.agenerate` uses. Seeds come from `rollout.seed` and the engine's call counter."""
    engine = getattr(rollout, "_async_engine", None)
    if engine is None:
        engine = AsyncRolloutEngine(rollout, **batching_options(rollout.config))
        rollout._async_engine = engine
    return engine


def batching_options(config: Any) -> dict[str, Any]:
    """`window_s` and `max_batch_size` from `rollout.agenerate_window_ms` / `rollout.agenerate_max_batch_size`."""
    window_ms = config.get("agenerate_window_ms", 5)
    max_batch = config.get("agenerate_max_batch_size", None)
    return {"window_s": float(5 if window_ms is None else window_ms) / 1000.0, "max_batch_size": max_batch}
