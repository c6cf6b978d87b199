"""The `vllm` rollout engine: a colocated `vllm.LLM` that sleeps during training (GPU only).

Owns `VLLMRollout` and the pure functions `vllm_engine_kwargs` / `vllm_sampling_kwargs` that map the rollout
config (verl's keys and defaults) to `vllm.LLM(...)` and `vllm.SamplingParams(...)`. The engine is built from
`model.path` (with verl's `load_format: dummy`, random weights: the worker syncs the actor's before the first
generation). With `free_cache_engine` (verl's default) it is built with `enable_sleep_mode=True` and put to
sleep (level 1: weights to CPU, KV cache freed) right away; `generate_sequences` wakes it, generates and puts it
back to sleep, so the actor's FSDP2 training owns the GPU memory in between. After every actor update the
worker calls `update_weights(full_state_dict)`, which wakes only the weights and loads them with the vLLM
model's own `load_weights`.

vLLM is imported lazily: asking for this engine on a machine without CUDA or without vLLM fails at
construction with a message that names the problem and `actor_rollout_ref.rollout.name=hf`, the CPU engine.
The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that weights can be loaded directly.

Layer 5: imports torch, verl.protocol, verl.utils and vllm; must not import Ray.
"""

from __future__ import annotations

import os
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

CPU_HINT = "use actor_rollout_ref.rollout.name=hf, the engine that runs on CPU and GPU"


def _import_vllm():
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout engine 'vllm' needs a CUDA GPU, and none is visible to this process; {CPU_HINT}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(
            f"rollout engine 'vllm' needs the vllm package, which is not installed ({err}); "
            f"install it with `pip install -e .[gpu]` or {CPU_HINT}"
        ) from err
    return vllm


def _engine_kwargs_section(config: Any, engine: str) -> dict[str, Any]:
    """`rollout.engine_kwargs.<engine>` as a plain dict without None values (passed through last, as verl does)."""
    section = (config.get("engine_kwargs", None) or {}).get(engine, None) or {}
    return {str(k): v for k, v in dict(section).items() if v is not None}


def max_model_len(config: Any) -> int:
    """`rollout.max_model_len`, or prompt_length + response_length when null (the longest sequence a step makes)."""
    value = config.get("max_model_len", None)
    return int(value) if value is not None else int(config.prompt_length) + int(config.response_length)


def vllm_engine_kwargs(config: Any, model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM(...)` from the `actor_rollout_ref.rollout` section (verl's keys and defaults).

    `free_cache_engine` becomes `enable_sleep_mode`; without chunked prefill `max_num_batched_tokens` is raised to
    `max_model_len` (vLLM's requirement, as verl does); `engine_kwargs.vllm` is merged last and wins.
    """
    model_len = max_model_len(config)
    chunked_prefill = bool(config.get("enable_chunked_prefill", True))
    batched_tokens = int(config.get("max_num_batched_tokens", 8192))
    if not chunked_prefill:
        batched_tokens = max(batched_tokens, model_len)
    kwargs = {
        "model": model_path,
        "dtype": str(config.get("dtype", "bfloat16")),
        "load_format": str(config.get("load_format", "dummy")),
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
    }
    kwargs.update(_engine_kwargs_section(config, "vllm"))
    return kwargs


def vllm_sampling_kwargs(
    sampling: SamplingSettings,
    max_tokens: int,
    stop_token_ids: list[int],
    seed: int,
    want_log_probs: bool,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of one `vllm.SamplingParams(...)` (temperature 0 = greedy)."""
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


class VLLMRollout(BaseRollout):
    """Generate with a colocated vLLM engine.

    model_path: HF directory of the policy (the same weights the actor starts from).
    config: the `actor_rollout_ref.rollout` section (`prompt_length`, `response_length`, sampling knobs,
        `calculate_log_probs`, `ignore_eos`, and the engine keys of `vllm_engine_kwargs`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    """

    builds_from_path = True  # the worker passes model.path and syncs the actor's weights before generating

    def __init__(self, model_path: str, config: Any, tokenizer: Any = None, trust_remote_code: bool = False):
        vllm = _import_vllm()
        self._vllm = vllm
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        self.ignore_eos = bool(config.get("ignore_eos", False))
        kwargs = vllm_engine_kwargs(config, model_path, trust_remote_code)
        self.sleeps = kwargs["enable_sleep_mode"]
        self.engine = vllm.LLM(**kwargs)
        if self.sleeps:
            self.engine.sleep(level=1)
        self._calls = 0

    # ------------------------------------------------------------------ weights
    def _model(self):
        """The vLLM torch module of the in-process engine."""
        executor = self.engine.llm_engine.model_executor
        return executor.driver_worker.worker.model_runner.model

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the actor's full state dict (waking only the weights, then back to sleep, with free_cache_engine)."""
        if self.sleeps:
            self.engine.wake_up(tags=["weights"])
        device = torch.device("cuda", torch.cuda.current_device())
        self._model().load_weights((name, t.to(device)) for name, t in state_dict.items())
        torch.cuda.synchronize()
        if self.sleeps:
            self.engine.sleep(level=1)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as `HFRollout.generate_sequences` (`rollout_log_probs` from vLLM's processed
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
        token_prompts = [{"prompt_token_ids": ids[m].tolist()} for ids, m in zip(input_ids, mask)]
        stop_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        params = [
            self._vllm.SamplingParams(
                **vllm_sampling_kwargs(
                    sampling, self.response_length, stop_ids, seed + i, want_log_probs, self.ignore_eos
                )
            )
            for i in range(len(token_prompts))
        ]
        if self.sleeps:
            self.engine.wake_up()
        try:
            outputs = self.engine.generate(token_prompts, params, use_tqdm=False)
        finally:
            if self.sleeps:
                self.engine.sleep(level=1)

        generated = [torch.tensor(out.outputs[0].token_ids, dtype=torch.long) for out in outputs]
        responses = pad_responses(generated, self.response_length, pad_token_id)
        log_probs = None
        if want_log_probs:
            log_probs = torch.zeros(responses.shape, dtype=torch.float32)
            for i, out in enumerate(outputs):
                sample = out.outputs[0]
                values = [step[tok].logprob for tok, step in zip(sample.token_ids, sample.logprobs)]
                n = min(len(values), self.response_length)
                log_probs[i, :n] = torch.tensor(values[:n])
        device = prompts.batch["input_ids"].device
        return build_rollout_output(
            prompts,
            responses.to(device),
            [] if self.ignore_eos else eos_token_id,  # ignore_eos: every generated token is in the response
            pad_token_id,
            None if log_probs is None else log_probs.to(device),
        )
