"""The RLVR part of a training step (ROLL's multi-domain pipeline inside verl's loop), between scoring and log-probs.

Owns `RLVRStep` (`build_rlvr_step(config)`; None when no RLVR feature is on, so a plain run is untouched) and
`make_domain_sampler`. `RLVRStep.run(prompts, rollout, draw, metrics)`: roll out and score (repeated by the
dynamic-sampling scheduler with `filter_groups`), keep `raw_scores`, apply the sample mask, process scores per
domain into `token_level_scores`, and zero the `response_mask` of dropped samples (none when all would be:
`actor/mask_fallback`). Layer 8 helper: no Ray, no models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.domains import (
    DomainSampler,
    DomainSpec,
    MultiDomainDataset,
    check_processing,
    correct_thresholds,
    parse_domains,
    split_batch_size,
)
from verl.trainer.ppo.dynamic_sampling import DynamicSamplingScheduler
from verl.trainer.ppo.reward_processing import MaskConfig, RunningMoments, mask_metrics, process_scores, sample_mask

__all__ = ["ALL", "RLVRStep", "build_rlvr_step", "make_domain_sampler", "val_thresholds"]

ALL = "all"  # the single bucket of a run without data.domains


def _processes(spec: DomainSpec) -> bool:
    return (
        spec.reward_norm is not None or spec.reward_clip is not None or spec.reward_scale != 1.0 or spec.weight != 1.0
    )


def _whole_batch_spec(config: Any) -> DomainSpec:
    """The processing settings of a run without domains: `algorithm.reward_norm/_clip/_scale`."""
    algorithm = config.get("algorithm") or {}
    check_processing(algorithm, "algorithm")
    threshold = (config.get("reward") or {}).get("correct_threshold")
    scale = algorithm.get("reward_scale")
    return DomainSpec(
        name=ALL,
        train_files=(),
        val_files=(),
        reward_type="",
        data_source=None,
        reward_norm=algorithm.get("reward_norm"),
        reward_clip=algorithm.get("reward_clip"),
        reward_scale=1.0 if scale is None else float(scale),
        correct_threshold=1.0 if threshold is None else float(threshold),
    )


class RLVRStep:
    """The mask step, dynamic sampling and reward processing of one training step (see the module docstring).

    Args:
        specs: `{bucket: DomainSpec}` (one `"all"` bucket without domains).
        mask: which mask strategies run.
        scheduler: the dynamic sampler (None unless `algorithm.filter_groups.enable`).
        quotas: prompts per bucket in one batch (what `draw` asks for, per short bucket).
        domain_key: the non-tensor column naming each row's domain (None without domains).
    """

    def __init__(
        self,
        specs: dict[str, DomainSpec],
        mask: MaskConfig,
        scheduler: DynamicSamplingScheduler | None,
        quotas: dict[str, int],
        domain_key: str | None,
    ) -> None:
        self.specs, self.mask, self.scheduler = specs, mask, scheduler
        self.quotas, self.domain_key = quotas, domain_key
        self.processing = any(_processes(spec) for spec in specs.values())
        self.running = {name: RunningMoments() for name in specs}
        self.extra_keys: list[str] = []  # reward extra fields of the last batch (for per-domain metrics)

    # ------------------------------------------------------------------------------------------------ helpers
    def _rows_by_bucket(self, batch: DataProto) -> dict[str, np.ndarray]:
        if self.domain_key is None:
            return {ALL: np.arange(len(batch))}
        column = batch.non_tensor_batch[self.domain_key]
        return {name: np.flatnonzero(column == name) for name in self.specs if (column == name).any()}

    def _thresholds(self, batch: DataProto) -> list[float]:
        by_bucket = {name: spec.correct_threshold for name, spec in self.specs.items()}
        if self.domain_key is None:
            return [by_bucket[ALL]] * len(batch)
        return [by_bucket[d] for d in batch.non_tensor_batch[self.domain_key]]

    def _masks(self, batch: DataProto) -> dict[str, np.ndarray]:
        return sample_mask(batch, self.mask, self._thresholds(batch))

    def _with_raw_scores(self, rollout: Callable[[DataProto], DataProto]) -> Callable[[DataProto], DataProto]:
        def scored(prompts: DataProto) -> DataProto:
            batch = rollout(prompts)
            batch.batch["raw_scores"] = batch.batch["token_level_scores"].sum(-1).clone()
            return batch

        return scored

    # ------------------------------------------------------------------------------------------------ the step
    def run(
        self,
        prompts: DataProto,
        rollout: Callable[[DataProto], DataProto],
        draw: Callable[[dict[str, int]], DataProto],
        metrics: dict[str, float],
    ) -> DataProto:
        """Roll out, mask, (re)sample and process one step's batch; adds the mask, dynamic-sampling and processing
        metrics to `metrics` (overall and as `{domain}/...`)."""
        prompt_keys = set(prompts.non_tensor_batch)
        rollout = self._with_raw_scores(rollout)
        if self.scheduler is not None:
            judge = lambda batch: self._masks(batch)["group"]  # noqa: E731
            more = lambda shortfall: draw({name: self.quotas[name] for name in shortfall})  # noqa: E731
            batch, _, sampling_metrics = self.scheduler.collect(prompts, more, rollout, judge)
            metrics.update(sampling_metrics)
        else:
            batch = rollout(prompts)
        self.extra_keys = [key for key in batch.non_tensor_batch if key not in prompt_keys and key != "uid"]
        masks = self._masks(batch)
        keep = torch.from_numpy(masks["final"])
        buckets = self._rows_by_bucket(batch)
        if self.mask.active:
            metrics.update(mask_metrics(masks))
            if self.domain_key is not None:
                for name, rows in buckets.items():
                    metrics.update(mask_metrics(masks, rows, prefix=f"{name}/"))
        if self.processing:
            self._process(batch, keep, buckets, metrics)
        self._drop(batch, keep, metrics)
        return batch

    def _process(
        self, batch: DataProto, keep: torch.Tensor, buckets: dict[str, np.ndarray], metrics: dict[str, float]
    ) -> None:
        scores = batch.batch["token_level_scores"].sum(-1)
        processed = scores.clone()
        uids = batch.non_tensor_batch["uid"]
        for name, rows in buckets.items():
            spec, index = self.specs[name], torch.from_numpy(rows)
            out, clip_metrics = process_scores(
                scores[index],
                norm=spec.reward_norm,
                clip=spec.reward_clip,
                scale=spec.reward_scale,
                weight=spec.weight,
                index=uids[rows],
                keep=keep[index],
                running=self.running[name],
            )
            processed[index] = out
            prefix = "" if self.domain_key is None else f"{name}/"
            metrics.update({prefix + key: value for key, value in clip_metrics.items()})
        mask = batch.batch["response_mask"]
        positions = torch.arange(1, mask.shape[-1] + 1)
        last = ((mask.bool() * positions).max(dim=-1).values - 1).clamp(min=0)
        batch.batch["token_level_scores"][torch.arange(len(batch)), last] += processed - scores

    def _drop(self, batch: DataProto, keep: torch.Tensor, metrics: dict[str, float]) -> None:
        if keep.all():
            return
        if not keep.any():
            print("sample mask: every sample of this batch would be dropped; training on all of them instead")
            metrics["actor/mask_fallback"] = 1.0
            return
        batch.batch["response_mask"][~keep] = 0

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"running": {name: moments.state_dict() for name, moments in self.running.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, moments in (state or {}).get("running", {}).items():
            if name in self.running:
                self.running[name].load_state_dict(moments)


def build_rlvr_step(config: Any) -> RLVRStep | None:
    """The RLVR step for `config`; None when there are no domains, no mask strategy, no dynamic sampling and no
    reward processing (the trainer then runs exactly its original step)."""
    parsed = parse_domains(config, check_files=False)
    mask = MaskConfig.from_config(config.get("algorithm"))
    batch_size = int(config.data.train_batch_size)
    if parsed is not None:
        specs = {spec.name: spec for spec in parsed[0]}
        quotas, domain_key = split_batch_size(parsed[1], batch_size), "domain"
    else:
        specs, quotas, domain_key = {ALL: _whole_batch_spec(config)}, {ALL: batch_size}, None
    if parsed is None and not mask.active and not _processes(specs[ALL]):
        return None
    scheduler = None
    if mask.filter_groups:
        groups = config.algorithm.filter_groups
        scheduler = DynamicSamplingScheduler(
            {name: count for name, count in quotas.items() if count > 0},
            max_num_gen_batches=int(groups.get("max_num_gen_batches", 0) or 0),
            on_cap=groups.get("on_cap", "continue") or "continue",
            bucket_key=domain_key,
            gen_batch_size=config.data.get("gen_batch_size"),
        )
    return RLVRStep(specs, mask, scheduler, quotas, domain_key)


def make_domain_sampler(config: Any, dataset: Any) -> DomainSampler | None:
    """The per-domain sampler of a MultiDomainDataset (None for any other dataset)."""
    if not isinstance(dataset, MultiDomainDataset):
        return None
    parsed = parse_domains(config, check_files=False)
    if parsed is None:
        raise ValueError("the training set is a MultiDomainDataset but data.domains is empty")
    quotas = split_batch_size(parsed[1], int(config.data.train_batch_size))
    seed = config.data.get("seed")
    return DomainSampler(dataset.sizes(), quotas, seed=1 if seed is None else int(seed), shuffle=config.data.shuffle)


def val_thresholds(config: Any, batch: DataProto) -> list[float]:
    """Each validation row's `correct_threshold` (by its domain when the batch has a `domain` column)."""
    return correct_thresholds(config, batch.non_tensor_batch.get("domain"), len(batch))
