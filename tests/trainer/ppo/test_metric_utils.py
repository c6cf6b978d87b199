"""Metric helpers of the trainer against hand-computed values."""

import numpy as np
import pytest
import torch

from verl.trainer.ppo.metric_utils import process_validation_metrics, reduce_metrics, zero_std_fraction


def test_zero_std_fraction_counts_flat_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    uids = ["a", "a", "b", "b", "c", "c"]
    assert zero_std_fraction(scores, uids) == pytest.approx(2 / 3)


def test_validation_metrics_per_source_and_best_of_n():
    sources = ["rlla"] * 4 + ["gsm8k"] * 2
    scores = [1.0, 3.0, -1.0, 0.0, 1.0, 0.0]
    m = process_validation_metrics(sources, scores, n=2, extra={"format": [1, 1, 0, 0, "x", 1]})
    assert m["val-core/rlla/reward/mean@2"] == pytest.approx(0.75)
    assert m["val-aux/rlla/reward/best@2"] == pytest.approx((3.0 + 0.0) / 2)
    assert m["val-core/gsm8k/reward/mean@2"] == pytest.approx(0.5)
    assert m["val/reward/mean"] == pytest.approx(np.mean(scores))
    assert m["val-aux/rlla/format/mean@2"] == pytest.approx(0.5)
    assert m["val-aux/gsm8k/format/mean@2"] == pytest.approx(1.0)  # the string is skipped


def test_reduce_metrics_sums_counters_and_averages_the_rest():
    out = reduce_metrics({"actor/pg_loss": [1.0, 3.0], "actor/nonfinite_steps": [1, 0, 1], "x": 2})
    assert out == {"actor/pg_loss": 2.0, "actor/nonfinite_steps": 2.0, "x": 2.0}
