"""The `sglang` rollout engine: a colocated offline `sglang.Engine` that frees its GPU memory during training.

Owns `SGLangRollout` and the pure functions `sglang_engine_kwargs` / `sglang_sampling_params` that map the rollout
config (verl's keys and defaults) to `sglang.Engine(...)` and to one request's sampling params. The engine is built
from `model.path` (with verl's `load_format: dummy`, random weights: the worker syncs the actor's before the first
generation) with `enable_memory_saver=True`; with `free_cache_engine` (verl's default) `generate_sequences` resumes
its memory occupation (weights and KV cache), generates from token ids and releases it again, so the actor's FSDP2
training owns the GPU memory in between. `update_weights` hands the actor's full state dict to
`Engine.update_weights_from_tensor`.

SGLang is imported lazily: asking for this engine on a machine without CUDA or without sglang fails at
construction with a message that names the problem and `actor_rollout_ref.rollout.name=hf`, the CPU engine (the
driver normally falls back to `hf` before the workers start; see `verl.workers.rollout.resolve_rollout_engine`).

Layer 5: imports torch, verl.protocol, verl.utils and sglang; must not import Ray.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import (
    BaseRollout,
    SamplingSettings,
    build_rollout_output,
    generation_seed,
    pad_responses,
    resolve_sampling,
    resolve_token_ids,
)
from verl.workers.rollout.vllm_rollout import CPU_HINT, _engine_kwargs_section, max_model_len


def _import_sglang():
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout engine 'sglang' needs a CUDA GPU, and none is visible to this process; {CPU_HINT}")
    try:
        import sglang
    except ImportError as err:
        raise RuntimeError(
            f"rollout engine 'sglang' needs the sglang package, which is not installed ({err}); "
            f"install it with `pip install sglang` or {CPU_HINT}"
        ) from err
    return sglang


def sglang_engine_kwargs(config: Any, model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine(...)` from the `actor_rollout_ref.rollout` section (verl's mapping).

    gpu_memory_utilization -> mem_fraction_static, enforce_eager -> disable_cuda_graph, max_num_seqs ->
    max_running_requests, enable_prefix_caching=false -> disable_radix_cache, enable_chunked_prefill=false ->
    chunked_prefill_size -1 (else max_num_batched_tokens), max_model_len -> context_length; `engine_kwargs.sglang`
    is merged last and wins.
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
    kwargs.update(_engine_kwargs_section(config, "sglang"))
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

    def __init__(self, model_path: str, config: Any, tokenizer: Any = None, trust_remote_code: bool = False):
        sglang = _import_sglang()
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        self.ignore_eos = bool(config.get("ignore_eos", False))
        self.engine = sglang.Engine(**sglang_engine_kwargs(config, model_path, trust_remote_code))
        self._sampling_keys = _known_sampling_keys(sglang)
        self.frees_memory = bool(config.get("free_cache_engine", True)) and hasattr(
            self.engine, "release_memory_occupation"
        )
        self._release()
        self._calls = 0

    # ------------------------------------------------------------------ memory
    def _release(self, tags: list[str] | None = None) -> None:
        if self.frees_memory:
            self.engine.release_memory_occupation(**({"tags": tags} if tags else {}))

    def _resume(self, tags: list[str] | None = None) -> None:
        if self.frees_memory:
            self.engine.resume_memory_occupation(**({"tags": tags} if tags else {}))

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the actor's full state dict with `update_weights_from_tensor` (weights resumed meanwhile)."""
        self._resume(["weights"])
        try:
            self.engine.update_weights_from_tensor(list(state_dict.items()), flush_cache=True)
        finally:
            self._release(["weights"])

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as `HFRollout.generate_sequences` (`rollout_log_probs` from SGLang's output token
        log-probs when `rollout.calculate_log_probs`; with `rollout.ignore_eos` every response runs to
        `response_length` and all of it is in `response_mask`)."""
        meta = prompts.meta_info
        sampling = resolve_sampling(self.config, meta)
        eos_token_id, pad_token_id = resolve_token_ids(meta, self.tokenizer)
        want_log_probs = bool(meta.get("calculate_log_probs", self.config.get("calculate_log_probs", False)))
        seed = generation_seed(self.config, meta, self._calls)
        self._calls += 1

        input_ids = prompts.batch["input_ids"].cpu()
        mask = prompts.batch["attention_mask"].cpu().bool()
        token_prompts = [ids[m].tolist() for ids, m in zip(input_ids, mask)]
        stop_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        params = []
        for i in range(len(token_prompts)):
            p = sglang_sampling_params(sampling, self.response_length, stop_ids, seed + i, self.ignore_eos)
            if self._sampling_keys is not None:
                p = {k: v for k, v in p.items() if k in self._sampling_keys}
            params.append(p)
        self._resume()
        try:
            outputs = self.engine.generate(
                input_ids=token_prompts, sampling_params=params, return_logprob=want_log_probs
            )
        finally:
            self._release()

        generated = [torch.tensor(out["output_ids"], dtype=torch.long) for out in outputs]
        responses = pad_responses(generated, self.response_length, pad_token_id)
        log_probs = None
        if want_log_probs:
            log_probs = torch.zeros(responses.shape, dtype=torch.float32)
            for i, out in enumerate(outputs):
                values = [float(entry[0]) for entry in out["meta_info"]["output_token_logprobs"]]
                n = min(len(values), self.response_length)
                log_probs[i, :n] = torch.tensor(values[:n])
        device = prompts.batch["input_ids"].device
        return build_rollout_output(
            prompts,
            responses.to(device),
            [] if self.ignore_eos else eos_token_id,
            pad_token_id,
            None if log_probs is None else log_probs.to(device),
        )
