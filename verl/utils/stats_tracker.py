"""Named statistics of a hand-written training loop (AReaL's `stats_tracker`): record under scopes, export aggregates.

`scope(name)` nests key prefixes; `scalar(**numbers)` exports the mean since the last export; `denominator(**masks)`
the count of true elements; `stat(denominator=name, **tensors)` `key/avg|min|max` over that mask;
`record_timing(name)` seconds under `timeperf/name`; `export(key=None, reduce_group=None, reset=True)` returns
{key: float} (over all ranks of a group). Values are running (sum, count, min, max). Module-level functions use
`DEFAULT_TRACKER`. Layer 1: torch only.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TRACKER", "StatsTracker", "denominator", "export", "record_timing", "scalar", "scope", "stat"]

_EMPTY = (0.0, 0.0, math.inf, -math.inf)  # sum, count, min, max


class StatsTracker:
    """Running aggregates by key; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes: list[str] = []
        self._values: dict[str, tuple[str, list[float]]] = {}  # key -> (kind: mean | sum | avg_min_max, aggregate)
        self._masks: dict[str, torch.Tensor] = {}  # denominator key -> its last mask

    def _key(self, name: str) -> str:
        return "/".join([*self._scopes, _name(name)])

    def _add(self, key: str, kind: str, total: float, count: float, low: float, high: float) -> None:
        with self._lock:
            old_kind, acc = self._values.setdefault(key, (kind, list(_EMPTY)))
            if old_kind != kind:
                raise ValueError(f"stats_tracker: {key!r} was recorded as a {old_kind}, now as a {kind}")
            acc[0], acc[1], acc[2], acc[3] = acc[0] + total, acc[1] + count, min(acc[2], low), max(acc[3], high)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scopes.append(_name(name))
        try:
            yield
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self._add(f"timeperf/{_name(name)}", "mean", seconds, 1.0, seconds, seconds)

    def scalar(self, **values: Any) -> None:
        for name, value in values.items():
            if isinstance(value, str | bytes) or (isinstance(value, torch.Tensor) and value.numel() != 1):
                raise TypeError(f"stats_tracker.scalar: {name}={value!r} is not a number")
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"stats_tracker.scalar: {name}={value!r} is not a number") from None
            self._add(self._key(name), "mean", number, 1.0, number, number)

    def denominator(self, **masks: torch.Tensor) -> None:
        for name, mask in masks.items():
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"stats_tracker.denominator: {name} must be a bool tensor, got {_describe(mask)}")
            key = self._key(name)
            count = float(mask.sum())
            self._add(key, "sum", count, 1.0, count, count)
            self._masks[key] = mask.detach()

    def stat(self, denominator: str, **values: torch.Tensor) -> None:
        den = self._key(denominator)
        if den not in self._masks:
            raise KeyError(f"stats_tracker.stat: no denominator {den!r} recorded; call denominator({denominator}=mask)")
        mask = self._masks[den]
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != mask.shape:
                raise TypeError(
                    f"stats_tracker.stat: {name} must be a float tensor of the shape of {den!r} "
                    f"{tuple(mask.shape)}, got {_describe(value)}"
                )
            picked = value.detach()[mask.to(value.device)].double()
            aggregate = (picked.sum(), picked.numel(), picked.min(), picked.max()) if picked.numel() else _EMPTY
            self._add(self._key(name), "avg_min_max", *map(float, aggregate))

    def export(self, key: str | None = None, reduce_group: Any = None, reset: bool = True) -> dict[str, float]:
        with self._lock:
            prefix = None if key is None else self._key(key)
            wanted = [k for k in self._values if prefix is None or k == prefix or k.startswith(prefix + "/")]
            kinds = {k: self._values[k][0] for k in wanted}
            if reduce_group is not None:
                kinds = _kinds_on_all_ranks(kinds, reduce_group)
            names = sorted(kinds)
            rows = [self._values[k][1] if k in self._values else _EMPTY for k in names]
            table = torch.tensor(rows, dtype=torch.float64).reshape(len(names), 4)
            if reduce_group is not None and names:
                table = _reduce(table, reduce_group)
            if reset:
                for name in names:
                    self._values.pop(name, None)
                    self._masks.pop(name, None)
        out: dict[str, float] = {}
        for name, (total, count, low, high) in zip(names, table.tolist()):
            if kinds[name] == "sum":
                out[name] = total
            elif kinds[name] == "mean" and count:
                out[name] = total / count
            elif count:
                out.update({f"{name}/avg": total / count, f"{name}/min": low, f"{name}/max": high})
        return out


def _name(name: Any) -> str:
    text = str(name).strip("/")
    if not text:
        raise ValueError(f"stats_tracker: a key or scope name must be a non-empty string, got {name!r}")
    return text


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _kinds_on_all_ranks(kinds: dict[str, str], group: Any) -> dict[str, str]:
    """The union of every rank's {key: kind} (the same on all ranks)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, kinds, group=group)
    return {k: v for rank_kinds in gathered for k, v in rank_kinds.items()}


def _reduce(table: torch.Tensor, group: Any) -> torch.Tensor:
    """Sums and counts added over the ranks, min of mins, max of maxes (on the GPU for an nccl group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    sums, lows, highs = (part.contiguous().to(device) for part in (table[:, :2], table[:, 2], table[:, 3]))
    dist.all_reduce(sums, group=group)
    dist.all_reduce(lows, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([sums, lows[:, None], highs[:, None]], dim=1).cpu()


DEFAULT_TRACKER = StatsTracker()
scope = DEFAULT_TRACKER.scope
record_timing = DEFAULT_TRACKER.record_timing
scalar = DEFAULT_TRACKER.scalar
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
export = DEFAULT_TRACKER.export
