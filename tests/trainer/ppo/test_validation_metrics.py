"""Validation metrics (verl/trainer/ppo/validation_metrics.py) against hand-computed values and exact expectations."""

import itertools
from collections import Counter
from functools import partial

import numpy as np
import pytest

from verl.trainer.ppo.validation_metrics import (
    bootstrap_metric,
    calc_maj_val,
    compute_validation_metrics,
    process_greedy_validation_metrics,
    process_validation_metrics,
    select_generations,
)


def test_validation_metrics_per_source_and_mean_of_n():
    sources = ["rlla"] * 4 + ["gsm8k"] * 2
    scores = [1.0, 3.0, -1.0, 0.0, 1.0, 0.0]
    m = compute_validation_metrics(sources, scores, n=2, extra={"format": [1, 1, 0, 0, "x", 1]})
    assert m["val-core/rlla/reward/mean@2"] == pytest.approx(0.75)
    assert m["val-aux/rlla/reward/std@2"] == pytest.approx((1.0 + 0.5) / 2)  # population std per prompt
    assert m["val-core/gsm8k/reward/mean@2"] == pytest.approx(0.5)
    assert m["val/reward/mean"] == pytest.approx(np.mean(scores))
    assert m["val-aux/rlla/format/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/gsm8k/format/mean@1"] == pytest.approx(1.0)  # the string is dropped: one value left
    assert "val-core/rlla/reward/maj@2/mean" not in m  # no votes given
    assert "val-core/rlla/reward/best@2/std" in m  # verl: every best@n/maj@n metric of the headline is core


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


def test_bootstrapped_best_and_majority_near_exact_expectations():
    values, votes = [1.0, 1.0, 0.0], ["7", "7", "8"]
    m = compute_validation_metrics(["gsm8k"] * 3, values, n=3, uids=["p"] * 3, votes=votes)
    for k in (2, 3):
        best, maj = _exact_best_and_maj(values, votes, k)
        section = "val-core" if k == 3 else "val-aux"
        assert m[f"{section}/gsm8k/reward/best@{k}/mean"] == pytest.approx(best, abs=0.05)  # 1000 draws
        assert m[f"{section}/gsm8k/reward/maj@{k}/mean"] == pytest.approx(maj, abs=0.05)
    assert _exact_best_and_maj(values, votes, 3)[1] == pytest.approx(20 / 27)  # the enumeration itself
    assert m["val-aux/gsm8k/reward/worst@3/mean"] == pytest.approx(8 / 27, abs=0.05)  # P(no 0 drawn) = (2/3)^3


def test_prompt_bootstrap_equals_bootstrap_metric_on_the_same_draws():
    values = [0.3, 1.0, 0.0, 0.7, 0.2]
    preds = ["a", "b", "a", "c", "b"]
    got = process_validation_metrics(["s"] * 5, ["u"] * 5, {"v": values, "pred": preds}, seed=3)["s"]["v"]
    for k in (2, 4, 5):
        (best, best_std), (worst, _) = bootstrap_metric(values, k, [np.max, np.min], seed=3)
        votes = [{"val": v, "pred": p} for v, p in zip(values, preds)]
        [(maj, maj_std)] = bootstrap_metric(votes, k, [partial(calc_maj_val, vote_key="pred", val_key="val")], seed=3)
        assert got[f"best@{k}/mean"] == pytest.approx(best) and got[f"best@{k}/std"] == pytest.approx(best_std)
        assert got[f"worst@{k}/mean"] == pytest.approx(worst)
        assert got[f"maj@{k}/mean"] == pytest.approx(maj) and got[f"maj@{k}/std"] == pytest.approx(maj_std)
    assert "pred" not in process_validation_metrics(["s"] * 5, ["u"] * 5, {"v": values, "pred": preds})["s"]


def test_bootstrap_metric_and_majority_value_by_hand():
    assert bootstrap_metric([2.0], 3, [np.sum, np.max], n_bootstrap=5) == [(6.0, 0.0), (2.0, 0.0)]
    state = np.random.get_state()[1].copy()
    bootstrap_metric([1, 2, 3], 2, [np.mean])
    assert np.array_equal(np.random.get_state()[1], state)  # the global numpy generator is left alone
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_metric([], 1, [np.mean])
    data = [{"p": "B", "v": 1}, {"p": "A", "v": 2}, {"p": "A", "v": 3}, {"p": "B", "v": 4}]
    assert calc_maj_val(data, vote_key="p", val_key="v") == 1  # tie: the vote met first, its first value
    assert calc_maj_val(data[1:], vote_key="p", val_key="v") == 2


def test_missing_sessions_count_as_failures_only_where_acc_is_reported():
    m = process_validation_metrics(
        ["math", "math", "chat"],
        ["p1", "p1", "c1"],
        {"reward": [0.4, 0.6, 1.0], "acc": [1.0, 0.0, None]},
        expected_acc_counts={("math", "p1"): 4, ("math", "p2"): 2, ("chat", "c1"): 3},
    )
    assert m["math"]["acc"]["mean@4"] == pytest.approx(0.25)  # p1: [1, 0, 0, 0]
    assert m["math"]["acc"]["mean@2"] == pytest.approx(0.0)  # p2 never ran: [0, 0]
    success_only = m["math"]["acc_success_only"]
    assert success_only["mean@2"] == pytest.approx(0.5) and success_only["std@2"] == pytest.approx(0.5)
    assert m["math"]["reward"]["mean@2"] == pytest.approx(0.5)
    assert set(m["chat"]) == {"reward"}


def test_validation_groups_by_uid_and_prefers_acc_as_core():
    # two prompts interleaved: grouping must follow uids, not positions
    sources = ["math"] * 4
    scores = [1.0, 5.0, 1.0, 5.0]
    uids = ["a", "b", "a", "b"]
    extra = {"acc": [1, 0, 1, 0]}
    m = compute_validation_metrics(sources, scores, n=2, extra=extra, uids=uids, votes=["x"] * 4)
    assert m["val-core/math/acc/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/math/reward/mean@2"] == pytest.approx(3.0)
    assert m["val-aux/math/reward/std@2"] == pytest.approx(0.0)  # each prompt's samples agree
    assert m["val-core/math/acc/best@2/mean"] == pytest.approx(0.5)
    assert m["val-core/math/acc/maj@2/mean"] == pytest.approx(0.5)
    assert "val-core/math/acc/std@2" not in m and "val-aux/math/acc/std@2" in m


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
