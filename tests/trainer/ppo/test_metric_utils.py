"""Metric helpers of the trainer against hand-computed values."""

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from verl.trainer.ppo.metric_utils import (
    process_greedy_validation_metrics,
    process_validation_metrics,
    reduce_metrics,
    select_generations,
    zero_std_fraction,
)


def test_zero_std_fraction_counts_flat_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    uids = ["a", "a", "b", "b", "c", "c"]
    assert zero_std_fraction(scores, uids) == pytest.approx(2 / 3)


def test_validation_metrics_per_source_and_mean_of_n():
    sources = ["rlla"] * 4 + ["gsm8k"] * 2
    scores = [1.0, 3.0, -1.0, 0.0, 1.0, 0.0]
    m = process_validation_metrics(sources, scores, n=2, extra={"format": [1, 1, 0, 0, "x", 1]})
    assert m["val-core/rlla/reward/mean@2"] == pytest.approx(0.75)
    assert m["val-aux/rlla/reward/std@2"] == pytest.approx((1.0 + 0.5) / 2)  # population std per prompt
    assert m["val-core/gsm8k/reward/mean@2"] == pytest.approx(0.5)
    assert m["val/reward/mean"] == pytest.approx(np.mean(scores))
    assert m["val-aux/rlla/format/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/gsm8k/format/mean@2"] == pytest.approx(1.0)  # the string is skipped
    assert "val-core/rlla/reward/maj@2/mean" not in m  # no votes given


def _exact_best_and_maj(values, votes, k):
    """Expectations over all n**k ordered draws with replacement (the bootstrap's limit), by enumeration."""
    best, maj, draws = 0.0, 0.0, list(itertools.product(range(len(values)), repeat=k))
    for draw in draws:
        best += max(values[i] for i in draw)
        counts = Counter(votes[i] for i in draw)
        top = max(counts.values())
        winner = next(votes[i] for i in draw if counts[votes[i]] == top)  # ties: the vote drawn first
        maj += values[next(i for i in draw if votes[i] == winner)]
    return best / len(draws), maj / len(draws)


def test_bootstrapped_best_and_majority_match_exact_expectations():
    values, votes = [1.0, 1.0, 0.0], ["7", "7", "8"]
    m = process_validation_metrics(["gsm8k"] * 3, values, n=3, uids=["p"] * 3, votes=votes, n_bootstrap=20000)
    for k in (2, 3):
        best, maj = _exact_best_and_maj(values, votes, k)
        section = "val-core" if k == 3 else "val-aux"
        assert m[f"{section}/gsm8k/reward/best@{k}/mean"] == pytest.approx(best, abs=0.01)
        assert m[f"{section}/gsm8k/reward/maj@{k}/mean"] == pytest.approx(maj, abs=0.01)
    assert _exact_best_and_maj(values, votes, 3)[1] == pytest.approx(20 / 27)  # the enumeration itself
    assert m["val-aux/gsm8k/reward/worst@3/mean"] == pytest.approx(8 / 27, abs=0.01)  # P(no 0 drawn) = (2/3)^3


def test_validation_groups_by_uid_and_prefers_acc_as_core():
    # two prompts interleaved: grouping must follow uids, not positions
    sources = ["math"] * 4
    scores = [1.0, 5.0, 1.0, 5.0]
    uids = ["a", "b", "a", "b"]
    extra = {"acc": [1, 0, 1, 0]}
    m = process_validation_metrics(sources, scores, n=2, extra=extra, uids=uids, votes=["x"] * 4)
    assert m["val-core/math/acc/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/math/reward/mean@2"] == pytest.approx(3.0)
    assert m["val-aux/math/reward/std@2"] == pytest.approx(0.0)  # each prompt's samples agree
    assert m["val-core/math/acc/best@2/mean"] == pytest.approx(0.5)
    assert m["val-core/math/acc/maj@2/mean"] == pytest.approx(0.5)


def test_greedy_validation_metrics_per_source_with_core_and_aux_names():
    sources = ["rlla", "rlla", "math"]
    m = process_greedy_validation_metrics(sources, [2.0, -1.0, 1.0], {"format": [1, 0, 1], "pred": ["a", "b", "c"]})
    assert m["val-core/rlla/reward/greedy"] == pytest.approx(0.5)
    assert m["val-core/math/reward/greedy"] == pytest.approx(1.0)
    assert m["val-aux/rlla/format/greedy"] == pytest.approx(0.5)
    assert m["val/reward/greedy"] == pytest.approx(2.0 / 3)
    assert not any("pred" in key for key in m)
    with_acc = process_greedy_validation_metrics(["math"] * 2, [1.0, 0.0], {"acc": [1, 0]})
    assert with_acc["val-core/math/acc/greedy"] == 0.5 and with_acc["val-aux/math/reward/greedy"] == 0.5


def test_select_generations_takes_first_sample_of_first_prompts():
    rows = select_generations(
        ["p0", "p0", "p1", "p1", "p2", "p2"], ["a", "b", "c", "d", "e", "f"], [1, 2, 3, 4, 5, 6], 2, 2
    )
    assert rows == [{"input": "p0", "output": "a", "score": 1.0}, {"input": "p1", "output": "c", "score": 3.0}]


def test_reduce_metrics_sums_counters_and_averages_the_rest():
    out = reduce_metrics({"actor/pg_loss": [1.0, 3.0], "actor/nonfinite_steps": [1, 0, 1], "x": 2})
    assert out == {"actor/pg_loss": 2.0, "actor/nonfinite_steps": 2.0, "x": 2.0}
