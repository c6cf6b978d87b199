"""A reward-free control for an RL run, as a verl custom reward function: constant on training rows, real on
validation rows.

    reward.custom_reward_function.path=verl/utils/reward_score/control.py reward.custom_reward_function.name=compute_score

Every training response scores `CONTROL_SCORE`, so each GRPO / RLOO / REINFORCE++ group has zero advantage and the
policy-gradient term is exactly zero: whatever still moves the policy (an entropy term, a KL term) is what the
job does without the reward's signal. Validation rows keep their data source's own reward
(`default_compute_score`), so the control's validation figures compare with the real run's. A row is a training
row when its `extra_info.split` is "train" (the field verl's data scripts and this project's data write); a row
without that field stops the run, since it cannot be told apart. The real score of each training response is
still returned, as `real_score` (logged as `reward_extra/real_score/mean`), and not used by the update.

`bash train_grpo.sh` with `CONTROL=1` runs the default job this way. Layer 3: pure functions of strings.
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
