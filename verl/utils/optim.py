"""The optimizer and learning-rate schedule of an `optim` config section (verl's keys).

Owns `build_optimizer` (AdamW over the trainable parameters: `lr`, `weight_decay`, `betas`, `eps`, plus verl's
`override_optimizer_config`, extra keyword arguments of the constructor) and `build_lr_scheduler` (linear warmup,
then constant or cosine). Which AdamW kernel runs is torch's choice (a loop over tensors on CPU, `foreach` on
CUDA) except that parameters all on the CPU get the fused kernel: the same arithmetic in one pass per tensor
instead of a dozen (figures: benchmarks/README.md); `override_optimizer_config` may set `fused` or
`foreach` itself. The section is read as verl's typed `FSDPOptimizerConfig` (a mapping is converted; keys it leaves
out take verl's defaults). Layer 1: imports torch and the config dataclasses.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.optimizer import LR_SCHEDULES as LR_SCHEDULE_STYLES
from verl.workers.config.optimizer import FSDPOptimizerConfig, OptimizerConfig

__all__ = ["LR_SCHEDULE_STYLES", "build_lr_scheduler", "build_optimizer", "typed_optim_config"]

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
    optim_cfg = typed_optim_config(optim_cfg)
    betas = tuple(float(b) for b in optim_cfg.betas)
    if len(betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {list(betas)}")
    kwargs = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.weight_decay, "betas": betas, "eps": optim_cfg.eps}
    overrides = _overrides(getattr(optim_cfg, "override_optimizer_config", None))
    kwargs.update(overrides)
    if "fused" not in overrides and "foreach" not in overrides and _all_on_cpu(params):
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def typed_optim_config(optim_cfg: Any) -> OptimizerConfig:
    """The `optim` section as verl's typed config (`FSDPOptimizerConfig` for a mapping)."""
    if isinstance(optim_cfg, OptimizerConfig):
        return optim_cfg
    return omega_conf_to_dataclass(dict(optim_cfg or {}), FSDPOptimizerConfig)


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
    optim_cfg = typed_optim_config(optim_cfg)
    style = optim_cfg.warmup_style or optim_cfg.lr_scheduler_type
    warmup_steps = int(optim_cfg.lr_warmup_steps or -1)
    ratio = float(optim_cfg.lr_warmup_steps_ratio)
    if (style == "cosine" or (warmup_steps <= 0 and ratio > 0)) and total_training_steps <= 0:
        raise ValueError(
            f"total_training_steps must be > 0 for a {style} schedule with warmup ratio {ratio}, got {total_training_steps}"
        )
    if warmup_steps <= 0:
        warmup_steps = int(ratio * total_training_steps)
    min_lr_ratio = float(getattr(optim_cfg, "min_lr_ratio", 0.0))

    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_training_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, lr_lambda)
