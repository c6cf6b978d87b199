"""Sampling settings of one generate call: which of `rollout.*` / `rollout.val_kwargs.*` / meta_info apply.

Owns `SamplingSettings`, `resolve_sampling`, `generation_seed` and `resolve_token_ids` (re-exported by
`verl.workers.rollout.base`). A module of its own so that both the engine interface (`base`) and the batching
async engine (`async_engine`) use it without importing each other in a cycle.
Layer 5: imports torch only; must not import Ray or verl.single_controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SamplingSettings", "generation_seed", "resolve_sampling", "resolve_token_ids"]


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
