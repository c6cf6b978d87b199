"""verl's typed worker configs (`verl.workers.config`): dataclasses built from the Hydra sections at start-up.

`omega_conf_to_dataclass(config.actor_rollout_ref.actor)` (from `verl.utils.config`) gives an `FSDPActorConfig`, and
so on for each section whose `_target_` names a class here. Fields and defaults are verl 0.9.1's; the workers and
the trainer read these objects (attribute access, one place for each default).
"""

from verl.trainer.config.algorithm import CheckpointConfig
from verl.workers.config.actor import ActorConfig, FSDPActorConfig, PolicyLossConfig
from verl.workers.config.critic import CriticConfig, FSDPCriticConfig
from verl.workers.config.engine import FSDPEngineConfig
from verl.workers.config.model import HFModelConfig, MtpConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, OptimizerConfig
from verl.workers.config.rollout import (
    AgentLoopConfig,
    CheckpointEngineConfig,
    CustomAsyncServerConfig,
    MultiTurnConfig,
    PrometheusConfig,
    RolloutConfig,
    SamplingConfig,
    TraceConfig,
)

__all__ = [
    "ActorConfig",
    "AgentLoopConfig",
    "CheckpointConfig",
    "CheckpointEngineConfig",
    "CriticConfig",
    "CustomAsyncServerConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPEngineConfig",
    "FSDPOptimizerConfig",
    "HFModelConfig",
    "MtpConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "PolicyLossConfig",
    "PrometheusConfig",
    "RolloutConfig",
    "SamplingConfig",
    "TraceConfig",
]
