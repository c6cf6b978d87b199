"""The rollout engine interface and the steps every engine shares.

Owns: `BaseRollout` (`generate_sequences`, `update_weights`), `SamplingSettings`/`resolve_sampling` (which of
`rollout.*` and `rollout.val_kwargs.*` apply to a call), `generation_seed`, `resolve_token_ids` and
`build_rollout_output`, which turns left-padded prompts plus generated ids into the batch fields of one PPO
step (`prompts`, `responses`, `input_ids`, `attention_mask`, `position_ids`, `response_mask`,
`rollout_log_probs`).

Layer 5: imports torch, verl.protocol and verl.utils; must not import Ray or verl.single_controller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.torch_functional import get_response_mask


class BaseRollout(ABC):
    """A generation engine colocated with the actor of one rank."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One response per prompt row; see `build_rollout_output` for the fields returned."""

    @abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the actor's full (un-sharded) state dict, called after every actor update."""

    async def agenerate(self, req: Any) -> Any:
        """One `ModelResponse` for a `ModelRequest`; concurrent calls share batched generate calls
        (verl.workers.rollout.async_engine)."""
        from verl.workers.rollout.async_engine import get_async_engine

        return await get_async_engine(self).agenerate(req)


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling knobs of one generate call. Greedy is `do_sample=False` (temperature is then unused)."""

    do_sample: bool
    temperature: float
    top_k: int  # -1 = off
    top_p: float

    @property
    def logprob_temperature(self) -> float:
        """Temperature the rollout log-probs are computed at: the sampling one, 1.0 for greedy."""
        return self.temperature if self.do_sample else 1.0


def resolve_sampling(config: Any, meta_info: dict) -> SamplingSettings:
    """Pick the sampling knobs: `rollout.val_kwargs` when `meta_info["validate"]`, else `rollout.*`.

    `meta_info["do_sample"]`, `["temperature"]`, `["top_p"]`, `["top_k"]` override the config's for one call
    (what batched `agenerate` requests use); a temperature of 0 means greedy.
    """
    source = config.get("val_kwargs", None) if meta_info.get("validate", False) else config
    if source is None:
        raise ValueError("meta_info['validate'] is true but the rollout config has no val_kwargs section")
    do_sample = bool(meta_info.get("do_sample", source.get("do_sample", True)))
    # meta_info may override the sampling knobs of one call (what `agenerate` requests use)
    temperature = float(meta_info.get("temperature", source.get("temperature", 1.0)))
    if temperature < 0:
        raise ValueError(f"rollout temperature must be >= 0 (0 = greedy), got {temperature}")
    top_k = int(meta_info.get("top_k", source.get("top_k", -1)))
    top_p = float(meta_info.get("top_p", source.get("top_p", 1.0)))
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"rollout top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"rollout top_k must be -1 (off) or a positive int, got {top_k}")
    greedy = not do_sample or temperature == 0.0
    if greedy:
        return SamplingSettings(do_sample=False, temperature=1.0, top_k=-1, top_p=1.0)
    return SamplingSettings(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)


def generation_seed(config: Any, meta_info: dict, call_index: int) -> int:
    """Seed of one generate call: `meta_info["seed"]`, else `rollout.seed + call_index`, mixed with the rank.

    Mixing in the torch.distributed rank keeps the samples of different ranks independent when they hold
    copies of the same prompt (GRPO groups split over ranks).
    """
    base = meta_info.get("seed")
    if base is None:
        base = int(config.get("seed", 0)) + call_index
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return (int(base) * 1_000_003 + rank) % (2**63 - 1)


def resolve_token_ids(meta_info: dict, tokenizer: Any = None, generation_config: Any = None) -> tuple[Any, int]:
    """(eos_token_id (int or list of ints), pad_token_id) from meta_info, then the model's generation config,
    then the tokenizer; the pad id falls back to the (first) eos id."""
    eos = meta_info.get("eos_token_id")
    if eos is None and generation_config is not None:
        eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("no eos_token_id: put it in meta_info['eos_token_id'] or give the rollout a tokenizer")
    pad = meta_info.get("pad_token_id")
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    eos = [int(e) for e in eos] if isinstance(eos, (list, tuple)) else int(eos)
    return eos, int(pad)


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
