"""Reward post-processing and the sample mask of the RLVR pipeline (ROLL's `reward_postprocess` and
`get_sample_level_mask`), run per domain after scoring and before advantages.

Owns `RunningMoments`, `normalize_scores` (group / batch / running; unbiased std, a single value has mean 0, std 1),
`process_scores` (r' = weight * reward_scale * clip(norm(r), -reward_clip, reward_clip)), `MaskConfig`,
`sample_mask` (overlong, DAPO's equal-reward group filter, ROLL's difficulty mask: a dropped sample keeps its place
with an all-zero `response_mask`; a mask that would drop every sample is not applied) and `mask_metrics`.
Layer 8 helper: no Ray.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto

__all__ = [
    "EPS",
    "MaskConfig",
    "RunningMoments",
    "group_rows",
    "mask_metrics",
    "normalize_scores",
    "process_scores",
    "sample_mask",
    "truncated",
]

EPS = 1e-6
OVERLONG_MODES = (None, "drop", "zero")
SCORE_METRICS = ("score", "seq_reward")  # both mean the verifier's score of the sequence


def _moments(values: torch.Tensor) -> tuple[float, float]:
    """(mean, unbiased std); a single value gives (0, 1), as verl's GRPO does for a group of one."""
    if values.numel() < 2:
        return 0.0, 1.0
    return values.mean().item(), values.std().item()


class RunningMoments:
    """Mean and unbiased std of every value seen so far (Chan et al.'s parallel update, one batch at a time)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        values = values.double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count >= 2 else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def group_rows(index: Sequence) -> dict[Any, list[int]]:
    """Row numbers of each group id (uid), groups in first-seen order."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        groups[uid].append(row)
    return groups


def normalize_scores(
    scores: torch.Tensor,
    mode: str | None,
    index: Sequence | None = None,
    keep: torch.Tensor | None = None,
    running: RunningMoments | None = None,
) -> torch.Tensor:
    """`scores` (bs,) normalised by `mode` (None | "group" | "batch" | "running"); statistics use only the rows
    where `keep` is True (all rows when none is). `group` needs `index` (the uid of each row); `running` updates
    `running` with the kept scores first."""
    keep = torch.ones_like(scores, dtype=torch.bool) if keep is None else keep.bool()
    if not keep.any():
        keep = torch.ones_like(keep)
    if mode is None:
        return scores.clone()
    if mode == "group":
        if index is None:
            raise ValueError("reward_norm=group needs the uid of each sample")
        out = torch.empty_like(scores)
        for rows in group_rows(index).values():
            rows_t = torch.tensor(rows)
            kept = rows_t[keep[rows_t]]
            mean, std = _moments(scores[kept if kept.numel() else rows_t])
            out[rows_t] = (scores[rows_t] - mean) / (std + EPS)
        return out
    if mode == "batch":
        mean, std = _moments(scores[keep])
        return (scores - mean) / (std + EPS)
    if mode == "running":
        if running is None:
            raise ValueError("reward_norm=running needs a RunningMoments")
        running.update(scores[keep])
        return (scores - running.mean) / (running.std + EPS)
    raise ValueError(f"reward_norm={mode!r}; allowed: null, group, batch, running")


