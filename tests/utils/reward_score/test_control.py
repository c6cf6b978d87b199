"""The reward-free control (verl/utils/reward_score/control.py): constant on training rows, real elsewhere, and
a zero GRPO advantage from it."""

import pytest
import torch

from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.reward import CustomRewardFunction
from verl.utils.reward_score import control, rlla
from verl.utils.reward_score.rlla import FLAG_NAMES

GT = '<think> t </think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>'
WRONG = '<think> t </think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(autouse=True)
def _no_flags_from_the_environment(monkeypatch):
    for name in FLAG_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_training_rows_score_the_constant_and_keep_the_real_score_aside():
    for answer in (GT, WRONG, "nonsense"):
        out = control.compute_score("rlla", answer, GT, extra_info={"split": "train"})
        assert out == {"score": control.CONTROL_SCORE, "real_score": rlla.compute_score(answer, GT)[0]}


def test_validation_rows_score_the_real_reward():
    out = control.compute_score("rlla", WRONG, GT, extra_info={"split": "test"})
    assert out["score"] == rlla.compute_score(WRONG, GT)[0] and out["format"] == 1.0


def test_a_row_without_split_is_refused():
    with pytest.raises(ValueError, match="extra_info.split"):
        control.compute_score("rlla", GT, GT, extra_info={"index": 3})


def test_loads_as_a_custom_reward_function_and_gives_zero_grpo_advantages():
    fn = CustomRewardFunction(control.__file__, "compute_score")
    scores = [fn(data_source="rlla", solution_str=a, ground_truth=GT, extra_info={"split": "train"})["score"]
              for a in (GT, WRONG, GT, "x")]  # fmt: skip
    token_rewards = torch.zeros(4, 3)
    token_rewards[:, -1] = torch.tensor(scores)
    adv, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(4, 3), index=["a", "a", "b", "b"])
    assert torch.equal(adv, torch.zeros(4, 3))
