"""Advantages of agent-loop batches whose prompts produced several trajectories per session (verl 0.9.1's
`verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories`).

Each row carries a key `{uid}_{session_id}_{index}`: the rows of one session are the outputs of one agent loop run,
the one with the highest index its final output. GRPO groups the final outputs of each uid, and every row of a
session gets its final output's advantage on its own response tokens. Other estimators see the batch unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator, compute_advantage

__all__ = ["compute_advantage", "compute_advantage_for_multi_trajectories"]


def _session_of(key: str) -> tuple[str, int]:
    """`{uid}_{session_id}_{index}` -> (`{uid}_{session_id}`, index)."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
        raise ValueError(f"batch key {key!r} is not of the form '{{uid}}_{{session_id}}_{{index}}' (index an integer)")
    return f"{parts[0]}_{parts[1]}", int(parts[2])


def compute_advantage_for_multi_trajectories(
    data: DataProto,
    batch_keys: list[str],
    adv_estimator: str | AdvantageEstimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> DataProto:
    """Write `advantages` and `returns` (bs, response_length) into `data` and return it.

    For GRPO, only each session's final row (highest index among the rows whose `batch_keys` share
    `{uid}_{session_id}`) enters the group statistics; its advantage (a constant over its response) is broadcast to
    every row of the session, times that row's `response_mask`; returns equal advantages. Any other estimator runs
    `compute_advantage` on the whole batch.
    """
    kwargs = dict(gamma=gamma, lam=lam, num_repeat=num_repeat, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    if adv_estimator != AdvantageEstimator.GRPO:  # a str Enum: equal to "grpo" too
        return compute_advantage(data, adv_estimator, config=config, **kwargs)
    if len(batch_keys) != len(data):
        raise ValueError(f"got {len(batch_keys)} batch keys for a batch of {len(data)} rows")
    final: dict[str, tuple[int, int]] = {}  # session -> (index, row) of its final output
    sessions = []
    for row, key in enumerate(batch_keys):
        session, index = _session_of(key)
        sessions.append(session)
        if session not in final or final[session][0] < index:
            final[session] = (index, row)
    final_rows = [row for _, row in final.values()]
    position = {session: i for i, session in enumerate(final)}
    finals = compute_advantage(data.select_idxs(final_rows), adv_estimator, config=config, **kwargs)
    first_token = finals.batch["response_mask"].argmax(dim=1)
    per_session = finals.batch["advantages"][torch.arange(len(final_rows)), first_token]
    scores = per_session[[position[s] for s in sessions]].unsqueeze(-1) * data.batch["response_mask"]
    data.batch["advantages"] = scores
    data.batch["returns"] = scores
    return data
