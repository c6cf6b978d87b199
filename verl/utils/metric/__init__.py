"""Metric aggregation with verl's API: `Metric`, `AggregationType`, `reduce_metrics` (see `utils.py`)."""

from verl.utils.metric.utils import AggregationType, Metric, reduce_metrics

__all__ = ["AggregationType", "Metric", "reduce_metrics"]