def process_scores(
    scores: torch.Tensor,
    norm: str | None = None,
    clip: float | None = None,
    scale: float = 1.0,
    weight: float = 1.0,
    index: Sequence | None = None,
    keep: torch.Tensor | None = None,
    running: RunningMoments | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """weight * scale * clip(norm(scores)) for one domain's scores (bs,); metrics: `critic/reward_clip_frac`."""
    out = normalize_scores(scores.float(), norm, index=index, keep=keep, running=running)
    metrics: dict[str, float] = {}
    if clip is not None:
        metrics["critic/reward_clip_frac"] = (out.abs() > clip).float().mean().item() if out.numel() else 0.0
        out = out.clamp(-clip, clip)
    return out * (float(scale) * float(weight)), metrics


# ------------------------------------------------------------------------------------------------ the mask step


@dataclass(frozen=True)
class MaskConfig:
    """Which mask strategies run (see the module docstring); built from `algorithm.*` by `from_config`."""

    overlong: str | None = None
    filter_groups: bool = False
    metric: str = "score"
    difficulty_mask: bool = False
    difficulty_low: float = 0.0
    difficulty_high: float = 1.0

    @property
    def active(self) -> bool:
        return self.overlong is not None or self.filter_groups or self.difficulty_mask

    @classmethod
    def from_config(cls, algorithm: Any) -> MaskConfig:
        algorithm = algorithm or {}
        overlong = algorithm.get("overlong_mask")
        if overlong not in OVERLONG_MODES:
            raise ValueError(f"algorithm.overlong_mask={overlong!r}; allowed: null, drop, zero")
        groups = algorithm.get("filter_groups") or {}
        metric = groups.get("metric") or "score"
        if metric == "reward":  # verl 0.9.1's default name of the verifier score before KL (= score)
            metric = "score"
        if metric == "seq_final_reward":
            raise ValueError(
                "algorithm.filter_groups.metric=seq_final_reward is not available here: groups are filtered right "
                "after scoring, before reward processing and KL; use score (= seq_reward) or a reward_extra key"
            )
        low = float(algorithm.get("difficulty_low_threshold", 0.0))
        high = float(algorithm.get("difficulty_high_threshold", 1.0))
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(
                f"algorithm.difficulty_low_threshold={low} and difficulty_high_threshold={high} must satisfy "
                "0 <= low <= high <= 1 (they bound a group's pass rate)"
            )
        return cls(
            overlong=overlong,
            filter_groups=bool(groups.get("enable", False)),
            metric=str(metric),
            difficulty_mask=bool(algorithm.get("difficulty_mask", False)),
            difficulty_low=low,
            difficulty_high=high,
        )


def truncated(batch: DataProto) -> torch.Tensor:
    """(bs,) bool: the response fills `max_response_length` (it was cut, not ended by eos)."""
    mask = batch.batch["response_mask"]
    return mask.sum(-1) >= mask.shape[-1]


def _metric_values(batch: DataProto, scores: torch.Tensor, metric: str) -> list[Any]:
    if metric in SCORE_METRICS:
        return scores.tolist()
    if metric not in batch.non_tensor_batch:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is not in the batch; use score (= seq_reward) or one of the "
            f"reward's extra fields {sorted(batch.non_tensor_batch)}"
        )
    return list(batch.non_tensor_batch[metric])


def sample_mask(batch: DataProto, cfg: MaskConfig, thresholds: Sequence[float]) -> dict[str, np.ndarray]:
    """Run the mask strategies on a scored batch (grouped by `uid`); (bs,) bool arrays, True = kept.

    With `overlong="zero"` the scores of truncated responses are set to 0 in `token_level_scores` (in place).
    `thresholds` (bs,): each sample's `correct_threshold` (for the difficulty mask's pass rate).
    Returns `{"max_len", "zero_std" (with filter_groups), "difficulty" (with difficulty_mask), "group" (the
    group filters together), "final" (the sample counts in the loss)}`.
    """
    size = len(batch)
    cut = truncated(batch).numpy()
    if cfg.overlong == "zero" and cut.any():
        batch.batch["token_level_scores"][torch.from_numpy(cut)] = 0.0
    scores = batch.batch["token_level_scores"].sum(-1)
    masks = {"max_len": ~cut if cfg.overlong == "drop" else np.ones(size, dtype=bool)}
    groups = group_rows(batch.non_tensor_batch["uid"])
    group_ok = np.ones(size, dtype=bool)
    if cfg.filter_groups:
        values = _metric_values(batch, scores, cfg.metric)
        varied = np.ones(size, dtype=bool)
        for rows in groups.values():
            varied[rows] = len({_hashable(values[r]) for r in rows}) > 1
        masks["zero_std"] = varied
        group_ok &= varied
    if cfg.difficulty_mask:
        passed = np.array([s >= t for s, t in zip(scores.tolist(), thresholds)], dtype=float)
        in_range = np.ones(size, dtype=bool)
        for rows in groups.values():
            in_range[rows] = cfg.difficulty_low <= passed[rows].mean() <= cfg.difficulty_high
        masks["difficulty"] = in_range
        group_ok &= in_range
    masks["group"] = group_ok
    masks["final"] = masks["max_len"] & group_ok
    return masks


def mask_metrics(masks: Mapping[str, np.ndarray], rows: np.ndarray | None = None, prefix: str = "") -> dict[str, float]:
    """ROLL's mask metrics over `rows` (all by default): `actor/{max_len,zero_std,difficulty,final}_mask_ratio`
    (share of samples each strategy keeps), `actor/samples_used`, `actor/samples_total`."""
    picked = {name: (mask if rows is None else mask[rows]) for name, mask in masks.items()}
    if picked["final"].size == 0:
        return {}
    out = {f"{prefix}actor/{name}_mask_ratio": float(mask.mean()) for name, mask in picked.items() if name != "group"}
    out[f"{prefix}actor/samples_used"] = float(picked["final"].sum())
    out[f"{prefix}actor/samples_total"] = float(picked["final"].size)
    return out


def _hashable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
