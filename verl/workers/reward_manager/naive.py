"""The naive reward manager: score each sample in turn with `compute_score` (verl's default manager).

Owns `NaiveRewardManager`, registered as "naive". Everything else (decoding, result checks, placing the
score at the last valid response token, `on_error`) is `RewardManagerBase`'s.
"""

from __future__ import annotations

from verl.workers.reward_manager.base import RewardManagerBase
from verl.workers.reward_manager.registry import register_reward_manager

__all__ = ["NaiveRewardManager"]


@register_reward_manager("naive")
class NaiveRewardManager(RewardManagerBase):
    """`compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs)` once per sample."""
