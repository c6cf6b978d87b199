"""Legacy and derived config keys, converted as verl does, each conversion said once on stderr.

Owns `migrate_legacy_keys(config, n_workers)` (called by `main_ppo` before `check_config`) and
`resolve_cpu_dtypes(config, device)`:
- verl's legacy reward sections: `reward_model.*`, `custom_reward_function.*`, `sandbox_fusion.*` move to
  `reward.*` (verl 0.9.1's `migrate_legacy_reward_impl`; older verl's `reward_model.sandbox_fusion.*` too), plus
  this project's old `reward_model.{on_error, timeout_s, reward_kwargs, num_examine, micro_batch_size_per_gpu}`;
- `data.gen_batch_size` without `algorithm.filter_groups.enable` becomes `data.train_batch_size` (verl's
  dataloader batch, trained on whole); with it, it is the dynamic sampler's generation round;
- global micro-batch sizes (`actor.ppo_micro_batch_size`, `rollout/ref.log_prob_micro_batch_size`,
  `critic.ppo_micro_batch_size`, `critic.forward_micro_batch_size`) become per-worker sizes, divided by the
  number of workers as verl's workers do (setting both forms is an error, as in verl);
- older forks' keys: `*.fsdp_config.grad_offload` (gradients follow `param_offload` under FSDP2),
  `critic.model.fsdp_config.*` (-> `critic.fsdp.*`), `optim.warmup_style` (-> `lr_scheduler_type`),
  `optim.clip_grad` (-> `grad_clip`), `trainer.ray_init` (-> `ray_kwargs.ray_init`);
- `trainer.logger` given as one string becomes a list.
Must not import torch, Ray or worker code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.utils.mixed_precision import explicit_param_dtype

Notify = Callable[[str], None]
LOW_PRECISION = ("bfloat16", "bf16", "float16", "fp16")


def _notice(msg: str) -> None:
    print(f"notice: {msg}", file=sys.stderr)


def _get(config: DictConfig, path: str):
    return OmegaConf.select(config, path, default=None)


def _is_interpolation(config: DictConfig, path: str) -> bool:
    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(config, parent_path) if parent_path else config
    return isinstance(parent, DictConfig) and key in parent and OmegaConf.is_interpolation(parent, key)


def _set(config: DictConfig, path: str, value) -> None:
    with open_dict(config):
        OmegaConf.update(config, path, value, merge=False, force_add=True)


def _pop(config: DictConfig, path: str):
    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(config, parent_path) if parent_path else config
    if not isinstance(parent, DictConfig) or key not in parent:
        return None
    value = parent.get(key)
    with open_dict(parent):
        del parent[key]
    return value


def _move(config: DictConfig, old: str, new: str, notify: Notify) -> None:
    value = _get(config, old)
    if value is None:
        return
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    _set(config, new, value)
    _set(config, old, None)
    notify(f"{old} is deprecated (verl moved it): using {new}={value!r}")


def _migrate_reward(config: DictConfig, notify: Notify) -> None:
    for old, new in [
        ("reward_model.enable", "reward.reward_model.enable"),
        ("reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool"),
        ("reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node"),
        ("reward_model.nnodes", "reward.reward_model.nnodes"),
        ("reward_model.model.path", "reward.reward_model.model_path"),
        ("reward_model.model.trust_remote_code", "reward.reward_model.trust_remote_code"),
        ("reward_model.micro_batch_size_per_gpu", "reward.reward_model.micro_batch_size_per_gpu"),
        ("reward_model.reward_manager", "reward.reward_manager.name"),
        ("reward_model.num_workers", "reward.num_workers"),
        ("reward_model.reward_kwargs", "reward.reward_kwargs"),
        ("reward_model.on_error", "reward.on_error"),
        ("reward_model.timeout_s", "reward.timeout_s"),
        ("reward_model.num_examine", "reward.num_examine"),
        ("custom_reward_function.path", "reward.custom_reward_function.path"),
        ("custom_reward_function.name", "reward.custom_reward_function.name"),
        ("sandbox_fusion.url", "reward.sandbox_fusion.url"),
        ("sandbox_fusion.max_concurrent", "reward.sandbox_fusion.max_concurrent"),
        ("sandbox_fusion.memory_limit_mb", "reward.sandbox_fusion.memory_limit_mb"),
        ("reward_model.sandbox_fusion.url", "reward.sandbox_fusion.url"),
        ("reward_model.sandbox_fusion.max_concurrent", "reward.sandbox_fusion.max_concurrent"),
        ("reward_model.sandbox_fusion.memory_limit_mb", "reward.sandbox_fusion.memory_limit_mb"),
    ]:
        _move(config, old, new, notify)
    # a custom reward function's own keyword arguments (verl: custom_reward_function.reward_kwargs)
    _move(config, "custom_reward_function.reward_kwargs", "reward.custom_reward_function.reward_kwargs", notify)


def _per_worker(config: DictConfig, legacy: str, per_gpu: str, n_workers: int, notify: Notify) -> None:
    """verl's workers divide a global micro-batch size by the number of workers."""
    value = _get(config, legacy)
    if value is None or _is_interpolation(config, legacy):  # unset, or derived from a key converted before
        return
    explicit = None if _is_interpolation(config, per_gpu) else _get(config, per_gpu)
    if explicit is not None and explicit != value // max(1, n_workers):
        raise ValueError(
            f"both {legacy}={value} and {per_gpu}={explicit} are set; remove {legacy} (deprecated, "
            "global) and keep the per-GPU size"
        )
    size = max(1, int(value) // max(1, n_workers))
    _set(config, per_gpu, size)
    _set(config, legacy, None)
    notify(f"{legacy}={value} is deprecated (global size): using {per_gpu}={size} ({value} // {n_workers} workers)")


def _migrate_micro_batches(config: DictConfig, n_workers: int, notify: Notify) -> None:
    pairs = [
        ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        ),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
        ("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),  # first: forward_* follow it
        ("critic.forward_micro_batch_size", "critic.forward_micro_batch_size_per_gpu"),
    ]
    for legacy, per_gpu in pairs:
        _per_worker(config, legacy, per_gpu, n_workers, notify)


def _migrate_fsdp(config: DictConfig, notify: Notify) -> None:
    for section in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp"):
        value = _pop(config, f"{section}.grad_offload")
        if value is not None:
            notify(
                f"{section}.grad_offload={value} is deprecated (verl removed it): under FSDP2 gradients are "
                f"offloaded with the parameters, by {section}.param_offload"
            )
    legacy_critic = _pop(config, "critic.model.fsdp_config")
    if legacy_critic is not None:
        for key, value in OmegaConf.to_container(legacy_critic, resolve=True).items():
            if value is None:
                continue
            if key == "grad_offload":
                notify("critic.model.fsdp_config.grad_offload is deprecated: follows critic.fsdp.param_offload")
                continue
            _set(config, f"critic.fsdp.{key}", value)
            notify(f"critic.model.fsdp_config.{key} is deprecated (verl moved it): using critic.fsdp.{key}={value!r}")


def _migrate_optim(config: DictConfig, notify: Notify) -> None:
    for role in ("actor_rollout_ref.actor", "critic"):
        style = _get(config, f"{role}.optim.warmup_style")
        if style is not None:
            _set(config, f"{role}.optim.lr_scheduler_type", style)
            _set(config, f"{role}.optim.warmup_style", None)
            notify(f"{role}.optim.warmup_style is deprecated (verl): using {role}.optim.lr_scheduler_type={style!r}")
        clip = _get(config, f"{role}.optim.clip_grad")
        if clip is not None and clip != 1.0 and _get(config, f"{role}.grad_clip") == 1.0:
            _set(config, f"{role}.grad_clip", clip)


def _gen_batch_size(config: DictConfig, notify: Notify) -> None:
    """verl's training dataloader yields `data.gen_batch_size` prompts: with `algorithm.filter_groups.enable` they
    are one generation round (the dynamic sampler reads the key); without it every step trains on them."""
    size = _get(config, "data.gen_batch_size")
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"data.gen_batch_size={size!r} must be a positive integer (null = data.train_batch_size)")
    if _get(config, "algorithm.filter_groups.enable") or size == _get(config, "data.train_batch_size"):
        return
    _set(config, "data.train_batch_size", size)
    notify(
        f"data.gen_batch_size={size} without algorithm.filter_groups.enable: verl trains each step on "
        f"gen_batch_size prompts (its dataloader's batch), so data.train_batch_size={size}"
    )


