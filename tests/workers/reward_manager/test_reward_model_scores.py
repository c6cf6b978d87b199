"""A reward model's `rm_scores` in the batch (verl's contract, verl/workers/reward_manager/base.py): without a custom
score function every manager returns them as the scores, also when the default scorer is bound to settings (a
sandbox url); with one, the function decides and gets each row's reward-model score as `extra_info["rm_score"]`."""

import functools

import pytest
import torch

from verl.trainer.ppo.reward import CustomRewardFunction
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
)
from verl.workers.reward_manager.batch import default_batch_compute_score


def _with_rm_scores(make_batch):
    data = make_batch(["ab", "abcd", ""], ["", "", ""], ["no_scorer"] * 3)  # a data source without a rule scorer
    rm_scores = torch.zeros(data.batch["responses"].shape)
    rm_scores[0, 2], rm_scores[1, 4], rm_scores[2, 0] = 0.25, -1.5, 2.0  # on each eos
    data.batch["rm_scores"] = rm_scores
    return data


def rm_plus_length(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return extra_info["rm_score"] + len(solution_str)


def rm_plus_length_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [rm_plus_length(s, r, g, e) for s, r, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]


@pytest.mark.parametrize(
    "manager",
    [
        lambda tok: NaiveRewardManager(tok, 0),
        lambda tok: NaiveRewardManager(tok, 0, compute_score=functools.partial(default_compute_score, x=1)),
        lambda tok: BatchRewardManager(tok, 0),
        lambda tok: BatchRewardManager(tok, 0, compute_score=functools.partial(default_batch_compute_score, x=1)),
        lambda tok: DAPORewardManager(tok, 0),
    ],
)
def test_without_a_custom_function_the_rm_scores_are_the_reward(char_tokenizer, make_batch, manager):
    data = _with_rm_scores(make_batch)
    result = manager(char_tokenizer)(data, return_dict=True)
    assert torch.equal(result["reward_tensor"], data.batch["rm_scores"])


@pytest.mark.parametrize(
    "manager",
    [
        lambda tok: NaiveRewardManager(tok, 0, compute_score=rm_plus_length),
        lambda tok: BatchRewardManager(tok, 0, compute_score=rm_plus_length_batch),
        lambda tok: DAPORewardManager(tok, 0, compute_score=rm_plus_length),
        # the scoring processes fork from the fork server, not from pytest: the function goes as a file handle
        lambda tok: PrimeRewardManager(
            tok, 0, compute_score=CustomRewardFunction(__file__, "rm_plus_length"), num_processes=2
        ),
    ],
)
def test_a_custom_function_decides_and_gets_the_rm_score(char_tokenizer, make_batch, manager):
    data = _with_rm_scores(make_batch)
    extra_before = [dict(e) for e in data.non_tensor_batch["extra_info"]]
    reward = manager(char_tokenizer)(data)
    expected = torch.zeros_like(reward)
    expected[0, 2], expected[1, 4], expected[2, 0] = 0.25 + 2, -1.5 + 4, 2.0 + 0
    assert torch.equal(reward, expected)
    assert [dict(e) for e in data.non_tensor_batch["extra_info"]] == extra_before  # the batch's dicts are not changed
