"""The rollout engine interface and the steps every engine shares.

Owns `BaseRollout` (`generate_sequences`, `update_weights`, `agenerate`), `named_tensor_stream` and `engine_dtype`
(what `update_weights` takes), `pad_responses` and `build_rollout_output` (left-padded prompts + generated ids ->
`prompts`, `responses`, `input_ids`, `attention_mask`, `position_ids`, `response_mask`, `rollout_log_probs`);
re-exports the sampling helpers of `sampling.py`. Layer 5: must not import Ray or verl.single_controller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Union

import torch

from verl.protocol import DataProto
from verl.utils.torch_functional import get_response_mask
from verl.workers.rollout.async_engine import get_async_engine
from verl.workers.rollout.sampling import SamplingSettings, generation_seed, resolve_sampling, resolve_token_ids

__all__ = [
    "BaseRollout",
    "SamplingSettings",
    "WeightSource",
    "build_rollout_output",
    "engine_dtype",
    "generation_seed",
    "named_tensor_stream",
    "pad_responses",
    "resolve_sampling",
    "resolve_token_ids",
]


# a full state dict, or a stream of (name, tensor) pairs or of buckets (lists of pairs)
WeightSource = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], Iterable[list]]
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}
_DTYPES.update({"bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16})


def named_tensor_stream(weights: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of a state dict, of a stream of pairs, or of a stream of buckets (lists of
    pairs); a bucket is let go before the next one is asked for, so a reader that drops each tensor after use
    holds at most one bucket."""
    if isinstance(weights, Mapping):
        yield from weights.items()
        return
    for item in weights:
        if isinstance(item, tuple):
            yield item
        else:
            yield from item
        del item


def engine_dtype(name: Any) -> torch.dtype | None:
    """The torch dtype of an engine's `rollout.dtype` (bfloat16, bf16, float16, float32, ...); None for auto/unset."""
    if name is None or str(name) == "auto":
        return None
    if str(name) not in _DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={name!r} is not a dtype; allowed: auto, {sorted(_DTYPES)}")
    return _DTYPES[str(name)]


class BaseRollout(ABC):
    """A generation engine colocated with the actor of one rank."""

    # the dtype the engine holds its weights in: the worker casts floating tensors to it before they are gathered
    # (None: they are sent in the actor's dtype)
    weight_dtype: torch.dtype | None = None
    # False: `update_weights` gets `(name, tensor)` pairs gathered one at a time (verl's contract); True: lists of
    # pairs of at most `rollout.checkpoint_engine.update_weights_bucket_megabytes` (one engine request per bucket)
    takes_buckets: bool = False

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One response per prompt row; see `build_rollout_output` for the fields returned."""

    @abstractmethod
    def update_weights(self, weights: WeightSource) -> None:
        """Load the actor's weights, called after every actor update: a full state dict, or a stream of
        `(name, tensor)` pairs or buckets (see `takes_buckets`; gathered from the actor's shards as they are read:
        read the stream to its end and drop each tensor once loaded, see `named_tensor_stream`)."""

    def in_place_module(self) -> Any:
        """The engine's own model when the actor's weights may be written straight into its parameters (same names and
        shapes; `verl.workers.weight_sync.sync_in_place`), else None (they arrive through `update_weights`)."""
        return None

    async def agenerate(self, req: Any) -> Any:
        """One `ModelResponse` for a `ModelRequest`; concurrent calls share batched generate calls
        (verl.workers.rollout.async_engine)."""
        return await get_async_engine(self).agenerate(req)


def pad_responses(responses: list[torch.Tensor], response_length: int, pad_token_id: int) -> torch.Tensor:
    """Right-pad (or cut) 1-D id tensors to `(len(responses), response_length)` with `pad_token_id`."""
    out = torch.full((len(responses), response_length), pad_token_id, dtype=torch.long)
    for i, ids in enumerate(responses):
        ids = ids[:response_length]
        out[i, : ids.numel()] = ids
    return out


def build_rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    eos_token_id: int | list[int],
    pad_token_id: int,
    rollout_log_probs: torch.Tensor | None = None,
) -> DataProto:
    """Assemble one rollout's batch from the prompts and the generated ids.

    prompts: `input_ids`, `attention_mask`, `position_ids` (bs, prompt_len), left-padded.
    responses: (bs, response_len) generated ids, right-padded.
    rollout_log_probs: (bs, response_len) log-probs of the generated tokens, or None.

    Returns a DataProto with `prompts` (bs, prompt_len); `responses` (bs, response_len) set to `pad_token_id`
    after the first eos; `response_mask` (bs, response_len), 1 up to and including the first eos;
    `input_ids`, `attention_mask` (prompt mask ++ response mask) and `position_ids` (continuing from each
    prompt's last position), all (bs, prompt_len + response_len); `rollout_log_probs` (0 where masked) when
    given. The prompts' non-tensor fields are passed through unchanged; meta_info is empty.
    """
    prompt_ids = prompts.batch["input_ids"]
    prompt_mask = prompts.batch["attention_mask"]
    prompt_pos = prompts.batch["position_ids"]
    if responses.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"got {responses.shape[0]} responses for {prompt_ids.shape[0]} prompts")
    if prompt_pos.dim() != 2:
        raise ValueError(f"position_ids must be (bs, prompt_len), got shape {tuple(prompt_pos.shape)}")
    responses = responses.to(prompt_ids.device, dtype=prompt_ids.dtype)
    response_length = responses.shape[1]

    response_mask = get_response_mask(responses, eos_token_id, dtype=prompt_mask.dtype)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    delta = torch.arange(1, response_length + 1, device=prompt_pos.device, dtype=prompt_pos.dtype)
    response_pos = prompt_pos[:, -1:] + delta.unsqueeze(0)

    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=-1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=-1),
        "response_mask": response_mask,
    }
    if rollout_log_probs is not None:
        if rollout_log_probs.shape != responses.shape:
            raise ValueError(
                f"rollout_log_probs has shape {tuple(rollout_log_probs.shape)}, expected {tuple(responses.shape)}"
            )
        tensors["rollout_log_probs"] = rollout_log_probs.to(responses.device).float() * response_mask
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(prompts.non_tensor_batch))
