"""How per-micro-batch and per-rank metric values become one number per step (verl's `verl.utils.metric`).

Owns `AggregationType`, `Metric` (values collected under one aggregation rule) and `reduce_metrics`. A plain
list is reduced by its key's name (max / min / mean); a `Metric` by its own rule, e.g. SUM for a loss that
each micro-batch already normalised by the global token count. Layer 1: numpy and torch only.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Union

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]

NumericType = (int, float, torch.Tensor, np.ndarray, np.number)
Numeric = Union[int, float, torch.Tensor, np.ndarray]


class AggregationType(Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


def _aggregate(values: Any, aggregation: AggregationType) -> float:
    if aggregation is AggregationType.SUM:
        return np.sum(values)
    if aggregation is AggregationType.MIN:
        return np.min(values)
    if aggregation is AggregationType.MAX:
        return np.max(values)
    return np.mean(values)


class Metric:
    """Numeric values (ints, floats, one-element tensors) reduced by one `aggregation` rule.

    `Metric("sum", 1.0)`, `.append(2.0)`, `.aggregate()` -> 3.0. `aggregate_dp` reduces one Metric per
    data-parallel rank: SUM and MEAN average the ranks position by position first, MIN and MAX look at all values.
    """

    def __init__(self, aggregation: str | AggregationType, value: Numeric | list[Numeric] | None = None) -> None:
        self.aggregation = AggregationType(aggregation) if isinstance(aggregation, str) else aggregation
        if not isinstance(self.aggregation, AggregationType):
            raise ValueError(
                f"Unsupported aggregation type: {aggregation!r}; allowed: {[a.value for a in AggregationType]}"
            )
        self.values: list = []
        if value is not None:
            if isinstance(value, list):
                self.extend(value)
            else:
                self.append(value)

    def append(self, value: Numeric | Metric) -> None:
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Only scalar tensors can be converted to float, got shape {tuple(value.shape)}")
            value = value.detach().item()
        if not isinstance(value, NumericType):
            raise ValueError(f"Unsupported value type: {type(value).__name__}; allowed: int, float, scalar tensor")
        self.values.append(value)

    def extend(self, values: Metric | list[Numeric]) -> None:
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        return _aggregate(self.values, self.aggregation)

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> float:
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) != 1:
            raise ValueError(f"All Metric instances must have the same number of values for dp aggregation: {lengths}")
        values = np.array([m.values for m in metric_lists])  # (num_dp, num_grad_accumulation)
        aggregation = metric_lists[0].aggregation
        if aggregation in (AggregationType.SUM, AggregationType.MEAN):
            return _aggregate(np.mean(values, axis=0), aggregation)
        return _aggregate(values.flatten(), aggregation)

    @classmethod
    def from_dict(cls, data: dict[str, Numeric], aggregation: str | AggregationType) -> dict[str, Metric]:
        return {key: cls(value=value, aggregation=aggregation) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric with the same aggregation (what `append_to_dict` starts a new key with)."""
        return Metric(aggregation=self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value}, {self.values})"


def reduce_metrics(metrics: dict[str, Metric | list[Any]]) -> dict[str, Any]:
    """Reduce every value of `metrics` in place (and return it): a `Metric` by its aggregation, a list of
    Metrics (one per rank) by `Metric.aggregate_dp`, any other list by its key: np.max if "max" is in the
    key, np.min if "min" is, else np.mean.
    """
    for key, val in metrics.items():
        if isinstance(val, Metric):
            metrics[key] = val.aggregate()
        elif isinstance(val, list) and val and all(isinstance(v, Metric) for v in val):
            metrics[key] = Metric.aggregate_dp(val)
        elif "max" in key:
            metrics[key] = np.max(val)
        elif "min" in key:
            metrics[key] = np.min(val)
        else:
            metrics[key] = np.mean(val)
    return metrics
