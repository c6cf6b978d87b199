"""The trainer's side of agent-loop rows (the `agent_loop` workflow's non-tensor fields): verl's `num_turns/*` and the
tool-reward metrics, the loops' own `reward_score` used as the reward only when every row has one, and the loop's
extra fields (`tool_rewards`, ...) and `num_turns` in the reward function's `extra_info`, as verl passes them."""

from __future__ import annotations

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import compute_agent_loop_metrics
from verl.trainer.ppo.reward import compute_reward
from verl.workers.reward_manager.naive import NaiveRewardManager


def objects(*values) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = list(values)
    return column


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def rows(reward_scores=(None, None)) -> DataProto:
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])
    return DataProto.from_dict(
        tensors={"responses": torch.arange(12).reshape(2, 6), "response_mask": mask,
                 "attention_mask": torch.ones(2, 8, dtype=torch.long)},
        non_tensors={"__num_turns__": objects(4, 2), "tool_rewards": objects([0.0, -0.05], []),
                     "turn_scores": objects([], []), "reward_score": objects(*reward_scores),
                     "tool_extra_fields": objects({"tool_rewards": [0.0, -0.05], "max_global_steps": 3}, {}),
                     "agent_loop_metrics": objects({"generate_sequences": 0.5, "tool_calls": 0.25}, {}),
                     "data_source": objects("toy", "toy"),
                     "reward_model": objects({"ground_truth": "1"}, {"ground_truth": "2"}),
                     "extra_info": objects({"index": 0}, None)},
    )  # fmt: skip


def test_turn_and_tool_reward_metrics():
    metrics = compute_agent_loop_metrics(rows())
    assert metrics["num_turns/mean"] == 3.0 and metrics["num_turns/max"] == 4.0 and metrics["num_turns/min"] == 2.0
    assert np.isclose(metrics["agent_loop/tool_reward/mean"], -0.025) and metrics["agent_loop/tool_reward/min"] < 0
    assert metrics["agent_loop/num_tool_calls/mean"] == 1.0
    assert metrics["agent_loop/generate_sequences/max"] == 0.5 and metrics["agent_loop/tool_calls/mean"] == 0.125
    assert compute_agent_loop_metrics(DataProto.from_dict(tensors={"x": torch.zeros(2)})) == {}


def test_the_loops_scores_are_the_reward_only_when_every_row_has_one():
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.25

    manager = NaiveRewardManager(Tokenizer(), num_examine=0, compute_score=score)
    scores, _ = compute_reward(rows((1.0, 0.5)), manager)
    assert not seen and scores[0, 4] == 1.0 and scores[1, 0] == 0.5 and scores.sum() == 1.5  # at the last trained token
    scores, _ = compute_reward(rows((1.0, None)), manager)
    assert scores.sum() == 0.5 and len(seen) == 2  # one row without: the reward function scores all of them
    assert seen[0] == {"index": 0, "tool_rewards": [0.0, -0.05], "max_global_steps": 3, "num_turns": 4}
    assert seen[1] == {"num_turns": 2}
