"""GSM8K as a single chat turn scored by a `Rubric`: `correct_answer` (weight 1.0, verl's strict `####` rule) and
`answer_format` (weight 0.1). Run with `rollout.workflow=environment`,
`+actor_rollout_ref.rollout.workflow_kwargs.env=verl.envs.gsm8k:GSM8KEnv` and `data.return_raw_chat=true`.
Layer 5: must not import Ray.
"""

from __future__ import annotations

from typing import Any

from verl.envs.environment import Rubric, SingleTurnEnv
from verl.utils.reward_score import gsm8k

__all__ = ["GSM8KEnv", "answer_format", "correct_answer"]


def _text(completion: list[dict]) -> str:
    return completion[-1]["content"] if completion else ""


def correct_answer(completion: list[dict], answer: Any) -> float:
    """1.0 when the completion's `#### N` equals the reference number, else 0.0."""
    return gsm8k.compute_score(_text(completion), str(answer), method="strict", format_score=0.0, score=1.0)


def answer_format(completion: list[dict]) -> float:
    """1.0 when the completion ends its reasoning with a `#### <number>` line."""
    return 0.0 if gsm8k.extract_solution(_text(completion), method="strict") is None else 1.0


class GSM8KEnv(SingleTurnEnv):
    def __init__(self, format_weight: float = 0.1, **kwargs: Any):
        super().__init__(rubric=Rubric([correct_answer, answer_format], [1.0, float(format_weight)]), **kwargs)
