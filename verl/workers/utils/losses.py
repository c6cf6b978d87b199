"""The PPO actor and critic losses as engine loss functions (verl 0.9.1's `verl.workers.utils.losses`).

`ppo_loss(config, model_output, data, dp_group=None)` and `value_loss(...)`, bound with `functools.partial`, are
what `forward_backward_batch` calls per micro-batch; `data` carries the loss inputs and the engine's global counts
(`dp_size`, `batch_num_tokens`, `global_batch_size`). They return (loss, metrics); the metric named like the loss is
the micro-batch's share of the mini-batch loss. The one place the PPO update's loss is written. Layer 5.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from tensordict import TensorDict

from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.torch_functional import masked_mean
from verl.workers.config import ActorConfig, CriticConfig, FSDPActorConfig, FSDPCriticConfig

__all__ = ["OPTIONAL_LOSS_INPUTS", "optional_loss_inputs", "ppo_loss", "value_loss"]

OPTIONAL_LOSS_INPUTS = ("rollout_log_probs", "rollout_is_weights")  # batch keys a policy loss may take


def optional_loss_inputs(policy_loss_fn: Any, batch: Any) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of `OPTIONAL_LOSS_INPUTS` that `policy_loss_fn` declares (or takes as **kwargs), from
    `batch` (None when absent), so a loss written against verl 0.9.1 (`rollout_is_weights`, no
    `rollout_log_probs`) runs unchanged. ValueError when the batch has `rollout_is_weights` and the loss cannot
    take them (they would be silently dropped)."""
    params = inspect.signature(policy_loss_fn).parameters
    any_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {key: batch[key] if key in batch.keys() else None for key in OPTIONAL_LOSS_INPUTS}
    if kwargs["rollout_is_weights"] is not None and not (any_kw or "rollout_is_weights" in params):
        name = getattr(policy_loss_fn, "__name__", policy_loss_fn)
        raise ValueError(
            f"policy loss {name} has no rollout_is_weights argument, but algorithm.rollout_correction.rollout_is "
            "produced IS weights; add `rollout_is_weights=None` to it (multiplying the token losses) or set "
            "rollout_is=null"
        )
    return {key: value for key, value in kwargs.items() if any_kw or key in params}


def _global_batch_info(data: TensorDict) -> dict[str, Any]:
    return {key: data[key] for key in ("dp_size", "batch_num_tokens", "global_batch_size")}


def _typed(config: Any, base: type, default: type) -> Any:
    """`config` as a typed section: as it is when it already is one, else read into `default` (verl's defaults for
    the keys it leaves out)."""
    return config if isinstance(config, base) else omega_conf_to_dataclass(config or {}, default)


def ppo_loss(config: Any, model_output: dict[str, torch.Tensor], data: TensorDict, dp_group: Any = None):
    """Policy loss (`actor.policy_loss.loss_mode`), minus `entropy_coeff` x entropy when `model_output` has an
    entropy, plus `kl_loss_coef` x KL to `ref_log_prob` with `use_kl_loss`; every term aggregated by
    `loss_agg_mode` over the global mini-batch.

    config: the actor config, an `ActorConfig` or a mapping of its keys (`loss_agg_mode`, `policy_loss`, `entropy_coeff`, `use_kl_loss`, `kl_loss_coef`,
    `kl_loss_type`, and what the policy loss reads); it gets `global_batch_info` set, as verl's does.
    Metrics: the policy loss's own (`actor/pg_clipfrac`, `actor/ppo_kl`, ...), `actor/pg_loss`, `actor/entropy`
    (when an entropy is given) and `actor/kl_loss` (with `use_kl_loss`).
    """
    config = _typed(config, ActorConfig, FSDPActorConfig)
    info = _global_batch_info(data)
    config.global_batch_info = info
    loss_agg_mode = config.loss_agg_mode
    response_mask = data["response_mask"]
    log_prob = model_output["log_probs"]
    policy_loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)
    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=data["old_log_probs"],
        log_prob=log_prob,
        advantages=data["advantages"],
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        **optional_loss_inputs(policy_loss_fn, data),
    )
    metrics = {key: float(value) for key, value in pg_metrics.items()}
    metrics["actor/pg_loss"] = float(pg_loss.detach())
    loss = pg_loss
    entropy = model_output.get("entropy")
    if entropy is not None:
        entropy_coeff = float(config.entropy_coeff)
        entropy_loss = core_algos.agg_loss(entropy, response_mask, loss_agg_mode, **info)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * entropy_loss
        metrics["actor/entropy"] = float(entropy_loss.detach())
    if config.use_kl_loss:
        kld = core_algos.kl_penalty(log_prob, data["ref_log_prob"], config.kl_loss_type)
        kl_loss = core_algos.agg_loss(kld, response_mask, loss_agg_mode, **info)
        loss = loss + float(config.kl_loss_coef) * kl_loss
        metrics["actor/kl_loss"] = float(kl_loss.detach())
    return loss, metrics


def value_loss(config: Any, model_output: dict[str, torch.Tensor], data: TensorDict, dp_group: Any = None):
    """verl's clipped value loss of `model_output["values"]` against `returns`, clipped around the old `values` by
    `cliprange_value`, aggregated by `loss_agg_mode` over the global mini-batch.
    Metrics: `critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean`."""
    config = _typed(config, CriticConfig, FSDPCriticConfig)
    vpreds = model_output["values"]
    response_mask = data["response_mask"]
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
        vpreds,
        data["returns"],
        data["values"],
        response_mask,
        float(config.cliprange_value),
        loss_agg_mode=config.loss_agg_mode,
        **_global_batch_info(data),
    )
    metrics = {
        "critic/vf_loss": float(vf_loss.detach()),
        "critic/vf_clipfrac": float(vf_clipfrac),
        "critic/vpred_mean": masked_mean(vpreds.detach(), response_mask).item(),
    }
    return vf_loss, metrics
