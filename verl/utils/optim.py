"""The optimizer and learning-rate schedule of an `optim` config section (verl's keys).

Owns `build_optimizer` (AdamW over the trainable parameters: `lr`, `weight_decay`, `betas`, `eps`, plus verl's
`override_optimizer_config`, extra keyword arguments of the constructor) and `build_lr_scheduler` (linear warmup,
then constant or cosine). Which AdamW kernel runs is torch's choice (a loop over tensors on CPU, `foreach` on
CUDA) except that parameters all on the CPU get the fused kernel: the same arithmetic in one pass per tensor
instead of a dozen (figures: benchmarks/README.md); `override_optimizer_config` may set `fused` or
`foreach` itself. Layer 1: imports torch only.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LR_SCHEDULE_STYLES", "build_lr_scheduler", "build_optimizer"]

LR_SCHEDULE_STYLES = ("constant", "cosine")
# the AdamW constructor arguments `override_optimizer_config` may set (all but the parameters)
ADAMW_ARGUMENTS = tuple(name for name in inspect.signature(torch.optim.AdamW).parameters if name != "params")


def build_optimizer(model_or_params: nn.Module | Iterable[torch.nn.Parameter], optim_cfg: Any) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, from an `optim` config (dict-like: lr, weight_decay, betas, eps,
    override_optimizer_config)."""
    if isinstance(model_or_params, nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
    else:
        params = [p for p in model_or_params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer got no trainable parameters (all have requires_grad=False)")
    betas = tuple(float(b) for b in optim_cfg.get("betas", (0.9, 0.999)))
    if len(betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {list(betas)}")
    kwargs = {
        "lr": float(optim_cfg.get("lr", 1e-6)),
        "weight_decay": float(optim_cfg.get("weight_decay", 0.01)),
        "betas": betas,
        "eps": float(optim_cfg.get("eps", 1e-8)),
    }
    overrides = _overrides(optim_cfg.get("override_optimizer_config", None))
    kwargs.update(overrides)
    if "fused" not in overrides and "foreach" not in overrides and _all_on_cpu(params):
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def _overrides(value: Any) -> dict[str, Any]:
    """`override_optimizer_config` as plain keyword arguments; a key AdamW does not take is refused."""
    if value is None:
        return {}
    if not hasattr(value, "items"):
        raise ValueError(f"optim.override_optimizer_config must be a mapping or null, got {value!r}")
    out = {}
    for key, item in value.items():
        if key not in ADAMW_ARGUMENTS:
            raise ValueError(
                f"optim.override_optimizer_config has {key!r}, which torch.optim.AdamW does not take; allowed: "
                f"{list(ADAMW_ARGUMENTS)}"
            )
        out[str(key)] = tuple(item) if key == "betas" else item
    return out


def _all_on_cpu(params: list[torch.Tensor]) -> bool:
    """Every parameter (a DTensor's local shard included) is a floating-point tensor on the CPU."""
    return all(p.device.type == "cpu" and p.is_floating_point() for p in params)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: Any, total_training_steps: int) -> LambdaLR:
    """LambdaLR with linear warmup from 0, then constant or cosine decay (verl's `optim` keys).

    warmup steps W = `lr_warmup_steps` if > 0 else int(`lr_warmup_steps_ratio` * total_training_steps).
    Multiplier at step s (s < W): s / W. After warmup, with T = total_training_steps, r = `min_lr_ratio`:
      constant: 1
      cosine:   r + (1 - r) * 0.5 * (1 + cos(pi * p)),  p = min(1, (s - W) / max(1, T - W))
    The style is `warmup_style` or `lr_scheduler_type` (default constant).
    """
    style = optim_cfg.get("warmup_style") or optim_cfg.get("lr_scheduler_type") or "constant"
    if style not in LR_SCHEDULE_STYLES:
        raise ValueError(f"unknown lr schedule style {style!r}; allowed: {list(LR_SCHEDULE_STYLES)}")
    warmup_steps = int(optim_cfg.get("lr_warmup_steps", -1) or -1)
    ratio = float(optim_cfg.get("lr_warmup_steps_ratio", 0.0) or 0.0)
    if (style == "cosine" or (warmup_steps <= 0 and ratio > 0)) and total_training_steps <= 0:
        raise ValueError(
            f"total_training_steps must be > 0 for a {style} schedule with warmup ratio {ratio}, got {total_training_steps}"
        )
    if warmup_steps <= 0:
        warmup_steps = int(ratio * total_training_steps)
    min_lr_ratio = float(optim_cfg.get("min_lr_ratio", 0.0) or 0.0)
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_training_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, lr_lambda)
