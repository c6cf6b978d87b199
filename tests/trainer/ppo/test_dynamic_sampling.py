"""The DynamicSamplingScheduler's stopping rule, cap (continue / error), per-domain shortfalls and the order of the
batch it returns, on a scripted rollout whose groups pass or fail by construction."""

import itertools

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.dynamic_sampling import DynamicSamplingScheduler, concat_aligned
from verl.trainer.ppo.reward_processing import MaskConfig, sample_mask

N = 2  # samples per prompt


def prompts(pids, domain="all"):
    return DataProto.from_single_dict(
        {
            "pid": np.array(pids, dtype=object),
            "domain": np.array([domain] * len(pids), dtype=object),
            "input_ids": torch.zeros(len(pids), 3, dtype=torch.long),
        }
    )


class ScriptedRollout:
    """Repeats each prompt N times; prompt `pid` gets scores (1, 0) (a varied group: passes) when `pid` is in
    `passing`, else (1, 1) (an equal group: filtered). Adds one reward extra field only some calls have."""

    def __init__(self, passing):
        self.passing, self.calls = set(passing), []

    def __call__(self, batch):
        self.calls.append(list(batch.non_tensor_batch["pid"]))
        batch = batch.repeat(N, interleave=True)
        pids = list(batch.non_tensor_batch["pid"])
        batch.non_tensor_batch["uid"] = np.array([f"u{p}" for p in pids], dtype=object)
        scores = [(1.0 if i % 2 == 0 or p not in self.passing else 0.0) for i, p in enumerate(pids)]
        token_scores = torch.zeros(len(pids), 4)
        token_scores[:, 1] = torch.tensor(scores)
        batch.batch["token_level_scores"] = token_scores
        batch.batch["response_mask"] = torch.tensor([[1, 1, 0, 0]] * len(pids))
        if len(self.calls) % 2 == 0:
            batch.non_tensor_batch["format"] = np.array([0.5] * len(pids), dtype=object)
        return batch


def judge(batch):
    return sample_mask(batch, MaskConfig(filter_groups=True), [1.0] * len(batch))["group"]


def drawer(batches):
    it = iter(batches)
    asked = []

    def draw(shortfall):
        asked.append(dict(shortfall))
        return next(it)

    return draw, asked


def test_generates_until_the_target_and_keeps_the_first_passing_groups_in_order():
    rollout = ScriptedRollout(passing={0, 2, 5, 8, 9, 10})
    draw, asked = drawer([prompts([4, 5, 6, 7]), prompts([8, 9, 10, 11])])
    scheduler = DynamicSamplingScheduler({"all": 4}, max_num_gen_batches=0)
    batch, flags, metrics = scheduler.collect(prompts([0, 1, 2, 3]), draw, rollout, judge)
    assert rollout.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert asked == [{"all": 2}, {"all": 1}]  # the shortfall after each round
    assert list(batch.non_tensor_batch["pid"]) == [0, 0, 2, 2, 5, 5, 8, 8]
    assert flags.all() and len(batch) == 4 * N
    assert list(batch.non_tensor_batch["format"]) == [None, None, None, None, 0.5, 0.5, None, None]  # aligned keys
    assert metrics == {
        "train/num_gen_batches": 3,
        "dynamic_sampling/filtered_frac": 0.5,  # 6 of 12 generated groups were equal
        "dynamic_sampling/hit_cap": 0.0,
        "dynamic_sampling/padded_groups": 0,
    }


def test_one_round_is_enough_when_every_group_passes():
    rollout = ScriptedRollout(passing=range(10))
    scheduler = DynamicSamplingScheduler({"all": 3})
    batch, _, metrics = scheduler.collect(prompts([0, 1, 2]), lambda s: pytest.fail("no draw needed"), rollout, judge)
    assert list(batch.non_tensor_batch["pid"]) == [0, 0, 1, 1, 2, 2] and metrics["train/num_gen_batches"] == 1


