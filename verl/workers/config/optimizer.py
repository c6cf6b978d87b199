"""Typed optimizer section (`actor.optim`, `critic.optim`): verl's `OptimizerConfig` and `FSDPOptimizerConfig`.

Names and defaults are verl 0.9.1's; `verl.utils.optim` builds the optimizer and LR schedule from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig

__all__ = ["FSDPOptimizerConfig", "OptimizerConfig"]

LR_SCHEDULES = ("constant", "cosine")  # verl.utils.optim builds these


@dataclass
class OptimizerConfig(BaseConfig):
    """Learning rate, warm-up and schedule, weight decay and gradient clipping of one optimizer."""

    _mutable_fields = frozenset({"total_training_steps", "lr_warmup_steps"})
    lr: float = 1e-3
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1
    weight_decay: float = 0.01
    lr_warmup_steps: Optional[int] = -1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: float = 1.0
    lr_scheduler_type: str = "constant"
    warmup_style: Optional[str] = None  # verl's older name of lr_scheduler_type; wins when set
    eps: float = 1e-8

    def __post_init__(self):
        if self.lr < 0:
            raise ValueError(f"lr={self.lr}: the learning rate cannot be negative")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"lr_warmup_steps_ratio={self.lr_warmup_steps_ratio}: must lie in [0, 1]")
        key = "warmup_style" if self.warmup_style else "lr_scheduler_type"
        if getattr(self, key) not in LR_SCHEDULES:
            raise ValueError(f"{key}={getattr(self, key)!r}: one of {list(LR_SCHEDULES)}")


@dataclass
class FSDPOptimizerConfig(OptimizerConfig):
    """The FSDP workers' optimizer: which class (`optimizer_impl.optimizer`) and its cosine schedule's shape."""

    lr: float = 1e-6
    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    zero_indexed_step: bool = True
    override_optimizer_config: Optional[dict[str, Any]] = None

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: must lie in [0, 1]")
