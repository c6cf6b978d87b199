"""Reward post-processing (group / batch / running normalisation, clip, scale, weight) against hand-computed values,
and the sample mask strategies (overlong drop/zero, equal-reward groups, difficulty)."""

import math

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.reward_processing import (
    EPS,
    MaskConfig,
    RunningMoments,
    mask_metrics,
    normalize_scores,
    process_scores,
    sample_mask,
)


# ------------------------------------------------------------------------------------------------ normalisation
def test_group_normalisation_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 5.0])
    uids = ["a", "a", "a", "a", "b", "b", "c"]
    out = normalize_scores(scores, "group", index=uids)
    # group a: mean 0.75, unbiased std sqrt((3 * 0.25**2 + 0.75**2) / 3) = 0.5
    expected_a = [0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS), 0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS)]
    # group b: std 0, every value at the mean -> 0; group c: one sample -> mean 0, std 1 (verl's GRPO convention)
    torch.testing.assert_close(out, torch.tensor(expected_a + [0.0, 0.0, 5.0 / (1 + EPS)]))


def test_batch_normalisation_by_hand_and_kept_rows_only():
    out = normalize_scores(torch.tensor([1.0, 2.0, 3.0, 6.0]), "batch")
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # mean 3
    torch.testing.assert_close(out, torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (std + EPS))
    # a dropped sample (keep False) does not move the statistics, but is normalised with them
    kept = normalize_scores(torch.tensor([1.0, 2.0, 3.0, 100.0]), "batch", keep=torch.tensor([1, 1, 1, 0]))
    torch.testing.assert_close(kept, torch.tensor([-1.0, 0.0, 1.0, 98.0]) / (1.0 + EPS))  # mean 2, std 1
    assert torch.equal(normalize_scores(torch.tensor([3.0, 4.0]), None), torch.tensor([3.0, 4.0]))


def test_running_normalisation_across_steps_matches_all_values_seen():
    moments = RunningMoments()
    first = normalize_scores(torch.tensor([1.0, 3.0]), "running", running=moments)
    torch.testing.assert_close(first, torch.tensor([-1.0, 1.0]) / (math.sqrt(2.0) + EPS))  # mean 2, var 2
    second = normalize_scores(torch.tensor([5.0, 7.0, 9.0]), "running", running=moments)
    seen = np.array([1.0, 3.0, 5.0, 7.0, 9.0])  # mean 5, unbiased var 10
    assert moments.count == 5 and moments.mean == pytest.approx(5.0) and moments.std == pytest.approx(math.sqrt(10))
    expected = (np.array([5.0, 7.0, 9.0]) - seen.mean()) / (seen.std(ddof=1) + EPS)
    torch.testing.assert_close(second, torch.tensor(expected, dtype=torch.float32))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.count, restored.mean, restored.std) == (moments.count, moments.mean, moments.std)


def test_clip_scale_and_weight_apply_after_normalising():
    scores = torch.tensor([0.0, 0.0, 0.0, 10.0])  # batch: mean 2.5, std 5 -> [-0.5, -0.5, -0.5, 1.5]
    out, metrics = process_scores(scores, norm="batch", clip=1.0, scale=3.0, weight=0.5)
    torch.testing.assert_close(out, torch.tensor([-0.5, -0.5, -0.5, 1.0]) * 1.5, atol=1e-5, rtol=0)
    assert metrics == {"critic/reward_clip_frac": 0.25}
    plain, none = process_scores(torch.tensor([2.0, -4.0]), scale=0.5, weight=2.0)
    assert plain.tolist() == [2.0, -4.0] and none == {}
    with pytest.raises(ValueError, match="reward_norm='zscore'; allowed"):
        normalize_scores(scores, "zscore")


# ------------------------------------------------------------------------------------------------ the mask step
def _batch(scores, lengths, response_length=4, uids=("g1", "g1", "g2", "g2", "g3", "g3"), **non_tensor):
    bs = len(scores)
    mask = torch.zeros(bs, response_length, dtype=torch.long)
    token_scores = torch.zeros(bs, response_length)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        token_scores[row, length - 1] = score
    data = {"response_mask": mask, "token_level_scores": token_scores, "uid": np.array(uids, dtype=object)}
    data.update({k: np.array(v, dtype=object) for k, v in non_tensor.items()})
    return DataProto.from_single_dict(data)


