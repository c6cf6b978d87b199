"""The FSDP workers' config checks and normalisation, run in each worker before a model is built:
`normalize_batch_sizes`, `check_old_log_prob_reuse`, `compute_dtype`, and the helpers `fsdp_workers` uses and
re-exports (`private_config`, `require_positive_int`, `check_supported`, `critic_fsdp_config`,
`require_dir_on_node`). Every error names the key and its value. Layer 7: no torch code.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl.single_controller.base.worker import node_label
from verl.utils.mixed_precision import canonical_dtype, resolve_mixed_precision
from verl.workers.lora import lora_rank

__all__ = [
    "check_old_log_prob_reuse",
    "check_supported",
    "compute_dtype",
    "critic_fsdp_config",
    "normalize_batch_sizes",
    "private_config",
    "require_dir_on_node",
    "require_positive_int",
]


def require_dir_on_node(
    path: Any, key: str, rank: int, absolute_only: bool = False, marker: str | None = "config.json"
) -> None:
    """FileNotFoundError naming `key`, the path, this node and `rank` when `path` is not a directory here (or lacks
    `marker`, a model folder's config.json): the driver checked it on its own node, and on a cluster every node
    needs the folder at the same path. With `absolute_only`, a relative path is left to the loader (it may be a hub
    id resolved from the local cache)."""
    if path is None or (absolute_only and not os.path.isabs(str(path))):
        return
    path = str(path)
    if not os.path.isdir(path) or (marker and not os.path.isfile(os.path.join(path, marker))):
        what = "is not a directory" if not os.path.isdir(path) else f"has no {marker}"
        raise FileNotFoundError(
            f"{key}={path!r} {what} on node {node_label()}, where rank {rank} runs; every node of the cluster needs "
            "the model folder at this path (shared storage, or a copy on each node)"
        )


def private_config(config: Any) -> DictConfig:
    """A resolved, writable copy of a config sub-tree (DictConfig or dict), so normalisation never leaks out."""
    if isinstance(config, DictConfig):
        return OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    return OmegaConf.create(dict(config))


def require_positive_int(value: Any, key: str) -> int:
    """`value` as a positive int, or a ValueError naming `key` and the value."""
    if value is None or int(value) <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def normalize_batch_sizes(section: DictConfig, n: int, world_size: int, prefix: str) -> None:
    """In place: `ppo_mini_batch_size` (prompts) becomes samples per rank, as verl's workers do.

    mini = ppo_mini_batch_size * n / world_size must be an integer; `ppo_micro_batch_size_per_gpu` is capped
    at that mini-batch and must divide it (unless `use_dynamic_bsz`). Errors name both numbers.
    """
    prompts = require_positive_int(section.get("ppo_mini_batch_size"), f"{prefix}.ppo_mini_batch_size")
    samples = prompts * n
    if samples % world_size != 0:
        raise ValueError(
            f"{prefix}.ppo_mini_batch_size * rollout.n = {prompts} * {n} = {samples} samples is not divisible by "
            f"the data-parallel world size {world_size}"
        )
    section.ppo_mini_batch_size = samples // world_size
    if section.get("use_dynamic_bsz", False):
        return
    key = f"{prefix}.ppo_micro_batch_size_per_gpu"
    micro = min(require_positive_int(section.get("ppo_micro_batch_size_per_gpu"), key), section.ppo_mini_batch_size)
    if section.ppo_mini_batch_size % micro != 0:
        raise ValueError(
            f"the per-rank mini-batch of {section.ppo_mini_batch_size} samples is not divisible by {key}={micro}"
        )
    section.ppo_micro_batch_size_per_gpu = micro


def check_supported(model_cfg: Any) -> None:
    """Refuse model settings the FSDP workers cannot honour (bad LoRA rank, a shared prompt prefix with gradient
    checkpointing), before any model is loaded."""
    lora_rank(model_cfg)  # a bad value raises here, before any model is loaded
    if model_cfg.get("share_prompt_prefix", False) and model_cfg.get("enable_gradient_checkpointing", False):
        raise ValueError(
            "model.share_prompt_prefix=true needs a KV cache in the update pass, which gradient checkpointing "
            "drops; set model.enable_gradient_checkpointing=false or model.share_prompt_prefix=false"
        )


def critic_fsdp_config(config: Any) -> dict:
    """The critic's engine config: verl 0.9.1's `critic.fsdp`, over the older `critic.fsdp_config`, over the legacy
    `critic.model.fsdp_config` (a key set in a later one wins)."""
    merged: dict = {}
    for section in (config.get("model", {}).get("fsdp_config"), config.get("fsdp_config"), config.get("fsdp")):
        if section:
            merged.update(OmegaConf.to_container(section) if isinstance(section, DictConfig) else dict(section))
    return merged


def check_old_log_prob_reuse(config: Any) -> None:
    """`actor.recompute_old_log_prob=false` reuses the rollout's log-probs as `old_log_probs`; that is exact only
    when the rollout computes them (`rollout.calculate_log_probs`) with the actor's own weights in the actor's
    dtype, which the `hf` engine does (it is synced after every update). Anything else raises ValueError."""
    if config.get("actor", {}).get("recompute_old_log_prob", True):
        return
    rollout = config.get("rollout", {})
    if not rollout.get("calculate_log_probs", False):
        raise ValueError(
            "actor.recompute_old_log_prob=false reuses rollout_log_probs as old_log_probs; "
            "set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    if rollout.get("name", "hf") != "hf":
        raise ValueError(
            f"actor.recompute_old_log_prob=false needs log-probs of the actor's exact weights; rollout.name="
            f"{rollout.get('name')!r} is not exact, use hf or actor.recompute_old_log_prob=true"
        )
    actor_dtype = compute_dtype(config.get("actor", {}).get("fsdp_config"))
    rollout_dtype = canonical_dtype(rollout.get("dtype") or actor_dtype, "rollout.dtype")
    if rollout_dtype != actor_dtype:
        raise ValueError(
            f"actor.recompute_old_log_prob=false needs the rollout in the actor's dtype: rollout.dtype="
            f"{rollout_dtype!r}, actor.fsdp_config.dtype={actor_dtype!r}"
        )


def compute_dtype(fsdp_cfg: Any) -> str:
    """The compute dtype: `fsdp_config.mixed_precision.param_dtype`, else `fsdp_config.dtype` (verl's precedence,
    `verl.utils.mixed_precision`); float32 when neither is set. On CPU the driver has already turned an implicit
    low-precision `dtype` into float32 (`verl.trainer.config.resolve_cpu_dtypes`); `param_dtype` is kept."""
    return resolve_mixed_precision(fsdp_cfg, "fsdp_config").param_dtype or "float32"
