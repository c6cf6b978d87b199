"""The `vllm` rollout engine: a colocated `vllm.LLM` driven through vLLM's public API only (GPU only, vLLM 0.32).

Owns `VLLMRollout` and the pure functions `vllm_engine_kwargs` / `vllm_sampling_kwargs` that map the rollout config
(verl's keys and defaults) to `vllm.LLM(...)` and `vllm.SamplingParams(...)`. What it calls of vLLM, all public in
vLLM 0.32 (`vllm/entrypoints/llm.py`):
- `LLM(model=..., dtype=..., load_format=..., gpu_memory_utilization=..., enable_sleep_mode=...,
  worker_extension_cls=..., ...)`: built from `model.path`; with verl's `load_format: dummy` (random weights) the
  worker syncs the actor's weights before the first generation.
- `LLM.generate(prompts, sampling_params, use_tqdm=False)` with token-id prompts (`{"prompt_token_ids": [...]}`) and
  one `SamplingParams` per row (`logprobs=0` returns the sampled token's log-prob, after temperature / top-k / top-p:
  `logprobs_mode="processed_logprobs"`, the formula the actor uses).
- `LLM.collective_rpc("verl_load_weights", args=(bucket,))` on our worker extension
  (`verl.workers.rollout.vllm_worker_extension`), whose method calls the vLLM model's own `load_weights`.
- `LLM.sleep(level=1)` / `LLM.wake_up(tags=...)` with `free_cache_engine` (verl's default, `enable_sleep_mode`):
  put to sleep right after construction (weights to CPU, KV cache freed); `generate_sequences` wakes it fully and
  puts it back to sleep, `update_weights` wakes only the weights; so the actor's FSDP2 training owns the GPU memory
  in between. `LLM.reset_prefix_cache()` after every weight update (cached KV of old weights is stale).

Weights: the worker streams the actor's weights (`verl.workers.weight_sync`) in buckets of
`rollout.checkpoint_engine.update_weights_bucket_megabytes` (`takes_buckets`), in the engine's dtype, under plain HF
names; with LoRA the adapters are merged into the base weights before they are sent (W + scaling * B @ A, the
`merged` sync mode): vLLM's own LoRA (`enable_lora`, `LoRARequest`) is not used and is refused in `engine_kwargs`.
`update_weights` also takes a state dict or a stream of `(name, tensor)` pairs, bucketed by the same size.

One engine per rank (data parallel), in the worker's process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the buckets
reach the vLLM worker by reference (no copy); with more than one rank, vLLM's `external_launcher` executor, which
joins the torch.distributed group the FSDP workers already started. vLLM is imported lazily: asking for this engine
without CUDA or without vLLM fails at construction with a message naming `actor_rollout_ref.rollout.name=hf`.

Layer 5: imports torch, verl.protocol, the rollout helpers (`base`, `gpu_engines`, `vllm_worker_extension`),
`verl.workers.weight_sync.bucket_bytes` and vllm (lazily); must not import Ray.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import BaseRollout, SamplingSettings, WeightSource, engine_dtype
from verl.workers.rollout.gpu_engines import (
    assemble_output,
    engine_kwargs_section,
    import_gpu_engine,
    max_model_len,
    prepare_requests,
    weight_buckets_by_size,
)
from verl.workers.rollout.vllm_worker_extension import LOAD_WEIGHTS_METHOD, WORKER_EXTENSION_CLS, peft_name_problem
from verl.workers.weight_sync import bucket_bytes

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# engine_kwargs.vllm keys this engine cannot honour, with why
_REFUSED_ENGINE_KWARGS = {
    "enable_lora": "LoRA reaches vLLM merged into the base weights (no vLLM adapters); remove it",
    "quantization": "weights are reloaded in place with load_weights after every update, which is only right for "
    "unquantized weights; remove it",
    "worker_extension_cls": f"the engine loads weights through its own extension ({WORKER_EXTENSION_CLS}); remove it",
}


def _import_vllm() -> Any:
    """vllm, imported in-process mode (the engine core and its worker in this process)."""
    if os.environ.get(MULTIPROCESSING_ENV, "0") != "0":
        raise RuntimeError(
            f"{MULTIPROCESSING_ENV}={os.environ[MULTIPROCESSING_ENV]}: the vllm rollout engine runs vLLM in the "
            f"worker's process to hand it the actor's weights by reference; unset {MULTIPROCESSING_ENV} or set it to 0"
        )
    if torch.cuda.is_available():
        os.environ[MULTIPROCESSING_ENV] = "0"  # read by vllm when the engine is built
    return import_gpu_engine("vllm", "vllm", "`pip install -e .[gpu]` (vllm 0.32)")


def vllm_engine_kwargs(
    config: Any, model_path: str, trust_remote_code: bool = False, world_size: int = 1
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM(...)` from the `actor_rollout_ref.rollout` section (verl's keys and defaults).

    `free_cache_engine` becomes `enable_sleep_mode`; verl's `dummy_*` load formats become `dummy`; without chunked
    prefill `max_num_batched_tokens` is raised to `max_model_len` (vLLM's requirement, as verl does); with
    `world_size` > 1 (ranks of the worker's torch.distributed group) vLLM's `external_launcher` executor.
    `engine_kwargs.vllm` is merged last and wins, except for the keys this engine cannot honour (ValueError).
    """
    model_len = max_model_len(config)
    chunked_prefill = bool(config.get("enable_chunked_prefill", True))
    batched_tokens = int(config.get("max_num_batched_tokens", 8192))
    if not chunked_prefill:
        batched_tokens = max(batched_tokens, model_len)
    load_format = str(config.get("load_format", "dummy"))
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": str(config.get("dtype", "bfloat16")),
        "load_format": "dummy" if load_format.startswith("dummy") else load_format,
        "trust_remote_code": bool(trust_remote_code),
        "max_model_len": model_len,
        "max_num_seqs": int(config.get("max_num_seqs", 256)),
        "max_num_batched_tokens": batched_tokens,
        "enable_chunked_prefill": chunked_prefill,
        "enable_prefix_caching": bool(config.get("enable_prefix_caching", True)),
        "enable_sleep_mode": bool(config.get("free_cache_engine", True)),
        "enforce_eager": bool(config.get("enforce_eager", False)),
        "gpu_memory_utilization": float(config.get("gpu_memory_utilization", 0.5)),
        "disable_log_stats": bool(config.get("disable_log_stats", True)),
        "tensor_parallel_size": int(config.get("tensor_model_parallel_size", 1) or 1),
        "seed": int(config.get("seed", 0)),
        # log-probs after temperature scaling, the formula the actor uses (see HFRollout)
        "logprobs_mode": str(config.get("logprobs_mode", "processed_logprobs")),
        "worker_extension_cls": WORKER_EXTENSION_CLS,
    }
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    extra = engine_kwargs_section(config, "vllm")
    for key, why in _REFUSED_ENGINE_KWARGS.items():
        if key in extra and extra[key] not in (False, kwargs.get(key)):
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={extra[key]!r}: {why}")
    kwargs.update(extra)
    return kwargs


