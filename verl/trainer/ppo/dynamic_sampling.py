"""Dynamic sampling (DAPO's `filter_groups`, ROLL's DynamicSamplingScheduler): keep generating until the batch holds
`train_batch_size` prompt groups that pass the sample mask.

Owns `DynamicSamplingScheduler` (per bucket, a domain or the whole batch: round 1 rolls out the step's prompts,
later rounds draw more for short buckets, or `gen_batch_size` prompts a round; passing groups are kept, others
spare; at `max_num_gen_batches` it fills with spare groups (`on_cap="continue"`) or raises) and `concat_aligned`.
Metrics: `train/num_gen_batches`, `dynamic_sampling/{filtered_frac,hit_cap,padded_groups}`.
Layer 8 helper: drives the callables it is given; no Ray, no models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from verl.protocol import DataProto
from verl.trainer.ppo.reward_processing import group_rows

__all__ = ["ON_CAP_CHOICES", "DynamicSamplingScheduler", "concat_aligned"]

ON_CAP_CHOICES = ("continue", "error")
ALL = "all"


def concat_aligned(parts: list[DataProto]) -> DataProto:
    """`DataProto.concat` of parts whose non-tensor keys may differ (e.g. reward extra fields of other reward
    types): a key missing from a part is filled with None there."""
    keys: dict[str, None] = {}
    for part in parts:
        keys.update(dict.fromkeys(part.non_tensor_batch))
    for part in parts:
        for key in keys:
            if key not in part.non_tensor_batch:
                part.non_tensor_batch[key] = np.full(len(part), None, dtype=object)
    return DataProto.concat(parts)


class DynamicSamplingScheduler:
    """Collect `targets[bucket]` passing groups per bucket over several rollout rounds (see the module docstring).

    Args:
        targets: groups wanted per bucket, in the order the final batch lists them (`{"all": train_batch_size}`
            without domains).
        max_num_gen_batches: cap on rounds per step; 0 = unlimited.
        on_cap: "continue" (log and train on what passed) or "error".
        bucket_key: non-tensor column naming each row's bucket (None: one bucket, `"all"`).
        gen_batch_size: prompts per round (None: a round is one batch of prompts, the step's or one drawn).
    """

    def __init__(
        self,
        targets: Mapping[str, int],
        max_num_gen_batches: int = 0,
        on_cap: str = "continue",
        bucket_key: str | None = None,
        gen_batch_size: int | None = None,
    ) -> None:
        if on_cap not in ON_CAP_CHOICES:
            raise ValueError(f"algorithm.filter_groups.on_cap={on_cap!r}; allowed: {ON_CAP_CHOICES}")
        if int(max_num_gen_batches) < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches} must be >= 0")
        if gen_batch_size is not None and (int(gen_batch_size) < 1 or bucket_key is not None):
            raise ValueError(
                f"data.gen_batch_size={gen_batch_size} must be >= 1, and is not implemented with data.domains "
                "(each round draws the quotas of the short domains); use null"
            )
        self.gen_batch_size = None if gen_batch_size is None else int(gen_batch_size)
        self.targets = {name: int(count) for name, count in targets.items()}
        self.max_rounds = int(max_num_gen_batches)
        self.on_cap = on_cap
        self.bucket_key = bucket_key

    def _bucket(self, batch: DataProto, row: int) -> str:
        return ALL if self.bucket_key is None else str(batch.non_tensor_batch[self.bucket_key][row])

    def _round(
        self, pending: list[DataProto], draw: Callable[[dict[str, int]], DataProto], shortfall: dict[str, int]
    ) -> tuple[DataProto, list[DataProto]]:
        """This round's prompts and those left for the next round: the pending batch (else `draw(shortfall)`), or
        with `gen_batch_size` the next that many of the pending prompts and of new draws."""
        size = self.gen_batch_size
        if size is None:
            return (pending[0] if pending else draw(shortfall)), []
        while sum(len(p) for p in pending) < size:
            pending.append(draw(shortfall))
        merged = DataProto.concat(pending) if len(pending) > 1 else pending[0]
        return merged[:size], [merged[size:]] if len(merged) > size else []

    def collect(
        self,
        prompts: DataProto,
        draw: Callable[[dict[str, int]], DataProto],
        rollout: Callable[[DataProto], DataProto],
        judge: Callable[[DataProto], np.ndarray],
    ) -> tuple[DataProto, np.ndarray, dict[str, float]]:
        """Run rounds until the targets are met or the cap is hit.

        `rollout(prompts)` returns the scored batch (groups by uid); `judge(scored)` returns (bs,) bools, True for
        the rows of passing groups; `draw(shortfall)` returns the prompts of the next round.
        Returns (batch, group_ok (bs,) bool: False for spare groups used as filler, metrics).
        """
        kept: dict[str, list[DataProto]] = {name: [] for name in self.targets}
        spare: dict[str, list[DataProto]] = {name: [] for name in self.targets}
        rounds = generated = filtered = 0
        pending, shortfall = [prompts], dict(self.targets)
        while True:
            rounds += 1
            round_prompts, pending = self._round(pending, draw, shortfall)
            scored = rollout(round_prompts)
            ok = np.asarray(judge(scored), dtype=bool)
            for rows in group_rows(scored.non_tensor_batch["uid"]).values():
                bucket = self._bucket(scored, rows[0])
                if bucket not in kept:
                    raise ValueError(f"a rolled-out group belongs to bucket {bucket!r}, not one of {list(kept)}")
                generated += 1
                filtered += int(not ok[rows[0]])
                (kept if ok[rows[0]] else spare)[bucket].append(scored[np.array(rows)])
            shortfall = {name: n - len(kept[name]) for name, n in self.targets.items() if len(kept[name]) < n}
            if not shortfall:
                break
            if self.max_rounds and rounds >= self.max_rounds:
                message = (
                    f"dynamic sampling: {rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches="
                    f"{self.max_rounds}) left {sum(shortfall.values())} of {sum(self.targets.values())} groups "
                    f"short ({shortfall}); the prompts may be too easy or too hard"
                )
                if self.on_cap == "error":
                    raise RuntimeError(message + " (algorithm.filter_groups.on_cap=error)")
                print(message + "; continuing with the groups that passed", flush=True)
                break
        parts, flags, padded = [], [], 0
        for name, target in self.targets.items():
            chosen = kept[name][:target]
            filler = spare[name][: target - len(chosen)]
            if len(chosen) + len(filler) < target:
                raise RuntimeError(
                    f"dynamic sampling: bucket {name!r} got {len(chosen) + len(filler)} of {target} groups"
                )
            padded += len(filler)
            parts += chosen + filler
            flags += [np.ones(len(g), dtype=bool) for g in chosen] + [np.zeros(len(g), dtype=bool) for g in filler]
        metrics: dict[str, Any] = {
            "train/num_gen_batches": rounds,
            "dynamic_sampling/filtered_frac": filtered / max(generated, 1),
            "dynamic_sampling/hit_cap": float(padded > 0),
            "dynamic_sampling/padded_groups": padded,
        }
        return concat_aligned(parts), np.concatenate(flags), metrics
