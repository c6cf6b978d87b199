"""Reward worker types of the multi-domain RLVR pipeline (ROLL's): `REWARD_TYPES` (`math_rule`, `code_sandbox`,
`llm_judge`, `rlla`, `ifeval`), `reward_type_of(reward)` and `make_compute_score(reward_type)`.
Layer 3: pure functions of strings; no tensors, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.utils import reward_score

__all__ = ["REWARD_TYPES", "make_compute_score", "reward_type_of"]

REWARD_TYPES = ("math_rule", "code_sandbox", "llm_judge", "rlla", "ifeval")
_MATH_RULE_SOURCES = reward_score.GSM8K_SOURCES + reward_score.MATH_SOURCES
_FIXED_SOURCE = {"code_sandbox": "code", "llm_judge": "llm_judge", "rlla": "rlla", "ifeval": "ifeval"}
_SOURCE_TYPES = (
    (_MATH_RULE_SOURCES, "math_rule"),
    (reward_score.CODE_SOURCES, "code_sandbox"),
    (reward_score.JUDGE_SOURCES, "llm_judge"),
    (reward_score.RLLA_SOURCES, "rlla"),
    (reward_score.IFEVAL_SOURCES, "ifeval"),
)


def reward_type_of(reward: Any, where: str = "reward") -> tuple[str, str | None]:
    """(reward type, the data source to score as or None) of a domain's `reward`: a type, or a data source."""
    if reward in REWARD_TYPES:
        return reward, None
    for sources, kind in _SOURCE_TYPES:
        if reward in sources:
            return kind, reward
    if isinstance(reward, str) and reward.startswith("rlla"):
        return "rlla", reward
    raise ValueError(
        f"{where}={reward!r} is not a known reward; allowed: a worker type {list(REWARD_TYPES)} "
        f"or a data source {list(reward_score.KNOWN_DATA_SOURCES)}"
    )


def make_compute_score(reward_type: str, **bound: Any) -> Callable[..., Any]:
    """The scorer of a reward type, with `default_compute_score`'s signature; `bound` keyword arguments go to every
    call (the type's `score_kwargs`, e.g. the sandbox's timeout_s or the judge's url and model)."""
    if reward_type not in REWARD_TYPES:
        raise ValueError(f"unknown reward type {reward_type!r}; allowed: {list(REWARD_TYPES)}")

    def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any):
        if reward_type == "math_rule":
            source = data_source if data_source in _MATH_RULE_SOURCES else "math"
        else:
            source = _FIXED_SOURCE[reward_type]
        return reward_score.default_compute_score(source, solution_str, ground_truth, extra_info, **bound, **kwargs)

    compute_score.__name__ = f"{reward_type}_score"
    return compute_score