def test_cap_continues_with_what_passed_and_fills_with_filtered_groups(capsys):
    rollout = ScriptedRollout(passing={0, 2, 5})
    draw, _ = drawer([prompts([4, 5, 6, 7])])
    scheduler = DynamicSamplingScheduler({"all": 4}, max_num_gen_batches=2, on_cap="continue")
    batch, flags, metrics = scheduler.collect(prompts([0, 1, 2, 3]), draw, rollout, judge)
    assert list(batch.non_tensor_batch["pid"]) == [0, 0, 2, 2, 5, 5, 1, 1]  # the first filtered group fills in
    assert flags.tolist() == [True] * 6 + [False] * 2
    assert metrics["dynamic_sampling/hit_cap"] == 1.0 and metrics["dynamic_sampling/padded_groups"] == 1
    out = capsys.readouterr().out
    assert "max_num_gen_batches=2) left 1 of 4 groups short" in out and "continuing with the groups that passed" in out


def test_cap_can_fail_instead():
    rollout = ScriptedRollout(passing=set())
    draw, _ = drawer([prompts([4, 5])])
    scheduler = DynamicSamplingScheduler({"all": 2}, max_num_gen_batches=2, on_cap="error")
    with pytest.raises(RuntimeError, match="2 generation rounds .* left 2 of 2 groups short .*on_cap=error"):
        scheduler.collect(prompts([0, 1]), draw, rollout, judge)
    with pytest.raises(ValueError, match="on_cap='stop'; allowed"):
        DynamicSamplingScheduler({"all": 2}, on_cap="stop")


def test_only_short_domains_are_drawn_again_and_domains_keep_their_order():
    rollout = ScriptedRollout(passing={10, 11, 21})
    first = concat_aligned([prompts([20], domain="code"), prompts([10, 11], domain="math")])
    draw, asked = drawer([prompts([21], domain="code")])
    scheduler = DynamicSamplingScheduler({"math": 2, "code": 1}, bucket_key="domain")
    batch, _, metrics = scheduler.collect(first, draw, rollout, judge)
    assert asked == [{"code": 1}]  # math was full after round 1
    assert list(batch.non_tensor_batch["pid"]) == [10, 10, 11, 11, 21, 21]  # targets' order: math, then code
    assert metrics["train/num_gen_batches"] == 2


def test_unlimited_rounds_stop_as_soon_as_the_target_is_met():
    rollout = ScriptedRollout(passing={7})
    counter = itertools.count(1)
    draw = lambda shortfall: prompts([next(counter)])  # noqa: E731
    batch, _, metrics = DynamicSamplingScheduler({"all": 1}).collect(prompts([0]), draw, rollout, judge)
    assert list(batch.non_tensor_batch["pid"]) == [7, 7] and metrics["train/num_gen_batches"] == 8


def test_gen_batch_size_sets_the_prompts_of_every_round():
    """verl's DAPO `data.gen_batch_size`: each round rolls out that many prompts, taken in order from the step's
    batch and as many drawn batches as needed; the kept groups beyond the target are not trained on."""
    rollout = ScriptedRollout(passing={1, 4, 5, 6})
    draw, asked = drawer([prompts([2, 3]), prompts([4, 5]), prompts([6, 7])])
    scheduler = DynamicSamplingScheduler({"all": 2}, gen_batch_size=3)
    batch, _, metrics = scheduler.collect(prompts([0, 1]), draw, rollout, judge)
    assert rollout.calls == [[0, 1, 2], [3, 4, 5]]  # 3 prompts a round, whatever the drawn batches' size
    assert asked == [{"all": 2}, {"all": 1}]
    assert list(batch.non_tensor_batch["pid"]) == [1, 1, 4, 4] and metrics["train/num_gen_batches"] == 2
    small = DynamicSamplingScheduler({"all": 1}, gen_batch_size=1)  # a round smaller than the step's batch
    rollout = ScriptedRollout(passing={8})
    batch, _, metrics = small.collect(prompts([7, 8]), lambda s: pytest.fail("no draw needed"), rollout, judge)
    assert rollout.calls == [[7], [8]] and list(batch.non_tensor_batch["pid"]) == [8, 8]
    with pytest.raises(ValueError, match="data.gen_batch_size=4 must be >= 1, and is not implemented with data.domains"):
        DynamicSamplingScheduler({"math": 2}, bucket_key="domain", gen_batch_size=4)
    with pytest.raises(ValueError, match="data.gen_batch_size=0 must be >= 1"):
        DynamicSamplingScheduler({"all": 2}, gen_batch_size=0)
