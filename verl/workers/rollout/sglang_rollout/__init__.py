"""The `sglang` rollout engine: a colocated offline `sglang.Engine` that frees its GPU memory during training.

Owns `SGLangRollout` and the pure functions `sglang_engine_kwargs` / `sglang_sampling_params` that map the rollout
config (verl's keys and defaults) to `sglang.Engine(...)` and to one request's sampling params. The engine is built
from `model.path` (with verl's `load_format: dummy`, random weights: the worker syncs the actor's before the first
generation) with `enable_memory_saver=True`. With `free_cache_engine` (verl's default) its memory is released after
construction and after every generation, in the order `gpu_engines.EngineMemory` keeps: a weight update resumes the
weights only, loads them and leaves them resident; a generation resumes the KV cache (and CUDA graphs), generates
from token ids and releases everything again, so the actor's FSDP2 training owns the GPU memory in between.
Released weights must come back intact (two generations can follow each other without an update, e.g. validation
after a training step): the engine is built with `enable_weights_cpu_backup=True`, so a release copies them to host
memory; an sglang too old to know that option keeps its weights resident and releases only the rest (one notice).
`update_weights` takes the actor's weights as the worker streams them (`verl.workers.weight_sync`: buckets of
`rollout.checkpoint_engine.update_weights_bucket_megabytes`, gathered lazily on the GPU in `rollout.dtype`, HF
names; with LoRA the merged weights), regroups them by that size (a DeepSeek-V4 model's fused parameter groups kept in
one bucket, `utils.DEEPSEEK_V4_FUSION_GROUPS`) and hands each bucket to `Engine.update_weights_from_tensor`, flushing
the prefix cache once at the end.

SGLang is imported lazily: asking for this engine on a machine without CUDA or without sglang fails at
construction with a message that names the problem and `actor_rollout_ref.rollout.name=hf`, the CPU engine (the
driver normally falls back to `hf` before the workers start; see `verl.workers.rollout.resolve_rollout_engine`).

Layer 5: imports torch, verl.protocol, the rollout helpers (`base`, `gpu_engines`, `.utils`) and sglang; must not
import Ray.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import BaseRollout, SamplingSettings, WeightSource, engine_dtype, named_tensor_stream
from verl.workers.rollout.gpu_engines import (
    CPU_HINT,
    EngineMemory,
    assemble_output,
    engine_kwargs_section,
    import_gpu_engine,
    max_model_len,
    peft_name_problem,
    prepare_requests,
    weight_buckets_by_size,
)
from verl.workers.rollout.sglang_rollout.utils import DEEPSEEK_V4_FUSION_GROUPS, named_tensor_buckets
from verl.workers.weight_sync import bucket_bytes

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang's release/resume tags, in the order they come back
WEIGHTS_BACKUP = "enable_weights_cpu_backup"


def _import_sglang():
    return import_gpu_engine("sglang", "sglang", "`pip install sglang`")


def sglang_engine_kwargs(
    config: Any, model_path: str, trust_remote_code: bool = False, knows_weights_backup: bool = True
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine(...)` from the `actor_rollout_ref.rollout` section (verl's mapping).

    gpu_memory_utilization -> mem_fraction_static, enforce_eager -> disable_cuda_graph, max_num_seqs ->
    max_running_requests, enable_prefix_caching=false -> disable_radix_cache, enable_chunked_prefill=false ->
    chunked_prefill_size -1 (else max_num_batched_tokens), max_model_len -> context_length; with `free_cache_engine`
    and an sglang that knows it (`knows_weights_backup`), `enable_weights_cpu_backup` (released weights are kept in
    host memory). `engine_kwargs.sglang` is merged last and wins.
    """
    chunked_prefill = bool(config.get("enable_chunked_prefill", True))
    kwargs = {
        "model_path": model_path,
        "dtype": str(config.get("dtype", "bfloat16")),
        "load_format": str(config.get("load_format", "dummy")),
        "trust_remote_code": bool(trust_remote_code),
        "mem_fraction_static": float(config.get("gpu_memory_utilization", 0.5)),
        "disable_cuda_graph": bool(config.get("enforce_eager", False)),
        "tp_size": int(config.get("tensor_model_parallel_size", 1) or 1),
        "context_length": max_model_len(config),
        "max_running_requests": int(config.get("max_num_seqs", 256)),
        "chunked_prefill_size": int(config.get("max_num_batched_tokens", 8192)) if chunked_prefill else -1,
        "disable_radix_cache": not bool(config.get("enable_prefix_caching", True)),
        "enable_metrics": not bool(config.get("disable_log_stats", True)),
        "random_seed": int(config.get("seed", 0)),
        "enable_memory_saver": True,  # release/resume_memory_occupation (free_cache_engine)
        "skip_tokenizer_init": True,  # token ids in and out
        "log_level": "error",
    }
    if bool(config.get("free_cache_engine", True)) and knows_weights_backup:
        kwargs[WEIGHTS_BACKUP] = True
    kwargs.update(engine_kwargs_section(config, "sglang"))
    return kwargs


def sglang_sampling_params(
    sampling: SamplingSettings, max_new_tokens: int, stop_token_ids: list[int], seed: int, ignore_eos: bool = False
) -> dict[str, Any]:
    """One request's sampling params for `Engine.generate` (temperature 0 = greedy)."""
    return {
        "temperature": sampling.temperature if sampling.do_sample else 0.0,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "max_new_tokens": int(max_new_tokens),
        "stop_token_ids": [] if ignore_eos else list(stop_token_ids),
        "ignore_eos": bool(ignore_eos),
        "sampling_seed": int(seed),
        "skip_special_tokens": False,
    }


