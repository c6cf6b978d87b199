"""The DAPO reward manager: per-sample scores plus DAPO's soft overlong punishment.

Owns `DAPORewardManager`, registered as "dapo". With `overlong_buffer_cfg.enable`, a response of
`L` valid tokens gets `min(-(L - (max_resp_len - len)) / len * penalty_factor, 0)` added to its score
(DAPO, Yu et al. 2025): no penalty up to `max_resp_len - len` tokens, then linear down to
`-penalty_factor` at `max_resp_len`. With `overlong_buffer_cfg.log`, `overlong_reward` and `overlong`
(penalty < 0) are added to `reward_extra_info`.
"""

from __future__ import annotations

from typing import Any

from verl.workers.reward_manager.base import RewardManagerBase, RewardSample
from verl.workers.reward_manager.registry import register_reward_manager

__all__ = ["DAPORewardManager"]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if cfg is not None else default


@register_reward_manager("dapo")
class DAPORewardManager(RewardManagerBase):
    """Naive scoring, then the overlong-buffer penalty on each reward.

    Args (beyond RewardManagerBase's):
        max_resp_len: the rollout's maximum response length in tokens (needed when the buffer is on).
        overlong_buffer_cfg: dict-like with `enable`, `len`, `penalty_factor`, `log`.
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)
        self.max_resp_len = max_resp_len
        self.overlong_buffer_cfg = overlong_buffer_cfg
        if _get(overlong_buffer_cfg, "enable", False):
            buffer_len = _get(overlong_buffer_cfg, "len")
            if max_resp_len is None or buffer_len is None or not 0 < int(buffer_len) <= int(max_resp_len):
                raise ValueError(
                    f"dapo overlong buffer needs 0 < overlong_buffer_cfg.len <= max_resp_len, got len={buffer_len}, "
                    f"max_resp_len={max_resp_len}"
                )

    def score_one(self, sample: RewardSample, kwargs: dict[str, Any]) -> Any:
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and sample.response_str.endswith(eos):
            sample.response_str = sample.response_str[: -len(eos)]
        return super().score_one(sample, kwargs)

    def final_rewards(self, samples: list[RewardSample], scores: list[float], extra: dict[str, list]) -> list[float]:
        cfg = self.overlong_buffer_cfg
        if not _get(cfg, "enable", False):
            return scores
        buffer_len = int(_get(cfg, "len"))
        factor = float(_get(cfg, "penalty_factor", 1.0))
        expected_len = int(self.max_resp_len) - buffer_len
        penalties = [min(-(s.response_length - expected_len) / buffer_len * factor, 0.0) for s in samples]
        if _get(cfg, "log", False):
            extra["overlong_reward"] = penalties
            extra["overlong"] = [p < 0 for p in penalties]
        errors = extra.get("reward_errors", [0] * len(samples))  # a failed sample stays at 0 (on_error="zero")
        return [score if error else score + penalty for score, penalty, error in zip(scores, penalties, errors)]
