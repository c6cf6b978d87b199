"""What the engines built from a model path (`vllm`, `sglang`) share: `import_gpu_engine`, `engine_kwargs_section`,
`max_model_len`, `EngineRequests` / `prepare_requests` (left-padded batch -> unpadded prompts and sampling
settings), `assemble_output`, `weight_buckets_by_size` and `peft_name_problem` (LoRA must arrive merged, under HF
names). Imports no engine package. Layer 5: must not import Ray or verl.single_controller.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import (
    SamplingSettings,
    WeightSource,
    build_rollout_output,
    generation_seed,
    pad_responses,
    resolve_sampling,
    resolve_token_ids,
)

__all__ = [
    "CPU_HINT",
    "EngineRequests",
    "EngineMemory",
    "assemble_output",
    "engine_kwargs_section",
    "import_gpu_engine",
    "max_model_len",
    "peft_name_problem",
    "prepare_requests",
    "weight_buckets_by_size",
]

CPU_HINT = "use actor_rollout_ref.rollout.name=hf, the engine that runs on CPU and GPU"
Bucket = list[tuple[str, torch.Tensor]]
_PEFT_MARKS = ("base_model.model.", ".base_layer.", "lora_A", "lora_B", "lora_embedding_", "lora_magnitude_vector")


def peft_name_problem(name: str) -> str | None:
    """Why `name` is not a plain HF checkpoint name an engine built from model.path can load (a peft wrapper or
    adapter name), or None."""
    for mark in _PEFT_MARKS:
        if mark in name:
            return (
                f"weight {name!r} has the peft name part {mark!r}; this rollout engine loads plain HF names only, so "
                "LoRA adapters must be merged into the base weights before they are sent (verl.workers.weight_sync "
                "mode 'merged', what the worker uses for engines built from model.path)"
            )
    return None


def import_gpu_engine(engine: str, package: str, install_hint: str) -> Any:
    """Import `package` for rollout engine `engine`, or raise RuntimeError naming what is missing (a CUDA GPU, the
    package) and the CPU engine."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"rollout engine '{engine}' needs a CUDA GPU, and none is visible to this process; {CPU_HINT}"
        )
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise RuntimeError(
            f"rollout engine '{engine}' needs the {package} package, which is not installed ({err}); "
            f"install it with {install_hint} or {CPU_HINT}"
        ) from err


def engine_kwargs_section(config: Any, engine: str) -> dict[str, Any]:
    """`rollout.engine_kwargs.<engine>` as a plain dict without None values (passed through last, as verl does)."""
    section = (config.get("engine_kwargs", None) or {}).get(engine, None) or {}
    return {str(k): v for k, v in dict(section).items() if v is not None}


def max_model_len(config: Any) -> int:
    """`rollout.max_model_len`, or prompt_length + response_length when null (the longest sequence a step makes)."""
    value = config.get("max_model_len", None)
    return int(value) if value is not None else int(config.prompt_length) + int(config.response_length)


# ---------------------------------------------------------------------------------------------- memory
class EngineMemory:
    """Which of an engine's releasable memory tags are released, and the calls that move between them in the order
    a colocated engine needs (verl's `free_cache_engine`): after construction everything in `tags` is released; a
    weight update resumes the weights only and leaves them resident; a generation resumes what is still released
    (the KV cache) and releases everything after it. Does nothing when `enabled` is false.

    release(tags): release these tags (all of `tags` at once). resume(tags): bring these back, in `tags` order.
    """

    def __init__(
        self,
        release: Callable[[list[str]], Any],
        resume: Callable[[list[str]], Any],
        tags: Sequence[str],
        enabled: bool,
    ):
        self._release, self._resume, self.tags, self.enabled = release, resume, tuple(tags), enabled
        self.released: set[str] = set()

    def release(self) -> None:
        """Release every tag; only from fully resident (a half-released engine is not released twice)."""
        if self.enabled and not self.released:
            self._release(list(self.tags))
            self.released = set(self.tags)

    def resume(self, *tags: str) -> None:
        """Bring back `tags` (all of them when none is named) that are released, in `self.tags` order."""
        wanted = set(tags or self.tags)
        todo = [tag for tag in self.tags if tag in wanted and tag in self.released]
        if todo:
            self._resume(todo)
            self.released -= set(todo)