SCORES, LENGTHS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [4, 2, 1, 3, 2, 4]  # rows 0 and 5 are truncated (length 4)


def test_each_mask_strategy_and_metrics():
    cfg = MaskConfig(overlong="drop", filter_groups=True, difficulty_mask=True, difficulty_low=0.2, difficulty_high=0.8)
    masks = sample_mask(_batch(SCORES, LENGTHS), cfg, [1.0] * 6)
    assert masks["max_len"].tolist() == [False, True, True, True, True, False]
    assert masks["zero_std"].tolist() == [True, True, False, False, False, False]  # g2 all 1, g3 all 0
    assert masks["difficulty"].tolist() == [True, True, False, False, False, False]  # pass rates 0.5, 1.0, 0.0
    assert masks["final"].tolist() == [False, True, False, False, False, False]
    metrics = mask_metrics(masks)
    assert metrics == {
        "actor/max_len_mask_ratio": pytest.approx(4 / 6),
        "actor/zero_std_mask_ratio": pytest.approx(2 / 6),
        "actor/difficulty_mask_ratio": pytest.approx(2 / 6),
        "actor/final_mask_ratio": pytest.approx(1 / 6),
        "actor/samples_used": 1.0,
        "actor/samples_total": 6.0,
    }
    assert mask_metrics(masks, rows=np.array([0, 1]), prefix="math/")["math/actor/final_mask_ratio"] == 0.5


def test_overlong_zero_scores_truncated_responses_zero_before_the_group_filter():
    batch = _batch(SCORES, LENGTHS)
    masks = sample_mask(batch, MaskConfig(overlong="zero", filter_groups=True), [1.0] * 6)
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert masks["max_len"].all()  # zeroed, not dropped
    assert not masks["final"].any()  # g1 became 0, 0: an equal group now


def test_difficulty_uses_each_rows_threshold_and_filter_metric_can_be_an_extra_field():
    batch = _batch([0.5, 0.2, 3.0, 1.0, 0.0, 0.0], [1, 1, 1, 1, 1, 1], acc=[1, 0, 1, 1, 0, 0])
    thresholds = [0.5, 0.5, 2.0, 2.0, 1.0, 1.0]  # g1: 1 of 2 pass, g2: 1 of 2, g3: 0 of 2
    masks = sample_mask(batch, MaskConfig(difficulty_mask=True, difficulty_low=0.5, difficulty_high=0.5), thresholds)
    assert masks["final"].tolist() == [True, True, True, True, False, False]
    masks = sample_mask(batch, MaskConfig(filter_groups=True, metric="acc"), thresholds)
    assert masks["final"].tolist() == [True, True, False, False, False, False]  # g2's acc is 1, 1
    with pytest.raises(ValueError, match="filter_groups.metric='pred' is not in the batch"):
        sample_mask(batch, MaskConfig(filter_groups=True, metric="pred"), thresholds)


def test_mask_config_from_algorithm_section():
    assert not MaskConfig.from_config({}).active
    cfg = MaskConfig.from_config({"overlong_mask": "drop", "filter_groups": {"enable": True, "metric": "acc"}})
    assert cfg.active and cfg.overlong == "drop" and cfg.filter_groups and cfg.metric == "acc"
    with pytest.raises(ValueError, match="overlong_mask='cut'; allowed: null, drop, zero"):
        MaskConfig.from_config({"overlong_mask": "cut"})
    with pytest.raises(ValueError, match="0 <= low <= high <= 1"):
        MaskConfig.from_config({"difficulty_low_threshold": 0.9, "difficulty_high_threshold": 0.1})
    with pytest.raises(ValueError, match="seq_final_reward is not available here"):
        MaskConfig.from_config({"filter_groups": {"enable": True, "metric": "seq_final_reward"}})
