"""An inference engine for a hand-written RL loop: `build_inference_engine(model_path, config)` builds the `hf`
rollout engine on its own frozen copy of the model (LoRA adapters when `lora` gives a rank) wrapped in an
`AsyncRolloutEngine` (AReaL-lite's `InferenceEngine`), refreshed by `upload_weights(WeightUpdateMeta
.from_colocated(engine))`. `config` holds `rollout` keys; defaults are verl's except `calculate_log_probs` (true)
and `dtype` (float32). Layer 5: no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from verl.utils import fsdp_utils
from verl.utils.device import get_device_name, set_attention_backends
from verl.workers.lora import apply_lora
from verl.workers.rollout.async_engine import AsyncRolloutEngine, batching_options
from verl.workers.rollout.hf_rollout import HFRollout

__all__ = ["ROLLOUT_DEFAULTS", "build_inference_engine"]

ROLLOUT_DEFAULTS = {
    "name": "hf",
    "response_length": 512,  # verl's data.max_response_length
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "do_sample": True,
    "calculate_log_probs": True,
    "dtype": "float32",
    "seed": 0,
    "micro_batch_size": None,
    "ignore_eos": False,
    "agenerate_window_ms": 5,
    "agenerate_max_batch_size": None,
    "val_kwargs": {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1},
}


def build_inference_engine(
    model_path: str,
    config: Mapping[str, Any] | None = None,
    *,
    tokenizer: Any = None,
    device: str = "auto",
    seed: int | None = 0,
    lora: Mapping[str, Any] | None = None,
) -> AsyncRolloutEngine:
    """An `AsyncRolloutEngine` over the `hf` engine with the model at `model_path`.

    config: rollout keys over `ROLLOUT_DEFAULTS` (an unknown key raises KeyError). tokenizer: the policy's (loaded
    from `model_path` when None). seed: the first generate call's seed (later calls derive theirs from it; None:
    the engine's own counter from `config["seed"]`). lora: `lora_rank`/`lora_alpha`/`target_modules` of the training
    engine's adapters, to build the same adapters here.
    """
    unknown = sorted(set(config or {}) - set(ROLLOUT_DEFAULTS))
    if unknown:
        raise KeyError(f"build_inference_engine: unknown rollout keys {unknown}; known: {sorted(ROLLOUT_DEFAULTS)}")
    cfg = OmegaConf.merge(OmegaConf.create(ROLLOUT_DEFAULTS), OmegaConf.create(dict(config or {})))
    if cfg.name != "hf":
        raise ValueError(
            f"build_inference_engine builds the hf engine; rollout name {cfg.name!r} is not supported here"
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    device_name = get_device_name(device)
    set_attention_backends(device_name)  # no cuDNN attention on CUDA: a plan per new shape (verl.utils.device)
    module = fsdp_utils.load_causal_lm(model_path, dtype=str(cfg.dtype), attn_implementation="sdpa")
    if lora is not None and int(lora.get("lora_rank", 0) or 0) > 0:
        module = apply_lora(module, OmegaConf.create(dict(lora)))
    module = fsdp_utils.materialize_parameters(module.requires_grad_(False))  # rewritten by every weight update
    rollout = HFRollout(module.eval().to(device_name), cfg, tokenizer)
    meta = {} if seed is None else {"seed": int(seed)}
    return AsyncRolloutEngine(rollout, meta, **batching_options(cfg))
