"""LoRA for the actor through peft: building the adapters, the reference policy as the base model with adapters
disabled.

Owns `lora_rank`, `apply_lora`, `is_lora_module` and `disabled_adapters`. Keys (verl's):
`actor_rollout_ref.model.lora_rank` (> 0 turns LoRA on), `lora_alpha`, `target_modules` ("all-linear" or a
list of module names). With LoRA only the adapters are trained (the optimizer holds no state for the base
weights), only the adapters are sent to an `hf` rollout engine after an update (vllm/sglang get the merged
weights; see `verl.workers.weight_sync`), and the reference policy is the actor's own base model with its adapters
switched off, so no second model is held in memory.
Layer 5 helper (used by the FSDP workers): imports torch and peft, never Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["apply_lora", "disabled_adapters", "is_lora_module", "lora_rank"]


def lora_rank(model_cfg: Any) -> int:
    """`model.lora_rank` as an int (0 = LoRA off); a negative or fractional value raises ValueError."""
    value = model_cfg.get("lora_rank", 0) or 0
    if int(value) != value or int(value) < 0:
        raise ValueError(f"model.lora_rank must be an integer >= 0 (0 = no LoRA), got {value!r}")
    return int(value)


def apply_lora(module: nn.Module, model_cfg: Any) -> nn.Module:
    """Wrap a HF causal LM in peft LoRA adapters (rank `lora_rank`, scale `lora_alpha / lora_rank`, no
    dropout) on `target_modules`; only the adapter weights stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("model.lora_rank > 0 needs peft: pip install peft") from err
    rank = lora_rank(model_cfg)
    alpha = model_cfg.get("lora_alpha", 16)
    if not float(alpha) > 0:
        raise ValueError(f"model.lora_alpha must be > 0, got {alpha!r}")
    targets = model_cfg.get("target_modules", "all-linear")
    if not isinstance(targets, str):
        targets = [str(t) for t in targets]
        if not targets:
            raise ValueError("model.target_modules is empty; use all-linear or a list of module names")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    try:
        return get_peft_model(module, config)
    except ValueError as err:
        raise ValueError(f"model.target_modules={targets!r} does not fit the model: {err}") from err


def is_lora_module(module: nn.Module) -> bool:
    """True for a peft model (one that has LoRA adapters)."""
    return hasattr(module, "peft_config")


@contextlib.contextmanager
def disabled_adapters(module: nn.Module) -> Iterator[None]:
    """Run the base model alone inside the block: the LoRA actor's reference policy."""
    with module.disable_adapter():
        yield
