"""Typed critic section: verl's `CriticConfig` and `FSDPCriticConfig`.

Names, defaults and checks are verl 0.9.1's; `critic.fsdp` is the engine section (the older `critic.fsdp_config`
and `critic.model.fsdp_config` are merged into it by `verl.workers.worker_config.critic_fsdp_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig
from verl.trainer.config.algorithm import CheckpointConfig
from verl.workers.config.actor import LOSS_AGG_MODES
from verl.workers.config.engine import FSDPEngineConfig
from verl.workers.config.model import HFModelConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig

__all__ = ["CriticConfig", "FSDPCriticConfig"]


@dataclass
class CriticConfig(BaseConfig):
    """The value model's update: batch sizes, value clipping, loss aggregation, epochs."""

    _mutable_fields = frozenset(
        {
            "ppo_mini_batch_size",
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "forward_micro_batch_size",
            "forward_micro_batch_size_per_gpu",
        }
    )
    strategy: str = "fsdp"
    rollout_n: int = 1
    enable: Optional[bool] = None
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: Optional[int] = 42
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[int] = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: FSDPOptimizerConfig = field(default_factory=lambda: FSDPOptimizerConfig(lr=1e-5))
    profiler: dict[str, Any] = field(default_factory=dict)
    model: HFModelConfig = field(default_factory=HFModelConfig)

    def __post_init__(self):
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}: one of {list(LOSS_AGG_MODES)}")
        if self.cliprange_value <= 0 or self.ppo_epochs < 1:
            raise ValueError(f"cliprange_value={self.cliprange_value}, ppo_epochs={self.ppo_epochs}: > 0 and >= 1")


@dataclass
class FSDPCriticConfig(CriticConfig):
    """The critic on the FSDP2 engine."""

    fsdp: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
    fsdp_config: dict[str, Any] = field(default_factory=dict)  # verl's older name of `fsdp`
    forward_micro_batch_size: Optional[int] = None
    forward_micro_batch_size_per_gpu: Optional[int] = None
    ulysses_sequence_parallel_size: int = 1
    grad_clip: float = 1.0
    device: Optional[str] = None  # extension: the device the driver resolved (not a key of the YAML)