def releasable_tags(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The memory tags an engine built with `kwargs` may release between generations: all of them when released
    weights are backed up in host memory (`enable_weights_cpu_backup`), else all but the weights (released weights
    without a backup are lost)."""
    if kwargs.get(WEIGHTS_BACKUP):
        return MEMORY_TAGS
    return tuple(tag for tag in MEMORY_TAGS if tag != "weights")


def _knows_weights_backup() -> bool:
    """Whether the installed sglang's ServerArgs has `enable_weights_cpu_backup`."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return False
    return WEIGHTS_BACKUP in {field.name for field in dataclasses.fields(ServerArgs)}


def _model_type(model_path: str) -> str | None:
    """`model_type` of the HF config at `model_path` (read as a dict: no model class needed)."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(model_path)[0].get("model_type")


def _known_sampling_keys(sglang: Any) -> set[str] | None:
    """The keyword names of the installed sglang's SamplingParams (older ones lack `sampling_seed`), or None."""
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError:
        return None
    return set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}


class SGLangRollout(BaseRollout):
    """Generate with a colocated offline SGLang engine (same interface as `VLLMRollout`).

    model_path: HF directory of the policy. config: the `actor_rollout_ref.rollout` section (`prompt_length`,
    `response_length`, sampling knobs, `calculate_log_probs`, `ignore_eos`, `free_cache_engine` and the engine keys
    of `sglang_engine_kwargs`). tokenizer: used for default eos/pad ids when meta_info has none.
    """

    builds_from_path = True  # the worker passes model.path and syncs the actor's weights before generating
    takes_buckets = True  # one update_weights_from_tensor request per bucket (verl's update_weights_bucket_megabytes)

    def __init__(
        self,
        model_path: str,
        config: Any,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        device: str | None = None,
    ):
        if device not in (None, "cuda"):
            raise RuntimeError(f"rollout engine 'sglang' runs on CUDA GPUs only, not on {device}; {CPU_HINT}")
        sglang = _import_sglang()
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        self.bucket_bytes = bucket_bytes(config)
        kwargs = sglang_engine_kwargs(config, model_path, trust_remote_code, _knows_weights_backup())
        self.weight_dtype = engine_dtype(kwargs["dtype"])
        self.fusion_groups = DEEPSEEK_V4_FUSION_GROUPS if _model_type(model_path) == "deepseek_v4" else ()
        self.engine = sglang.Engine(**kwargs)
        self._sampling_keys = _known_sampling_keys(sglang)
        frees = bool(config.get("free_cache_engine", True)) and hasattr(self.engine, "release_memory_occupation")
        tags = releasable_tags(kwargs)
        if frees and "weights" not in tags:
            print(
                f"notice: the installed sglang has no {WEIGHTS_BACKUP}: with free_cache_engine the weights stay on "
                "the GPU and only the KV cache is released between generations",
                file=sys.stderr,
            )
        self.memory = EngineMemory(
            release=lambda t: self.engine.release_memory_occupation(tags=t),
            resume=lambda t: self.engine.resume_memory_occupation(tags=t),
            tags=tags,
            enabled=frees,
        )
        self.memory.release()
        self._calls = 0

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: WeightSource) -> None:
        """Load the actor's weights with `update_weights_from_tensor`, one request per bucket of
        `update_weights_bucket_megabytes`, with the weights resumed (they stay resident until the next generation
        has run); the prefix cache is flushed once, after the last bucket. With `fusion_groups` (DeepSeek-V4) the
        buckets are cut again so that each group's members go in one request. The input is read to its end even
        after an error (it may be a collective over the actor's ranks); then the first error is raised."""
        self.memory.resume("weights")
        error: Exception | None = None
        buckets = weight_buckets_by_size(weights, self.bucket_bytes, self.weight_dtype)
        if self.fusion_groups:
            buckets = named_tensor_buckets(named_tensor_stream(buckets), self.bucket_bytes, self.fusion_groups)
        for bucket in buckets:
            if error is None:
                try:
                    problem = next((p for p in (peft_name_problem(name) for name, _ in bucket) if p), None)
                    if problem is not None:
                        raise ValueError(problem)
                    self.engine.update_weights_from_tensor(bucket, flush_cache=False)
                except Exception as err:  # keep reading: the other ranks are gathering the rest
                    error = err
            del bucket
        if error is not None:
            raise error
        self.engine.flush_cache()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as `HFRollout.generate_sequences` (`rollout_log_probs` from SGLang's output token
        log-probs when `rollout.calculate_log_probs`; with `rollout.ignore_eos` every response runs to
        `response_length` and all of it is in `response_mask`)."""
        req = prepare_requests(self.config, prompts, self.tokenizer, self._calls)
        self._calls += 1
        params = []
        for i in range(len(req.prompt_ids)):
            p = sglang_sampling_params(
                req.sampling, self.response_length, req.stop_token_ids, req.seed + i, req.ignore_eos
            )
            if self._sampling_keys is not None:
                p = {k: v for k, v in p.items() if k in self._sampling_keys}
            params.append(p)
        self.memory.resume()
        try:
            outputs = self.engine.generate(
                input_ids=req.prompt_ids, sampling_params=params, return_logprob=req.want_log_probs
            )
        finally:
            self.memory.release()

        generated = [out["output_ids"] for out in outputs]
        log_probs = None
        if req.want_log_probs:
            log_probs = [[float(entry[0]) for entry in out["meta_info"]["output_token_logprobs"]] for out in outputs]
        return assemble_output(prompts, req, generated, log_probs, self.response_length)