def vllm_sampling_kwargs(
    sampling: SamplingSettings,
    max_tokens: int,
    stop_token_ids: list[int],
    seed: int,
    want_log_probs: bool,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of one row's `vllm.SamplingParams(...)`: temperature 0 = greedy, top_k -1 = off (vLLM
    reads 0 and -1 as off), `logprobs=0` for the sampled token's log-prob only, no detokenization (ids in and out).
    `n` is 1: the trainer has already repeated each prompt `rollout.n` times (one row per sample)."""
    return {
        "n": 1,
        "temperature": sampling.temperature if sampling.do_sample else 0.0,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "max_tokens": int(max_tokens),
        "stop_token_ids": [] if ignore_eos else list(stop_token_ids),
        "ignore_eos": bool(ignore_eos),
        "logprobs": 0 if want_log_probs else None,
        "seed": int(seed),
        "detokenize": False,
    }


def sampled_log_probs(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> list[float]:
    """The log-prob of each sampled token from a vLLM `CompletionOutput`'s `logprobs` (one `{token_id: Logprob}`
    per generated token, the sampled token always among them)."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs; SamplingParams(logprobs=0) asks for them")
    return [float(step[token].logprob) for token, step in zip(token_ids, logprobs)]


def load_weights_into_llm(
    llm: Any, weights: WeightSource, max_bucket_bytes: int, dtype: torch.dtype | None, sleeps: bool
) -> int:
    """Load weights into a `vllm.LLM` through its public API; returns how many tensors were loaded.

    weights: a stream of buckets, a stream of `(name, tensor)` pairs or a state dict, HF names (a peft name is
    refused). Regrouped by `weight_buckets_by_size` (buckets of at most `max_bucket_bytes`, floating tensors in
    `dtype`) and sent one `llm.collective_rpc(LOAD_WEIGHTS_METHOD, args=(bucket,))` per bucket. With `sleeps`
    (free_cache_engine) only the weights are woken (`wake_up(tags=["weights"])`) and the engine is put back to sleep
    (`sleep(level=1)`) after; the prefix cache is reset either way. The stream is read to its end even after an
    error (it may be a collective over the actor's ranks); then the first error is raised.
    """
    if sleeps:
        llm.wake_up(tags=["weights"])
    error: Exception | None = None
    loaded = 0
    try:
        for bucket in weight_buckets_by_size(weights, max_bucket_bytes, dtype):
            if error is None:
                problems = [p for p in (peft_name_problem(name) for name, _ in bucket) if p]
                try:
                    if problems:
                        raise ValueError(problems[0])
                    loaded += llm.collective_rpc(LOAD_WEIGHTS_METHOD, args=(bucket,))[0]
                except Exception as err:  # keep reading: the other ranks are gathering the rest
                    error = err
            del bucket
        llm.reset_prefix_cache()  # cached KV of the old weights
    finally:
        if sleeps:
            llm.sleep(level=1)
    if error is not None:
        raise error
    return loaded


