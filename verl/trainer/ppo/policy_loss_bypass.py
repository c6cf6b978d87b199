"""verl 0.9.1's "bypass_mode" policy loss: rollout correction inside the loss when old_log_prob is the rollout's.

Owns `compute_policy_loss_bypass_mode`, registered as "bypass_mode" by core_algos. In bypass mode
(`algorithm.rollout_correction.bypass_mode=true`) the trainer skips the old-log-prob forward pass and hands the
rollout's log-probs in as `old_log_prob`, so only two policies remain: pi_rollout and the current pi_theta. The
IS weights and rejection mask are then computed here, per micro-batch, from the current log-probs (see
`rollout_corr_helper`). Layer 3 (docs/architecture.md#layers): imports torch, `policy_loss`, `loss_aggregation` and
`rollout_corr_helper`; not core_algos (which imports this module).
"""

from __future__ import annotations

from typing import Any

import torch

from verl.trainer.ppo.loss_aggregation import cfg_get
from verl.trainer.ppo.policy_loss import compute_policy_loss_reinforce, compute_policy_loss_vanilla
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

__all__ = ["compute_policy_loss_bypass_mode"]


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Policy loss of bypass mode, where `old_log_prob` is log pi_rollout; all tensors (bs, response_length).

    With the settings of `config.policy_loss.rollout_correction` (written there by `apply_bypass_mode` /
    `resolve_rollout_correction_config`), IS weights w and the rejection mask are computed (without gradient)
    from log pi_theta = `log_prob` against log pi_rollout, rejected tokens leave `response_mask`, then by
    `loss_type`:
    - "ppo_clip" (default): the vanilla PPO clipped loss with ratio r = pi_theta / pi_rollout,
      L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (dual clip for A < 0); w is logged, not applied,
      because r already is the importance ratio.
    - "reinforce": L = -w * A * log pi_theta (w = 1 when `rollout_is` is null), metric actor/ppo_kl only.
    The argument `rollout_is_weights` is ignored (the weights are computed here). Metrics: the loss's own plus
    every `rollout_corr/*` metric of this micro-batch. ValueError without the config block or for another
    `loss_type`.
    """
    policy_loss = cfg_get(config, "policy_loss", None)
    rollout_corr = cfg_get(policy_loss, "rollout_correction", None) if policy_loss is not None else None
    if rollout_corr is None:
        raise ValueError(
            "rollout_correction config not found in policy_loss. "
            "When using loss_mode='bypass_mode', ensure rollout_correction config is passed."
        )
    loss_type = cfg_get(rollout_corr, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    rollout_log_prob = old_log_prob
    with torch.no_grad():
        weights, effective_mask, rollout_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(),
            rollout_log_prob=rollout_log_prob,
            response_mask=response_mask,
            rollout_is=cfg_get(rollout_corr, "rollout_is", None),
            rollout_is_threshold=cfg_get(rollout_corr, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=cfg_get(rollout_corr, "rollout_is_batch_normalize", False),
            rollout_rs=cfg_get(rollout_corr, "rollout_rs", None),
            rollout_rs_threshold=cfg_get(rollout_corr, "rollout_rs_threshold", None),
        )
    if loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(
            old_log_prob=rollout_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=effective_mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
            rollout_is_weights=None if weights is None else weights.batch["rollout_is_weights"],
        )
        pg_metrics: dict[str, Any] = {"actor/ppo_kl": metrics["actor/ppo_kl"]}
    else:
        pg_loss, pg_metrics = compute_policy_loss_vanilla(
            old_log_prob=rollout_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=effective_mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
        )
    pg_metrics.update(rollout_metrics)
    return pg_loss, pg_metrics