# ---------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class EngineRequests:
    """One generate call as an engine takes it: one token-id prompt per row (padding removed) and the settings
    shared by the rows (row i samples with seed `seed + i`)."""

    prompt_ids: list[list[int]]
    sampling: SamplingSettings
    eos_token_id: int | list[int]
    pad_token_id: int
    stop_token_ids: list[int]  # [] with ignore_eos: generation runs to response_length
    want_log_probs: bool
    seed: int
    ignore_eos: bool


def prepare_requests(config: Any, prompts: DataProto, tokenizer: Any, call_index: int) -> EngineRequests:
    """The requests of one `generate_sequences` call.

    prompts: `input_ids`, `attention_mask` (bs, prompt_len), left-padded; meta_info may carry `validate`,
    `eos_token_id`, `pad_token_id`, `seed`, `calculate_log_probs` and per-call sampling overrides
    (see `resolve_sampling`). config: the `actor_rollout_ref.rollout` section (`ignore_eos`, `calculate_log_probs`).
    """
    meta = prompts.meta_info
    eos_token_id, pad_token_id = resolve_token_ids(meta, tokenizer)
    ignore_eos = bool(config.get("ignore_eos", False))
    input_ids = prompts.batch["input_ids"].cpu()
    mask = prompts.batch["attention_mask"].cpu().bool()
    stop_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    return EngineRequests(
        prompt_ids=[ids[m].tolist() for ids, m in zip(input_ids, mask)],
        sampling=resolve_sampling(config, meta),
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        stop_token_ids=[] if ignore_eos else list(stop_ids),
        want_log_probs=bool(meta.get("calculate_log_probs", config.get("calculate_log_probs", False))),
        seed=generation_seed(config, meta, call_index),
        ignore_eos=ignore_eos,
    )


def assemble_output(
    prompts: DataProto,
    requests: EngineRequests,
    generated: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    response_length: int,
) -> DataProto:
    """The PPO batch of one call from each row's generated ids and, when `requests.want_log_probs`, the log-prob
    of each generated token (both cut to `response_length`). `rollout_log_probs` is (bs, response_length), 0 past a
    row's end; with `ignore_eos` every generated token is in `response_mask`. See `build_rollout_output`."""
    responses = pad_responses(
        [torch.as_tensor(list(ids), dtype=torch.long) for ids in generated], response_length, requests.pad_token_id
    )
    rollout_log_probs = None
    if requests.want_log_probs:
        if log_probs is None:
            raise ValueError("log-probs were asked for (calculate_log_probs) but the engine returned none")
        rollout_log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        for i, values in enumerate(log_probs):
            values = list(values)[:response_length]
            rollout_log_probs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
    device = prompts.batch["input_ids"].device
    return build_rollout_output(
        prompts,
        responses.to(device),
        [] if requests.ignore_eos else requests.eos_token_id,
        requests.pad_token_id,
        None if rollout_log_probs is None else rollout_log_probs.to(device),
    )


# ---------------------------------------------------------------------------------------------- weights
def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def weight_buckets_by_size(weights: WeightSource, max_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """`update_weights`' input as buckets (lists of `(name, tensor)`) of at most `max_bytes` each, floating tensors
    cast to `dtype` (None: as they are) and sized in it; a tensor larger than `max_bytes` travels alone.

    A state dict or a stream of pairs is grouped in order; a stream of buckets (lists of pairs, as
    `verl.workers.weight_sync` sends them, already sized) is passed through one bucket at a time. The generator drops
    a bucket before reading on, so a reader that drops it too holds one bucket at a time."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    stream = weights.items() if isinstance(weights, Mapping) else weights
    bucket: Bucket = []
    size = 0
    for item in stream:
        if not isinstance(item, tuple):  # a bucket already
            if bucket:
                yield bucket
                bucket, size = [], 0
            yield [(name, _cast(t, dtype)) for name, t in item]
            del item
            continue
        name, tensor = item
        del item
        tensor = _cast(tensor, dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        del tensor
    if bucket:
        yield bucket