class VLLMRollout(BaseRollout):
    """Generate with a colocated vLLM engine.

    model_path: HF directory of the policy (the same weights the actor starts from).
    config: the `actor_rollout_ref.rollout` section (`prompt_length`, `response_length`, sampling knobs,
        `calculate_log_probs`, `ignore_eos`, `checkpoint_engine.update_weights_bucket_megabytes` and the engine keys
        of `vllm_engine_kwargs`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    """

    builds_from_path = True  # the worker passes model.path and syncs the actor's weights before generating
    takes_buckets = True  # one collective_rpc per bucket of update_weights_bucket_megabytes

    def __init__(self, model_path: str, config: Any, tokenizer: Any = None, trust_remote_code: bool = False):
        vllm = _import_vllm()
        self._vllm = vllm
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        self.bucket_bytes = bucket_bytes(config)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        kwargs = vllm_engine_kwargs(config, model_path, trust_remote_code, world_size=world)
        self.sleeps = kwargs["enable_sleep_mode"]
        self.weight_dtype = engine_dtype(kwargs["dtype"])
        self.engine = vllm.LLM(**kwargs)
        if self.sleeps:
            self.engine.sleep(level=1)
        self._calls = 0

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: WeightSource) -> None:
        """Load the actor's weights (a stream of buckets, as the worker sends them, a stream of `(name, tensor)` pairs
        or a state dict, HF names): see `load_weights_into_llm`."""
        load_weights_into_llm(self.engine, weights, self.bucket_bytes, self.weight_dtype, self.sleeps)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as `HFRollout.generate_sequences` (`rollout_log_probs` from vLLM's processed log-probs when
        `rollout.calculate_log_probs`; with `rollout.ignore_eos` every response runs to `response_length` and all of
        it is in `response_mask`)."""
        req = prepare_requests(self.config, prompts, self.tokenizer, self._calls)
        self._calls += 1
        params = [
            self._vllm.SamplingParams(
                **vllm_sampling_kwargs(
                    req.sampling, self.response_length, req.stop_token_ids, req.seed + i, req.want_log_probs,
                    req.ignore_eos,
                )
            )
            for i in range(len(req.prompt_ids))
        ]  # fmt: skip
        if self.sleeps:
            self.engine.wake_up()
        try:
            outputs = self.engine.generate(
                [{"prompt_token_ids": ids} for ids in req.prompt_ids], params, use_tqdm=False
            )
        finally:
            if self.sleeps:
                self.engine.sleep(level=1)
        samples = [out.outputs[0] for out in outputs]
        generated = [list(sample.token_ids) for sample in samples]
        log_probs = None
        if req.want_log_probs:
            log_probs = [sampled_log_probs(ids, sample.logprobs) for ids, sample in zip(generated, samples)]
        return assemble_output(prompts, req, generated, log_probs, self.response_length)
