"""One-step-off asynchronous rollout (`trainer.rollout_mode=async`): later steps' batches are generated on a
separate rollout worker group while the actor trains on this step's batch, at most `max_staleness` policy
versions behind.

Owns `AsyncRollout` (the scheduler the trainer calls at the start and end of each step), `resolve_async_config`
(checks of the async keys and the settings they imply), `actor_role` and `rollout_pool_spec` (the worker layout).
Layer 8 (docs/architecture.md#layers): drives worker groups through the trainer (its phases 1-4, `_rollout_score_and_filter`) and
Ray's object store; no algorithm maths.

How a run goes (s = async_training.max_staleness):
- Two groups of processes: the actor (role `actor`, or `actor_ref` with a reference policy, plus the critic) and
  a standalone rollout group (role `rollout`, `async_training.rollout_n_gpus_per_node` processes of its own).
- Policy version v = number of finished training steps. After step k the actor's weights go to the rollout group
  through Ray's object store one bucket at a time (`export_actor_weight_bucket` -> `ray.put` ->
  `load_rollout_weight_bucket`, `verl.workers.weight_stream`) as version k, and every response token generated
  from then on carries `rollout_versions` = k.
- s >= 1: the batch of step j is generated during step j - s by a background thread of the driver running the
  trainer's phases 1-4 on the rollout group, while the main thread runs step j - s's log-prob and update phases
  on the actor group; the first s batches are generated up front. A batch is therefore s versions old when it is
  trained (fewer for the first s steps). s = 0: each batch is generated at the start of its own step with fresh
  weights (synchronous, but on the separate group).
- Before a batch is trained its staleness (step - 1 - rollout_versions over response tokens) is measured; a
  batch over the bound (the schedule never makes one) is generated again with fresh weights. Metrics:
  `rollout/staleness/mean|max`; `timing_s/gen` and `timing_s/reward` of the batch trained; `timing_s/gen_wait`,
  the part of the background generation the step waited for (0 = fully hidden); `timing_s/weight_sync`.
- The loss sees the behaviour policy through `rollout_log_probs`: `resolve_async_config` turns on AReaL's
  decoupled PPO (`actor.use_decoupled_loss`) and `rollout.calculate_log_probs` unless TIS is chosen instead.

Determinism: step j's batch is generated with the seed the trainer derives from step j - s (the background
thread runs while `global_steps` is j - s; the up-front batches are generated with `global_steps` set to j - s),
so two runs with the same config generate the same tokens. Checkpoints hold no queued batches: a resumed run
generates them again from the restored weights, so its first s batches are fresher than the uninterrupted run's
(data order and seeds are the same; weights after a resume are not bit-identical in async mode).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
from omegaconf import DictConfig, open_dict

from verl.protocol import DataProto
from verl.trainer.ppo.metric_utils import marked_timer

__all__ = ["ROLLOUT_MODES", "AsyncRollout", "actor_role", "is_async", "resolve_async_config", "rollout_pool_spec"]

ROLLOUT_MODES = ("sync", "async")


# ------------------------------------------------------------------------------------------------- config
def is_async(config: DictConfig) -> bool:
    return config.trainer.get("rollout_mode", "sync") == "async"


def _int_at_least(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an int >= {minimum}, got {value!r}")
    return value


def resolve_async_config(config: DictConfig) -> None:
    """Check `trainer.rollout_mode`, `async_training.*` and the behaviour-policy correction keys, and fill in
    what they imply (in place): `actor.use_decoupled_loss` null becomes true exactly in async mode without TIS
    nor verl's rollout correction (`algorithm.rollout_correction.rollout_is` or `bypass_mode`),
    and a decoupled or TIS loss in async mode turns on `rollout.calculate_log_probs` (the behaviour log-probs)."""
    mode = config.trainer.get("rollout_mode", "sync")
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"trainer.rollout_mode={mode!r}; allowed: {', '.join(ROLLOUT_MODES)}")
    async_cfg = config.get("async_training") or {}
    _int_at_least(async_cfg.get("max_staleness", 1), "async_training.max_staleness", 0)
    if mode == "async":
        for key in ("rollout_nnodes", "rollout_n_gpus_per_node"):
            _int_at_least(async_cfg.get(key, 1), f"async_training.{key}", 1)
        _check_async_compatible(config)
    actor = config.actor_rollout_ref.actor
    tis_cap = actor.get("tis_imp_ratio_cap", -1)
    tis_on = tis_cap is not None and tis_cap > 0
    corr = (config.get("algorithm") or {}).get("rollout_correction") or {}  # verl's correction replaces ours
    corr_on = corr.get("rollout_is") is not None or bool(corr.get("bypass_mode", False))
    decoupled = actor.get("use_decoupled_loss", None)
    if decoupled is None:
        decoupled = mode == "async" and not tis_on and not corr_on
    if not isinstance(decoupled, bool):
        raise ValueError(f"actor_rollout_ref.actor.use_decoupled_loss={decoupled!r}; allowed: true, false, null")
    if decoupled and tis_on:
        raise ValueError(
            f"actor_rollout_ref.actor.use_decoupled_loss=true and tis_imp_ratio_cap={tis_cap}: both correct for the "
            f"behaviour policy; set only one"
        )
    cap = actor.get("behav_imp_weight_cap", None)
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 1):
        raise ValueError(f"actor_rollout_ref.actor.behav_imp_weight_cap={cap!r}; allowed: a number > 1, or null")
    if mode == "async" and not (decoupled or tis_on or corr_on):
        print(
            "warning: trainer.rollout_mode=async with use_decoupled_loss=false and no tis_imp_ratio_cap: the loss "
            "treats stale samples as on-policy"
        )
    with open_dict(config):
        actor.use_decoupled_loss = decoupled
        if decoupled or (mode == "async" and tis_on):
            config.actor_rollout_ref.rollout.calculate_log_probs = True


def _check_async_compatible(config: DictConfig) -> None:
    """Features that draw prompts while a step runs cannot be generated ahead: refuse them in async mode."""
    if ((config.get("algorithm") or {}).get("filter_groups") or {}).get("enable", False):
        raise ValueError(
            "trainer.rollout_mode=async does not support algorithm.filter_groups.enable=true (dynamic sampling draws "
            "more prompts during a step); use trainer.rollout_mode=sync or turn dynamic sampling off"
        )
    if (config.get("data") or {}).get("domains"):
        raise ValueError(
            "trainer.rollout_mode=async does not support data.domains (the per-domain sampler's saved position would "
            "include the batches generated ahead); use trainer.rollout_mode=sync"
        )


def actor_role(config: DictConfig, use_reference_policy: bool) -> str:
    """The actor group's role: with its own rollout engine in sync mode, without one in async mode."""
    if is_async(config):
        return "actor_ref" if use_reference_policy else "actor"
    return "actor_rollout_ref" if use_reference_policy else "actor_rollout"