def migrate_legacy_keys(config: DictConfig, n_workers: int, notify: Notify | None = None) -> DictConfig:
    """Convert legacy keys in place (see the module docstring); `n_workers` = processes of the actor pool."""
    notify = notify or _notice
    _migrate_reward(config, notify)
    _migrate_micro_batches(config, n_workers, notify)
    _migrate_fsdp(config, notify)
    _migrate_optim(config, notify)
    _gen_batch_size(config, notify)
    _move(config, "trainer.ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus", lambda _msg: None)
    logger = _get(config, "trainer.logger")
    if isinstance(logger, str):
        _set(config, "trainer.logger", [logger])
    return config


def resolve_cpu_dtypes(config: DictConfig, device: str, notify: Notify | None = None) -> None:
    """On CPU, run low-precision compute dtypes (verl's GPU default bfloat16) in float32, with one notice.

    Only the implicit `dtype` keys change (their YAML default is verl's GPU setting, which cannot be told apart from
    the same value set by hand); an FSDP section's `mixed_precision.param_dtype` (default null) is an explicit
    request and is honoured: that section computes in it on CPU too (`verl.utils.mixed_precision`)."""
    if device != "cpu":
        return
    sections = ["actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp"]
    keys = [f"{s}.dtype" for s in sections if not explicit_param_dtype(_get(config, s))]
    keys.append("actor_rollout_ref.rollout.dtype")
    changed = [k for k in keys if str(_get(config, k)) in LOW_PRECISION]
    for key in changed:
        _set(config, key, "float32")
    if changed:
        (notify or _notice)(
            f"{', '.join(changed)}: bfloat16/float16 compute is a GPU setting (verl's default); on CPU this run "
            "computes in float32 (set them to float32 to silence this; fsdp_config.mixed_precision.param_dtype=bf16 "
            "computes in bfloat16 on CPU)"
        )
