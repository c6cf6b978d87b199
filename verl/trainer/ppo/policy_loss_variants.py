"""Further verl 0.9.1 policy losses: dppo_tv and dppo_kl (divergence-masked PPO), sapo (soft-gated ratio), geo_mean
(GMPO) and dro (quadratic log-ratio penalty), in `VARIANT_POLICY_LOSSES`, and verl's alias `PolicyLossFn`.
They share `policy_loss.py`'s helpers and signature, so they aggregate and reweight as the built-ins do.
Layer 3: never imports core_algos (which registers the table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.loss_aggregation import agg_loss, cfg_get
from verl.trainer.ppo.policy_loss import (
    _agg_kwargs,
    _aggregate,
    _apply_decoupled,
    _apply_tis,
    _clamped_log_ratio,
    _clip_range,
    _metrics,
)

__all__ = [
    "PolicyLossFn",
    "VARIANT_POLICY_LOSSES",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_sapo",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
]

# verl's alias for a registered policy loss, its seven positional arguments (config: a dict, DictConfig or
# dataclass of the actor config); the losses here also take verl's `rollout_is_weights` as an eighth.
PolicyLossFn = Callable[
    [
        torch.Tensor,  # old_log_prob
        torch.Tensor,  # log_prob
        torch.Tensor,  # advantages
        torch.Tensor,  # response_mask
        str,  # loss_agg_mode
        Any,  # config
        torch.Tensor | None,  # rollout_log_probs
    ],
    tuple[torch.Tensor, dict[str, Any]],
]


# ------------------------------------------------------------------------------------------------- helpers


def _dppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_log_probs: torch.Tensor | None,
    rollout_is_weights: torch.Tensor | None,
    valid_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss both DPPO variants share once their trust-region mask `valid_mask` (bool, detached) is known:
    L = -A * sg[min(ratio, clip_ratio_c)] * logp * valid, i.e. a truncated-IS policy gradient on valid tokens."""
    clip_ratio_c = cfg_get(config, "clip_ratio_c", 20.0)
    log_ratio, ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = valid_mask.detach().float()

    pg_losses = -advantages * truncated_ratio * log_prob * valid
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )

    pg_clipfrac = verl_F.masked_mean(1.0 - valid, response_mask)
    pg_clipfrac_lower = verl_F.masked_mean((ratio > clip_ratio_c).float() * valid, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _behaviour_weights(
    old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any
) -> torch.Tensor | None:
    """Per-token weights (bs, response_length) that `_aggregate` would multiply the token losses by (decoupled PPO
    or TIS, when configured), or None when neither applies."""
    ones = torch.ones_like(old_log_prob)
    weights = _apply_decoupled(ones, old_log_prob, rollout_log_probs, config)
    weights = _apply_tis(weights, old_log_prob, rollout_log_probs, config)
    return None if weights is ones else weights


# ------------------------------------------------------------------------------------------------ policy losses


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (https://arxiv.org/abs/2602.04879): a trust region on the total-variation distance of each
    token's probability instead of on the ratio.

    A token counts (valid) when, for A > 0, p - p_old <= delta_high, and for A <= 0, p - p_old >= -delta_low, with
    p = exp(logp); L = -A * sg[min(ratio, clip_ratio_c)] * logp * valid. The deltas are read from clip_ratio,
    clip_ratio_low/high (the TV threshold here, not a ratio bound); clip_ratio_c (default 20.0; 3.0 in the trainer
    YAML) truncates the importance weight. pg_clipfrac = share of invalid tokens, pg_clipfrac_lower = share of
    valid tokens whose ratio exceeds clip_ratio_c.
    """
    delta_low, delta_high = _clip_range(config)
    prob_diff = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, prob_diff <= delta_high, prob_diff >= -delta_low)
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_log_probs,
        rollout_is_weights,
        valid,
    )


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (https://arxiv.org/abs/2602.04879): the DPPO trust region measured by the KL divergence
    between the old and new binary distributions {this token, any other token}.

    KL_b = p_old * (logp_old - logp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8)). A token is valid
    for A > 0 when KL_b <= delta_high or p <= p_old, for A <= 0 when KL_b <= delta_low or p >= p_old (moving
    against the advantage is never masked). L = -A * sg[min(ratio, clip_ratio_c)] * logp * valid; config and
    metrics as in `dppo_tv`.
    """
    delta_low, delta_high = _clip_range(config)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    valid = torch.where(
        advantages > 0, (binary_kl <= delta_high) | (prob <= old_prob), (binary_kl <= delta_low) | (prob >= old_prob)
    )
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_log_probs,
        rollout_is_weights,
        valid,
    )


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft Adaptive Policy Optimization (SAPO, https://arxiv.org/abs/2511.20347): a smooth gate in place
    of the hard clip.

    ratio = exp(clamp(logp - old_logp, -20, 20)); tau = tau_pos if A > 0 else tau_neg;
    gate = sigmoid(tau * (ratio - 1)) * 4 / tau (slope 1 at ratio 1, fading away from it); L = -gate * A.
    Config: tau_pos (1.0), tau_neg (1.05), both > 0. Always aggregated "seq-mean-token-mean" whatever
    `loss_agg_mode` says (verl does the same). pg_clipfrac and pg_clipfrac_lower are 0.
    """
    tau_pos_value, tau_neg_value = cfg_get(config, "tau_pos", 1.0), cfg_get(config, "tau_neg", 1.05)
    if tau_pos_value <= 0 or tau_neg_value <= 0:
        raise ValueError(
            f"sapo needs actor.tau_pos > 0 and actor.tau_neg > 0, got tau_pos={tau_pos_value}, tau_neg={tau_neg_value}"
        )
    tau_pos = torch.as_tensor(tau_pos_value, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg_value, dtype=advantages.dtype, device=advantages.device)

    log_ratio, ratio = _clamped_log_ratio(log_prob, old_log_prob)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, "seq-mean-token-mean", config, rollout_is_weights
    )

    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(0.0, ppo_kl, 0.0)


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Geometric-Mean Policy Optimization (GMPO, https://arxiv.org/abs/2507.20673): PPO on the geometric
    mean of a sequence's token ratios.

    Per token x = logp - old_logp (not clamped), clipped one-sidedly by the sign of A: for A > 0 to at most
    eps_high, for A < 0 to at least -eps_low (x_c = sgn(A) * min(sgn(A) * x, sgn(A) * clip(x, -eps_low, eps_high))).
    Per sequence r_i = exp(masked mean of x_c), A_i = masked mean of A (a sequence-level advantage is assumed) and
    L_i = -A_i * r_i. `loss_agg_mode` is ignored: L is the mean of L_i over the sequences (verl's torch.mean); with
    global_batch_info the denominator is global_batch_size (scaled by dp_size as in `agg_loss`), so the losses of
    micro-batches and ranks add up to the mean over the global batch, as with the seq-mean modes of `agg_loss`.
    Token weights (TIS or decoupled, and `rollout_is_weights`) enter per sequence as their geometric mean
    exp(masked mean of log(w + 1e-10)), as in verl. pg_clipfrac / pg_clipfrac_lower = share of tokens whose x was
    clipped with A > 0 / A < 0.
    """
    clip_low, clip_high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)

    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    log_ratio_clipped = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)

    token_counts = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((log_ratio_clipped * response_mask).sum(dim=-1) / (token_counts + 1e-8))
    seq_advantage = (advantages * response_mask).sum(dim=-1) / (token_counts + 1e-8)
    seq_losses = -seq_advantage * seq_ratio  # (bs,)

    weights = _behaviour_weights(old_log_prob, rollout_log_probs, config)
    if rollout_is_weights is not None:
        weights = rollout_is_weights if weights is None else weights * rollout_is_weights
    if weights is not None:
        seq_weights = torch.exp((torch.log(weights + 1e-10) * response_mask).sum(dim=-1) / (token_counts + 1e-8))
        seq_losses = seq_losses * seq_weights
    # one "token" per sequence, every row counted: the local mean over rows is verl's torch.mean(seq_losses)
    ones = torch.ones_like(seq_losses).unsqueeze(-1)
    pg_loss = agg_loss(seq_losses.unsqueeze(-1), ones, "seq-mean-token-sum", **_agg_kwargs(config))

    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = verl_F.masked_mean((clipped & (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = verl_F.masked_mean((clipped & (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Reward Optimization's policy term (DRO, https://arxiv.org/abs/2405.19107, with the old policy in place
    of the reference): a policy gradient with a quadratic penalty on the log-ratio instead of a clip.

    L = -(logp * A - beta / 2 * (logp - old_logp)^2), beta = config.policy_loss.dro_beta (required, > 0; verl's
    default null refuses the loss). Returns only the metric actor/ppo_kl (mean of old_logp - logp), as verl does.
    """
    beta = cfg_get(cfg_get(config, "policy_loss", None), "dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError(
            f"policy_loss.dro_beta must be a positive value when using DRO, got {beta}; "
            "set actor_rollout_ref.actor.policy_loss.dro_beta (e.g. 0.05)"
        )
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return pg_loss, {"actor/ppo_kl": verl_F.masked_mean(-log_ratio, response_mask).detach().item()}


# ------------------------------------------------------------------------------------------------ registration

# core_algos registers each under its name (verl's `register_policy_loss` names).
VARIANT_POLICY_LOSSES: dict[str, Callable] = {
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "sapo": compute_policy_loss_sapo,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
}