def rollout_pool_spec(config: DictConfig) -> dict[str, list[int]]:
    """`{"rollout_pool": [processes per node] * nodes}` of the standalone rollout group; empty in sync mode."""
    if not is_async(config):
        return {}
    async_cfg = config.get("async_training") or {}
    per_node = _int_at_least(async_cfg.get("rollout_n_gpus_per_node", 1), "async_training.rollout_n_gpus_per_node", 1)
    nodes = _int_at_least(async_cfg.get("rollout_nnodes", 1), "async_training.rollout_nnodes", 1)
    return {"rollout_pool": [per_node] * nodes}


# ------------------------------------------------------------------------------------------------- scheduler
@dataclass
class _Slot:
    """One upcoming step's prompts and, once generated, its (batch, metrics, timing)."""

    prompts: DataProto
    future: Future | None = None
    result: tuple[DataProto, dict, dict] | None = None


class AsyncRollout:
    """Schedules generation on `trainer.rollout_wg` ahead of training on `trainer.actor_rollout_wg`.

    The trainer wraps its batch iterator with `lookahead` and brackets each step with `begin_step` (returns the
    generated, scored batch of this step's prompts and starts generating a later one in the background) and
    `end_step` (waits for that generation, then pushes the updated weights as the next policy version).
    `timeline` records when each step's training phases ran (`{"kind": "train", "step", "start", "end"}`) and when
    each background generation ran (`{"kind": "gen", "step": the step it is for, "start", "end"}`), in
    `time.perf_counter()` seconds.
    """

    def __init__(self, trainer: Any, max_staleness: int, total_steps: int):
        self.trainer = trainer
        self.max_staleness = _int_at_least(max_staleness, "async_training.max_staleness", 0)
        self.total_steps = int(total_steps)
        self.rollout_version: int | None = None  # the version the rollout group holds; None until the first push
        self.timeline: list[dict[str, float]] = []
        self._train_start = 0.0
        self._slots: deque[_Slot] = deque()  # prompts pulled ahead of the trainer's loop, in step order
        self._pending: _Slot | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-async-rollout")

    def lookahead(self, batches):
        """Yield the trainer's `(epoch, batch index, prompts)` items unchanged, keeping the prompts of the next
        `max_staleness` steps pulled (in `self._slots`) so they can be generated early. The trainer's
        `_data_position` (where a resume continues, set by its iterator at each item) is put back to the yielded
        item's own, since the iterator has run ahead of it."""
        items = iter(batches)
        buffered: deque = deque()
        while True:
            for item in itertools.islice(items, self.max_staleness + 1 - len(buffered)):
                buffered.append((item, getattr(self.trainer, "_data_position", None)))
                self._slots.append(_Slot(prompts=item[2]))
            if not buffered:
                return
            item, position = buffered.popleft()
            if position is not None:
                self.trainer._data_position = position
            yield item

    # ------------------------------------------------------------------ the two calls per step
    def begin_step(self, prompts: DataProto, step: int, timing: dict[str, float], metrics: dict) -> DataProto:
        """The generated and scored batch of `prompts` (step `step`), checked against the staleness bound; starts
        the background generation of step `step + max_staleness`. Adds generation timings and metrics."""
        if not self._slots or self._slots[0].prompts is not prompts:
            raise RuntimeError("async rollout: begin_step got prompts the lookahead did not yield next")
        if self.rollout_version is None:  # the first step of a run or of a resume: the actor's current weights
            with marked_timer("weight_sync", timing):
                self._push_weights(step - 1)
        for offset, slot in enumerate(itertools.islice(self._slots, max(self.max_staleness, 1))):
            if slot.result is None and step + offset <= self.total_steps:  # up front, as if at step j - s
                slot.result = self._generate_now(slot.prompts, step + offset - self.max_staleness)
        batch, gen_metrics, gen_timing = self._slots.popleft().result
        staleness = self._staleness(batch, step)
        if staleness.max().item() > self.max_staleness:
            age = staleness.max().item()
            print(f"warning: async rollout: the batch of step {step} is {age} versions old (async_training."
                  f"max_staleness={self.max_staleness}); generating it again with fresh weights")  # fmt: skip
            batch, gen_metrics, gen_timing = self._generate_now(prompts, step - self.max_staleness)
            staleness = self._staleness(batch, step)
        batch.meta_info["global_steps"] = step
        for key, value in gen_timing.items():
            timing[key] = timing.get(key, 0.0) + value
        metrics.update(gen_metrics)
        metrics["rollout/staleness/mean"] = staleness.float().mean().item()
        metrics["rollout/staleness/max"] = staleness.max().item()
        self._start_background(step)
        self._train_start = time.perf_counter()
        return batch

    def end_step(self, step: int, timing: dict[str, float]) -> None:
        """After step `step`'s update: wait for the background generation, then push the weights as version
        `step` (in this order, so that generation used the previous version)."""
        self.timeline.append({"kind": "train", "step": step, "start": self._train_start, "end": time.perf_counter()})
        if self._pending is not None:
            with marked_timer("gen_wait", timing):
                self._pending.result = self._pending.future.result()
            self._pending.future, self._pending = None, None
        with marked_timer("weight_sync", timing):
            self._push_weights(step)

    # ------------------------------------------------------------------ helpers
    def _produce(self, prompts: DataProto) -> tuple[DataProto, dict, dict]:
        """The trainer's phases 1-4 (and its sample mask / reward processing) on `prompts`; returns (batch, metrics,
        timing)."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        batch = self.trainer._rollout_score_and_filter(prompts, timing, metrics)
        return batch, metrics, timing

    def _generate_now(self, prompts: DataProto, seed_step: int) -> tuple[DataProto, dict, dict]:
        """Generate in the calling (main) thread with the trainer's step counter set to `seed_step`, which the
        generation seed derives from; nothing else runs meanwhile, so setting it is safe."""
        saved = self.trainer.global_steps
        self.trainer.global_steps = seed_step
        try:
            return self._produce(prompts)
        finally:
            self.trainer.global_steps = saved

    def _start_background(self, step: int) -> None:
        """Generate the first not yet generated slot (step `step + s` in steady state) in the background thread,
        unless that step lies beyond the end of training."""
        for offset, slot in enumerate(self._slots, start=1):
            if slot.result is None and slot.future is None:
                if step + offset <= self.total_steps:
                    slot.future = self._executor.submit(self._produce_in_background, slot.prompts, step + offset)
                    self._pending = slot
                return

    def _produce_in_background(self, prompts: DataProto, for_step: int) -> tuple[DataProto, dict, dict]:
        start = time.perf_counter()
        out = self._produce(prompts)
        self.timeline.append({"kind": "gen", "step": for_step, "start": start, "end": time.perf_counter()})
        return out

    def _push_weights(self, version: int) -> None:
        """The actor's weights into every rollout rank as policy `version`, one bucket at a time through Ray's object
        store (`verl.workers.weight_stream`): no process holds more than one bucket of them."""
        actor, rollout = self.trainer.actor_rollout_wg, self.trainer.rollout_wg
        rollout.begin_rollout_weight_load()
        try:
            while bucket := actor.export_actor_weight_bucket()[0]:
                rollout.load_rollout_weight_bucket(ray.put(bucket))
                del bucket
        finally:
            rollout.finish_rollout_weight_load(version)  # raises what the engine raised while loading
        self.rollout_version = version

    def _staleness(self, batch: DataProto, step: int) -> torch.Tensor:
        """(step - 1) - version of every generated token (the actor is at version step - 1 while it trains)."""
        if "rollout_versions" not in batch.batch.keys():
            raise RuntimeError(
                "async rollout: the generated batch has no rollout_versions; generation must go through the "
                "rollout group's generate_sequences (trainer.rollout_wg)"
            )
        versions = batch.batch["rollout_versions"]
        versions = versions[versions >= 0]  # -1 marks padding; later masking (e.g. a sample mask) is not looked at
        return (step - 1) - (versions if versions.numel() else torch.tensor([step - 1]))
