"""The PPO trainer's configuration: `ppo_trainer.yaml` (verl 0.9.1's keys and defaults plus extension keys),
its start-up checks (`checks.py`), the table of features refused or without effect (`key_policy.py`) and the
conversion of legacy keys (`legacy.py`). `prepare_config` runs the conversion and the checks in order.
"""

from __future__ import annotations

from omegaconf import DictConfig

from verl.trainer.config.algorithm import (
    AlgoConfig,
    CheckpointConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from verl.trainer.config.checks import CONFIG_YAML, check_config, default_config, default_of
from verl.trainer.config.legacy import migrate_legacy_keys, resolve_cpu_dtypes

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "RolloutCorrectionConfig",
    "CONFIG_YAML",
    "check_config",
    "default_config",
    "default_of",
    "migrate_legacy_keys",
    "prepare_config",
    "resolve_cpu_dtypes",
]


def prepare_config(config: DictConfig, notify=None) -> DictConfig:
    """Convert legacy keys (as verl does) and check types and refused features, before the config resolves."""
    n_workers = int(config.trainer.get("n_gpus_per_node", 1) or 1) * int(config.trainer.get("nnodes", 1) or 1)
    migrate_legacy_keys(config, n_workers, notify)
    check_config(config, notify)
    return config
