"""Reward managers: turn a DataProto of responses into token-level scores (verl's `reward_manager`).

Owns the public names of this package; importing it registers "naive", "batch", "dapo" and "prime".
Layer 4: imports torch, `verl.protocol` and `verl.utils.reward_score`, never models or Ray.
"""

from verl.workers.reward_manager.base import RewardFunctionError, RewardManagerBase
from verl.workers.reward_manager.batch import BatchRewardManager
from verl.workers.reward_manager.dapo import DAPORewardManager
from verl.workers.reward_manager.naive import NaiveRewardManager
from verl.workers.reward_manager.prime import PrimeRewardManager
from verl.workers.reward_manager.registry import (
    REWARD_MANAGER_REGISTRY,
    get_reward_manager_cls,
    register_reward_manager,
)

__all__ = [
    "REWARD_MANAGER_REGISTRY",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "PrimeRewardManager",
    "RewardFunctionError",
    "RewardManagerBase",
    "get_reward_manager_cls",
    "register_reward_manager",
]
