"""Typed sections of the `algorithm` config and the checkpoint section (verl's `verl.trainer.config` classes).

`AlgoConfig` (advantage estimator, discount, KL control, group filtering, rollout correction), `KLControlConfig`,
`FilterGroupsConfig`, `RolloutCorrectionConfig` and `CheckpointConfig`. Field names and defaults are verl 0.9.1's
(and `ppo_trainer.yaml`'s; a test keeps them equal); fields marked extension are this project's. The comments of
each key are in `ppo_trainer.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig

__all__ = ["AlgoConfig", "CheckpointConfig", "FilterGroupsConfig", "KLControlConfig", "RolloutCorrectionConfig"]

CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointConfig(BaseConfig):
    """What a worker's checkpoint saves and loads."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    async_save: bool = False
    strict: bool = True
    save_lora_only: bool = False

    def __post_init__(self):
        for key in ("save_contents", "load_contents"):
            bad = [c for c in getattr(self, key) if c not in CHECKPOINT_CONTENTS]
            if bad:
                raise ValueError(f"{key}={list(getattr(self, key))}: {bad} not among {list(CHECKPOINT_CONTENTS)}")


@dataclass
class KLControlConfig(BaseConfig):
    """The in-reward KL coefficient: fixed, or adaptive towards `target_kl` over `horizon` steps."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self):
        if self.type not in ("fixed", "adaptive"):
            raise ValueError(f"type={self.type!r}: the KL controller is fixed or adaptive")


@dataclass
class FilterGroupsConfig(BaseConfig):
    """DAPO's dynamic sampling: drop groups whose metric is the same for every sample."""

    enable: bool = False
    metric: Optional[str] = "reward"
    max_num_gen_batches: int = 0
    max_inflight_gen_batches: int = 1
    on_cap: str = "continue"  # extension

    def __post_init__(self):
        if self.on_cap not in ("continue", "error"):
            raise ValueError(f"on_cap={self.on_cap!r}: continue or error")


@dataclass
class RolloutCorrectionConfig(BaseConfig):
    """Importance weights and rejection against the rollout engine's log-probs (off-policy correction)."""

    rollout_is: Optional[str] = None
    rollout_is_threshold: Any = 2.0
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False

    def __post_init__(self):
        if self.rollout_is not in (None, "token", "sequence"):
            raise ValueError(f"rollout_is={self.rollout_is!r}: null, token or sequence")
        if self.loss_type not in ("ppo_clip", "reinforce"):
            raise ValueError(f"loss_type={self.loss_type!r}: ppo_clip or reinforce")


@dataclass
class AlgoConfig(BaseConfig):
    """The `algorithm` section: advantage estimation and reward shaping."""

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    gdpo_reward_keys: Optional[list[str]] = None  # extension
    gdpo_reward_weights: Optional[list[float]] = None  # extension
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False
    pf_ppo: dict[str, Any] = field(default_factory=lambda: {"reweight_method": "pow", "weight_pow": 2.0})
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    reward_norm: Optional[str] = None  # extension
    reward_clip: Optional[float] = None  # extension
    reward_scale: float = 1.0  # extension
    overlong_mask: Optional[Any] = None  # extension
    difficulty_mask: bool = False  # extension
    difficulty_low_threshold: float = 0.0  # extension
    difficulty_high_threshold: float = 1.0  # extension

    def __post_init__(self):
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"gamma={self.gamma}, lam={self.lam}: both must lie in [0, 1]")
