"""A reward-free control as a verl custom reward function: every training row (`extra_info.split == "train"`, else
an error) scores `CONTROL_SCORE`, so the policy gradient is zero; validation rows keep their real reward. The real
score is returned as `real_score`. `bash train_grpo.sh` with `CONTROL=1` runs the default job this way.
Layer 3: pure functions of strings.
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import default_compute_score

__all__ = ["CONTROL_SCORE", "compute_score"]

CONTROL_SCORE = 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict[str, Any]:
    """`{"score": CONTROL_SCORE, "real_score": <the real score>}` for a training row; the data source's own
    reward (`default_compute_score`) for any other row."""
    split = (extra_info or {}).get("split")
    if split is None:
        raise ValueError(
            f"control reward: a row of data_source {data_source!r} has no extra_info.split, so training and "
            "validation rows cannot be told apart; write extra_info.split ('train' / 'test') in the data"
        )
    real = default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if split != "train":
        return real
    return {"score": CONTROL_SCORE, "real_score": float(real["score"] if isinstance(real, dict) else real)}
