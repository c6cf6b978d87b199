"""The built-in PPO-family policy losses (vanilla dual-clip PPO, gspo, clip_cov, kl_cov, gpg, cispo, reinforce, topr)
in `BUILTIN_POLICY_LOSSES`, and the private helpers the variants share (global-batch `agg_loss` arguments,
truncated IS and AReaL's decoupled weight, metrics, clip ranges). core_algos owns the registry and registers them.

Every loss has verl's signature `fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_log_probs, rollout_is_weights) -> (pg_loss, metrics)`, tensors (bs, response_length); `rollout_is_weights`
multiply the per-token losses before aggregation. Layer 3: torch, `verl.utils.torch_functional`, core_algos' deps.
"""

from __future__ import annotations

from typing import Any

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.loss_aggregation import agg_loss, cfg_get

__all__ = [
    "GLOBAL_BATCH_KEYS",
    "BUILTIN_POLICY_LOSSES",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_gpg",
    "compute_policy_loss_cispo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_topr",
]

GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


# ------------------------------------------------------------------------------------------------- helpers


def _agg_kwargs(config: Any) -> dict[str, Any]:
    """agg_loss's global-batch arguments from config.global_batch_info (and config.loss_scale_factor)."""
    info = dict(cfg_get(config, "global_batch_info", None) or {})
    unknown = sorted(set(info) - set(GLOBAL_BATCH_KEYS))
    if unknown:
        raise ValueError(f"global_batch_info has unknown keys {unknown}; allowed: {list(GLOBAL_BATCH_KEYS)}")
    if "loss_scale_factor" not in info and cfg_get(config, "loss_scale_factor", None) is not None:
        info["loss_scale_factor"] = cfg_get(config, "loss_scale_factor", None)
    return info


def _apply_tis(
    pg_losses: torch.Tensor, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any
) -> torch.Tensor:
    """Truncated importance sampling (verl's TIS): pg_losses * min(exp(old_logp - rollout_logp), cap), if cap > 0."""
    cap = cfg_get(config, "tis_imp_ratio_cap", -1)
    if cap <= 0 or rollout_log_probs is None:
        return pg_losses
    weights = torch.exp(old_log_prob - rollout_log_probs).clamp(max=cap).detach()
    return pg_losses * weights


