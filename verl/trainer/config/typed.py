"""The run's typed config: the sections of `ppo_trainer.yaml` that verl types, read once at start-up.

`build_typed_config(config)` turns `algorithm`, `actor_rollout_ref.{actor,ref,rollout,model}` and `critic` into verl's
dataclasses (`verl.workers.config`, `verl.trainer.config.AlgoConfig`) before Ray or any worker starts, so a value of
the wrong type, a value out of range or a key the section does not have fails in seconds with one line naming the
key. The workers read the same classes from their own sections.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from verl.trainer.config.algorithm import AlgoConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig, FSDPCriticConfig, HFModelConfig, RolloutConfig

__all__ = ["TypedConfig", "build_typed_config"]


@dataclass(frozen=True)
class TypedConfig:
    """One typed object per section."""

    algorithm: AlgoConfig
    actor: FSDPActorConfig
    ref: FSDPActorConfig
    rollout: RolloutConfig
    model: HFModelConfig
    critic: FSDPCriticConfig


def _ref_section(config: DictConfig) -> dict:
    """The reference section as `FSDPActorConfig` reads it (role ref: no update-only checks)."""
    ref = OmegaConf.to_container(config.actor_rollout_ref.ref, resolve=True)
    return {**ref, "role": "ref"}


def build_typed_config(config: DictConfig) -> TypedConfig:
    """Every typed section of `config` (ValueError naming the key at the first bad one)."""
    arr = config.actor_rollout_ref
    algorithm = omega_conf_to_dataclass(config.algorithm, AlgoConfig)
    rollout = omega_conf_to_dataclass(arr.rollout, RolloutConfig)  # before the sections that derive keys from it
    actor = omega_conf_to_dataclass(arr.actor, FSDPActorConfig)
    try:
        ref = omega_conf_to_dataclass(_ref_section(config), FSDPActorConfig)
    except ValueError as e:
        raise ValueError(f"actor_rollout_ref.ref.{e}") from None
    model = omega_conf_to_dataclass(arr.model, HFModelConfig)
    critic = OmegaConf.to_container(config.critic, resolve=True)
    critic.pop("device", None)  # written by the driver once the device is resolved
    try:
        critic = omega_conf_to_dataclass(critic, FSDPCriticConfig)
    except ValueError as e:
        raise ValueError(f"critic.{e}") from None
    return TypedConfig(algorithm=algorithm, actor=actor, ref=ref, rollout=rollout, model=model, critic=critic)
