"""Tests of verl/utils/py_functional.py and verl/utils/metric: verl's dict helpers, DynamicEnum and Metric."""

import pickle

import numpy as np
import pytest
import torch

from verl.utils.metric import AggregationType, Metric, reduce_metrics
from verl.utils.py_functional import (
    DynamicEnum,
    append_to_dict,
    deep_equal,
    list_of_dict_to_dict_of_list,
    rename_dict,
    temp_env_var,
    timeout_limit,
    union_numpy_dict,
    union_two_dict,
)


def test_append_to_dict_extends_lists_prefixes_and_keeps_metric_aggregation():
    data = {}
    append_to_dict(data, {"loss": 1.0, "lens": [1, 2]}, prefix="actor/")
    append_to_dict(data, {"actor/loss": 2.0, "lens": [3]}, prefix="actor/")
    assert data == {"actor/loss": [1.0, 2.0], "actor/lens": [1, 2, 3]}
    summed = {}
    for value in (0.25, 0.5):
        append_to_dict(summed, {"vf_loss": Metric(AggregationType.SUM, value)})
    assert isinstance(summed["vf_loss"], Metric) and reduce_metrics(summed)["vf_loss"] == pytest.approx(0.75)


def test_reduce_metrics_by_key_name_and_by_metric_rule():
    out = reduce_metrics(
        {"loss": [1.0, 3.0], "len/max": [1, 7], "len/min": [4, 2], "m": Metric("max", [1.0, torch.tensor(5.0)])}
    )
    assert out == {"loss": 2.0, "len/max": 7, "len/min": 2, "m": 5.0}
    per_rank = [Metric("sum", [1.0, 2.0]), Metric("sum", [3.0, 4.0])]  # mean over ranks, then sum: 2 + 3
    assert Metric.aggregate_dp(per_rank) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric("sum").extend(Metric("mean", 1.0))
    with pytest.raises(ValueError, match="Only scalar tensors"):
        Metric("mean", torch.ones(2))


def test_union_helpers_reject_conflicts_with_assertion_errors():
    assert union_two_dict({"a": 1}, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(AssertionError, match="a in meta_dict1"):
        union_two_dict({"a": 1}, {"a": 2})
    nan = np.array([1.0, np.nan])
    assert union_numpy_dict({"x": nan}, {"x": nan.copy()})["x"] is not None
    with pytest.raises(AssertionError, match="`x` in tensor_dict1"):
        union_numpy_dict({"x": nan}, {"x": np.array([np.nan, 1.0])})
    cyclic = np.array([None], dtype=object)
    cyclic[0] = cyclic
    assert deep_equal(cyclic, cyclic) and not deep_equal(np.array([1]), np.array([1.0]))


def test_list_of_dict_and_rename():
    assert list_of_dict_to_dict_of_list([{"a": 1}, {"a": 2}]) == {"a": [1, 2]}
    assert list_of_dict_to_dict_of_list([]) == {}
    with pytest.raises(AssertionError, match="Key 'b'"):
        list_of_dict_to_dict_of_list([{"a": 1}, {"b": 2}])
    assert rename_dict({"x": 1, "p/y": 2}, prefix="p/") == {"p/x": 1, "p/y": 2}


class Color(DynamicEnum):
    _registry: dict = {}
    _next_value = 0


def test_dynamic_enum_registers_members_that_pickle_by_name():
    red = Color.register("red")
    assert Color.RED is red and red.value == 0 and "RED" in Color and Color["RED"] is red
    assert pickle.loads(pickle.dumps(red)) is red
    with pytest.raises(ValueError, match="RED already registered"):
        Color.register("Red")
    assert Color.remove("red") is red and Color.from_name("red") is None


def test_temp_env_var_and_timeout_limit(monkeypatch):
    monkeypatch.delenv("VERL_TEST_X", raising=False)
    with temp_env_var("VERL_TEST_X", "1"):
        import os

        assert os.environ["VERL_TEST_X"] == "1"
    assert "VERL_TEST_X" not in os.environ

    @timeout_limit(0.05)
    def slow():
        import time

        time.sleep(1)

    with pytest.raises(TimeoutError, match="slow timed out"):
        slow()
    assert timeout_limit(1)(lambda: 3)() == 3