def _apply_decoupled(
    pg_losses: torch.Tensor, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any
) -> torch.Tensor:
    """Decoupled PPO (Hilton et al. 2021, https://arxiv.org/abs/2110.00641; AReaL, https://arxiv.org/abs/2505.24298),
    when `use_decoupled_loss`: the PPO ratio is taken against the proximal policy `old_log_prob` (recomputed by the
    actor before the update) and each token's loss is weighted by w = exp(old_logp - rollout_logp), pi_prox /
    pi_behav with pi_behav the (possibly stale) policy that sampled it. w is detached; tokens with
    w > `behav_imp_weight_cap` (when set) get weight 0, i.e. are dropped but still counted by the aggregation, as
    in AReaL (verl's TIS truncates w at its cap instead).
    """
    if not cfg_get(config, "use_decoupled_loss", False):
        return pg_losses
    if rollout_log_probs is None:
        raise ValueError(
            "actor.use_decoupled_loss=true needs rollout_log_probs (the behaviour policy's log-probs) in the batch; "
            "set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    if cfg_get(config, "tis_imp_ratio_cap", -1) > 0:
        raise ValueError("actor.use_decoupled_loss=true and actor.tis_imp_ratio_cap > 0: set only one of the two")
    weights = torch.exp(old_log_prob - rollout_log_probs).detach()
    cap = cfg_get(config, "behav_imp_weight_cap", None)
    if cap is not None:
        weights = torch.where(weights <= cap, weights, torch.zeros_like(weights))
    return pg_losses * weights


def _aggregate(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar loss every policy loss ends with: weight the per-token losses for the behaviour policy (decoupled
    PPO or TIS, when configured; then verl's `rollout_is_weights` of `algorithm.rollout_correction`, when given),
    then `agg_loss` them."""
    pg_losses = _apply_decoupled(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_ratio = clamp(logp - old_logp, -20, 20) and ratio = exp(log_ratio), guarding exp against overflow."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    return log_ratio, torch.exp(log_ratio)


def _metrics(pg_clipfrac: Any = 0.0, ppo_kl: Any = 0.0, pg_clipfrac_lower: Any = 0.0) -> dict[str, float]:
    def as_float(value: Any) -> float:
        return value.detach().item() if isinstance(value, torch.Tensor) else float(value)

    return {
        "actor/pg_clipfrac": as_float(pg_clipfrac),
        "actor/ppo_kl": as_float(ppo_kl),
        "actor/pg_clipfrac_lower": as_float(pg_clipfrac_lower),
    }


def _clip_range(config: Any) -> tuple[float, float]:
    clip_ratio = cfg_get(config, "clip_ratio", 0.2)
    return cfg_get(config, "clip_ratio_low", clip_ratio), cfg_get(config, "clip_ratio_high", clip_ratio)


# ------------------------------------------------------------------------------------------------ policy losses


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with dual clip
    (Ye et al. 2019, https://arxiv.org/abs/1912.09729) and asymmetric clip-higher (DAPO).

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = max(-A*ratio, -A*clip(ratio, 1-eps_low, 1+eps_high));
    for A < 0: L = min(L, -A*clip_ratio_c). Config: clip_ratio (0.2), clip_ratio_low/high (default clip_ratio),
    clip_ratio_c (3.0, must be > 1). Shapes: all (bs, response_length).
    """
    clip_low, clip_high = _clip_range(config)
    clip_ratio_c = cfg_get(config, "clip_ratio_c", 3.0)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")

    log_ratio, ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    dual_clipped = torch.min(pg_losses3, clipped)
    pg_clipfrac_lower = verl_F.masked_mean(torch.gt(clipped, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, dual_clipped, clipped)
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

    Sequence ratio s_i = exp(mean_t(logp - old_logp)); per token s_{i,t} = sg[s_i] * pi / sg[pi], i.e.
    log s_{i,t} = sg[log s_i] + logp - sg[logp], clamped at 10. L = max(-A*s, -A*clip(s, 1-eps_low, 1+eps_high)).
    Always aggregated "seq-mean-token-mean" whatever `loss_agg_mode` says (verl does the same).
    """
    clip_low, clip_high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, "seq-mean-token-mean", config, rollout_is_weights
    )

    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, https://arxiv.org/abs/2505.22617).

    PPO clipped loss, plus: among the tokens not already clipped whose covariance
    cov = (A - mean A) * (logp - mean logp) lies in (clip_cov_lb, clip_cov_ub), a random
    max(1, int(clip_cov_ratio * n_tokens)) of them get no gradient (loss zeroed). Config.policy_loss:
    clip_cov_ratio (0.0002), clip_cov_lb (1.0), clip_cov_ub (5.0). pg_clipfrac = share of zeroed tokens.
    """
    policy_cfg = cfg_get(config, "policy_loss", None)
    clip_cov_ratio = cfg_get(policy_cfg, "clip_cov_ratio", 0.0002)
    clip_cov_lb = cfg_get(policy_cfg, "clip_cov_lb", 1.0)
    clip_cov_ub = cfg_get(policy_cfg, "clip_cov_ub", 5.0)
    if clip_cov_ratio <= 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    clip_low, clip_high = _clip_range(config)

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_by_ppo = (pg_losses2 > pg_losses1) & (response_mask > 0)

    cov = (advantages - verl_F.masked_mean(advantages, response_mask)) * (
        log_prob - verl_F.masked_mean(log_prob.detach(), response_mask)
    )
    cov = cov.detach().masked_fill((response_mask == 0) | clipped_by_ppo, -torch.inf)
    candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & (response_mask > 0))
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates), device=candidates.device)[:clip_num]]
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_clipfrac = verl_F.masked_mean((keep == 0).float(), response_mask)

    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617).

    Unclipped surrogate L = -A * ratio; on the max(1, int(kl_cov_ratio * n_tokens)) tokens with the largest
    covariance (A - mean A) * (logp - mean logp) add ppo_kl_coef * |logp - old_logp|. Config.policy_loss:
    kl_cov_ratio (0.0002), ppo_kl_coef (0.1). Metric actor/ppo_kl is the mean |logp - old_logp|, as in verl.
    """
    policy_cfg = cfg_get(config, "policy_loss", None)
    kl_cov_ratio = cfg_get(policy_cfg, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = cfg_get(policy_cfg, "ppo_kl_coef", 0.1)
    if kl_cov_ratio <= 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")

    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    ppo_kl_abs = verl_F.masked_mean(abs_kl, response_mask)
    pg_losses = -advantages * ratio

    valid = response_mask > 0
    valid_flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(valid_flat_idx) > 0:
        valid_adv = advantages[valid].detach()
        valid_logp = log_prob[valid].detach()
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        k = max(1, int(len(cov) * kl_cov_ratio))
        top_flat_idx = valid_flat_idx[torch.topk(cov, k, largest=True).indices]
        penalise = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        penalise[top_flat_idx] = True
        pg_losses = torch.where(penalise.reshape(advantages.shape), pg_losses + ppo_kl_coef * abs_kl, pg_losses)

    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return pg_loss, _metrics(0.0, ppo_kl_abs, 0.0)


def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain REINFORCE (Williams 1992; AReaL's REINFORCE loss): L = -logp * A, on-policy, no importance ratio."""
    pg_loss = _aggregate(
        -log_prob * advantages,
        old_log_prob,
        rollout_log_probs,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )
    ppo_kl = verl_F.masked_mean(old_log_prob - log_prob, response_mask)
    return pg_loss, _metrics(0.0, ppo_kl, 0.0)


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Policy Gradient loss (Chu et al. 2025, https://arxiv.org/abs/2504.02546): L = -logp * A, no ratio,
    no clip; pair it with the `gpg` advantage estimator. The same loss as `reinforce`, registered under GPG's name."""
    return compute_policy_loss_reinforce(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs, rollout_is_weights
    )


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance weight, never the gradient.

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = -sg[clip(ratio, 1-eps_low, 1+eps_high)] * A * logp, so every
    token keeps a REINFORCE gradient. pg_clipfrac = share of tokens whose ratio was clipped.
    """
    clip_low, clip_high = _clip_range(config)
    log_ratio, ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = verl_F.masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


def compute_policy_loss_topr(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, https://arxiv.org/abs/2503.14286; ROLL's `topr`).

    Tokens with A > 0: L = -w_pos * A * logp (SFT-like, no importance weight); tokens with A <= 0:
    L = -w_neg * sg[clip(ratio, 0, 1)] * A * logp. Config: topr_positive_weight, topr_negative_weight (1.0).
    pg_clipfrac = share of negative tokens whose ratio exceeded 1.
    The split: the paper's T+/T- are the trajectories with positive/negative (baseline-subtracted) reward; a policy
    loss sees only advantages, so here it is the sign of A. ROLL splits by the raw sequence score (score > 0)
    instead; the two differ only for samples whose score and advantage have opposite signs (possible with a
    baseline, e.g. GRPO's group mean): such a sample gets the other weight and, off-policy, the other branch.
    """
    w_pos = cfg_get(config, "topr_positive_weight", 1.0)
    w_neg = cfg_get(config, "topr_negative_weight", 1.0)
    log_ratio, ratio = _clamped_log_ratio(log_prob, old_log_prob)
    positive = advantages > 0
    positive_losses = -w_pos * advantages * log_prob
    negative_losses = -w_neg * torch.clamp(ratio, 0.0, 1.0).detach() * advantages * log_prob
    pg_losses = torch.where(positive, positive_losses, negative_losses)
    pg_loss = _aggregate(
        pg_losses, old_log_prob, rollout_log_probs, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    pg_clipfrac = verl_F.masked_mean(((ratio > 1.0) & ~positive).float(), response_mask)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


# ------------------------------------------------------------------------------------------------ registration

# core_algos registers each under its name (verl's `register_policy_loss` names).
BUILTIN_POLICY_LOSSES: dict[str, Any] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "gpg": compute_policy_loss_gpg,
    "cispo": compute_policy_loss_cispo,
    "reinforce": compute_policy_loss_reinforce,
    "topr": compute_policy_loss_topr,
}
