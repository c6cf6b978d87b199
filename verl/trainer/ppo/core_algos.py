"""PPO-family algorithm maths as pure functions on tensors, each registered by name.

Owns: the advantage-estimator registry (`register_adv_est`, `get_adv_estimator_fn`, `AdvantageEstimator`) and
its estimators (gae, grpo, rloo, remax, reinforce_plus_plus, reinforce_plus_plus_baseline, opo, gpg, grpo_passk,
reinforce), the policy-loss registry (`register_policy_loss`, `get_policy_loss_fn`) and its losses (vanilla, gspo,
clip_cov, kl_cov, gpg, cispo, reinforce, topr), `agg_loss`, `kl_penalty`, the KL controllers, the value and
entropy losses, and the two `DataProto` steps the trainer calls: `apply_kl_penalty` and `compute_advantage`.
Layer 3 (DESIGN.md): imports torch, numpy, `verl.utils.torch_functional` and `verl.protocol` only; no models,
Ray or I/O. The numbers follow verl 0.9.1 as written in specs/core_algos.md. Estimators run without gradient.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "AdvantageEstimator",
    "register_adv_est",
    "get_adv_estimator_fn",
    "register_policy_loss",
    "get_policy_loss_fn",
    "agg_loss",
    "kl_penalty",
    "compute_value_loss",
    "compute_entropy_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
    "compute_advantage",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTY_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


# ----------------------------------------------------------------------------------------------- registries


class AdvantageEstimator(str, Enum):
    """Names of the built-in advantage estimators (any registered string name works too)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable] = {}


def _register(registry: dict[str, Callable], kind: str, name: str, fn: Callable) -> None:
    existing = registry.get(name)
    same = existing is fn or (
        existing is not None
        and (existing.__module__, existing.__qualname__) == (fn.__module__, fn.__qualname__)  # module re-import
    )
    if existing is not None and not same:
        raise ValueError(
            f"{kind} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; pick another name"
        )
    registry[name] = fn


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under a name (a str or an `AdvantageEstimator`)."""
    name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum

    def decorator(fn: Callable) -> Callable:
        _register(ADV_ESTIMATOR_REGISTRY, "advantage estimator", name, fn)
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    """The estimator registered under `name_or_enum`; ValueError listing the registered names if unknown."""
    name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"Unknown advantage estimator {name!r}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss `fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_log_probs) -> (loss, metrics)` under `name`."""

    def decorator(fn: Callable) -> Callable:
        _register(POLICY_LOSS_REGISTRY, "policy loss", name, fn)
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered under `name`; ValueError listing the registered names if unknown."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unknown policy loss {name!r}; registered: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


# ------------------------------------------------------------------------------------------------- helpers


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    """config[key] for a dict / DictConfig / dataclass config; `default` when config, key or value is None."""
    if config is None:
        return default
    value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


def _group_rows(index: np.ndarray | list, batch_size: int) -> dict[Any, list[int]]:
    """Row numbers of each group id, in first-seen order."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} rows")
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        groups[uid].append(row)
    return groups


# ------------------------------------------------------------------------------------- advantage estimators


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438).

    Backwards over t: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}. On masked-out
    tokens (padding, tool observations) the running next value and A are carried through unchanged.
    returns = A + V (before whitening); advantages = masked_whiten(A, mask).
    Shapes: all inputs and outputs (bs, response_length).
    """
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        gae_reversed = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            mask_t = response_mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_value = values[:, t] * mask_t + (1 - mask_t) * next_value
            last_gae = gae_t * mask_t + (1 - mask_t) * last_gae
            gae_reversed.append(last_gae)
        gae = torch.stack(gae_reversed[::-1], dim=1)
        returns = gae + values
        advantages = verl_F.masked_whiten(gae, response_mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (DeepSeekMath, https://arxiv.org/abs/2402.03300).

    score_i = sum_t r_{i,t}; per group (same `index`): A_i = (score_i - mean) / (std + epsilon), std unbiased
    (`torch.std`); a group of one uses mean 0, std 1. With `norm_adv_by_std_in_grpo=False`: A_i = score_i - mean
    (Dr.GRPO, https://arxiv.org/abs/2503.20783). A_i is broadcast over the response tokens; returns = advantages.
    Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            group = scores[rows]
            if len(rows) == 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                mean, std = torch.mean(group), torch.std(group)
            centred = group - mean
            advantages[rows] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO advantage (Chen et al. 2025, https://arxiv.org/abs/2503.19595).

    Per group only the best response gets a non-zero advantage: r_max - r_second_max, divided by
    (group std + epsilon) when `norm_adv_by_std_in_grpo` (read from `config` when given, as verl does).
    Every group needs at least 2 responses. Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    norm_by_std = _cfg_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = torch.zeros_like(scores)
        for uid, rows in _group_rows(index, scores.shape[0]).items():
            group = scores[rows]
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 samples per group; group {uid!r} has {len(rows)}")
            top2, top2_pos = torch.topk(group, 2)
            advantage = top2[0] - top2[1]
            if norm_by_std:
                advantage = advantage / (torch.std(group) + epsilon)
            advantages[rows[int(top2_pos[0])]] = advantage
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, https://arxiv.org/abs/2501.03262).

    score_i minus its group mean (a group of one: mean 0), broadcast over the response, then whitened over the
    whole batch: A = masked_whiten(centred * mask, mask) * mask. returns = advantages.
    Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centred = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            group = scores[rows]
            centred[rows] = group - (torch.tensor(0.0) if len(rows) == 1 else torch.mean(group))
        centred = centred.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
        advantages = verl_F.masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740).

    In a group of n > 1: A_i = score_i - mean of the other n - 1 scores = score_i * n/(n-1) - mean * n/(n-1).
    A group of one keeps its score. Broadcast over the response; returns = advantages.
    Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = scores.clone()
        for rows in _group_rows(index, scores.shape[0]).values():
            n = len(rows)
            if n > 1:
                group = scores[rows]
                advantages[rows] = group * n / (n - 1) - torch.mean(group) * n / (n - 1)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.OPO)
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, https://arxiv.org/abs/2505.23585).

    baseline = sum_j |y_j| * score_j / sum_j |y_j| over the group (|y| = response length from the mask);
    a group of one has baseline 0. A_i = score_i - baseline, broadcast over the response; returns = advantages.
    Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    with torch.no_grad():
        lengths = response_mask.sum(dim=-1)
        scores = token_level_rewards.sum(dim=-1)
        advantages = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            group, group_len = scores[rows], lengths[rows]
            baseline = torch.tensor(0.0) if len(rows) == 1 else (group_len * group).sum() / group_len.sum()
            advantages[rows] = group - baseline
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262).

    Discounted return-to-go G_t = r_t + gamma * G_{t+1} with gamma = config["gamma"] (1.0 when absent); masked
    tokens are skipped (G carried through unchanged). advantages = masked_whiten(G, mask) * mask; returns = G.
    Shapes: (bs, response_length).
    """
    gamma = _cfg_get(config, "gamma", 1.0)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            mask_t = response_mask[:, t]
            running = (token_level_rewards[:, t] + gamma * running) * mask_t + (1 - mask_t) * running
            returns[:, t] = running
        advantages = verl_F.masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): the greedy response's reward is the baseline.

    returns = reverse cumulative sum of rewards * mask; advantages = returns - baseline * mask (no whitening).
    Shapes: rewards/mask (bs, response_length), reward_baselines (bs,).
    """
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (Chu et al. 2025, https://arxiv.org/abs/2504.02546).

    A_i = alpha * (score_i - group mean) / f_norm with alpha = bs / max(1, number of non-zero scores) (the
    argument `alpha` is replaced by that batch correction, as in verl); a group of one has mean 0.
    Broadcast over the response; returns = advantages. Shapes: rewards/mask (bs, response_length), index (bs,).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        advantages = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0]).values():
            group = scores[rows]
            mean = torch.tensor(0.0) if len(rows) == 1 else torch.mean(group)
            advantages[rows] = alpha * (group - mean) / f_norm
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce")
def compute_reinforce_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain REINFORCE with a batch-mean baseline (Williams 1992; ROLL's `reinforce` with batch mean normalisation).

    A_i = score_i - mean_j score_j over the whole batch, broadcast over the response; returns = advantages.
    Shapes: (bs, response_length).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        advantages = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return advantages, advantages


# ------------------------------------------------------------------------------------------- loss aggregation


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss (bs, response_length) of one micro-batch into a scalar.

    Correct under data parallelism: each rank passes the global counts and `dp_size`; the gradient all-reduce
    mean over ranks then yields the loss of the whole global batch.
      token-mean:              masked_sum / batch_num_tokens * dp_size  (batch_num_tokens: global token count)
      token-sum:               masked_sum * dp_size
      seq-mean-token-sum:      sum over sequences with any token of their token sums / global_batch_size * dp_size
      seq-mean-token-mean:     the same with per-sequence token means (denominator + 1e-8)
      seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default: loss_mask.shape[-1], Dr.GRPO)
    Without global counts (dp_size 1) the local ones are used; an empty micro-batch gives 0, not NaN.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(f"token-mean with dp_size={dp_size} needs batch_num_tokens (the global token count)")
            batch_num_tokens = loss_mask.sum().clamp(min=1)
        return verl_F.masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return verl_F.masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        token_counts = loss_mask.sum(dim=-1)
        seq_losses = verl_F.masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (token_counts + 1e-8)
        seq_mask = (token_counts > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"{loss_agg_mode} with dp_size={dp_size} needs global_batch_size (global sequences)")
            global_batch_size = seq_mask.sum().clamp(min=1)
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    raise ValueError(f"Invalid loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")


def _agg_kwargs(config: Any) -> dict[str, Any]:
    """agg_loss's global-batch arguments from config.global_batch_info (and config.loss_scale_factor)."""
    info = dict(_cfg_get(config, "global_batch_info", None) or {})
    unknown = sorted(set(info) - set(GLOBAL_BATCH_KEYS))
    if unknown:
        raise ValueError(f"global_batch_info has unknown keys {unknown}; allowed: {list(GLOBAL_BATCH_KEYS)}")
    if "loss_scale_factor" not in info and _cfg_get(config, "loss_scale_factor", None) is not None:
        info["loss_scale_factor"] = _cfg_get(config, "loss_scale_factor", None)
    return info


def _apply_tis(
    pg_losses: torch.Tensor, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any
) -> torch.Tensor:
    """Truncated importance sampling (verl's TIS): pg_losses * min(exp(old_logp - rollout_logp), cap), if cap > 0."""
    cap = _cfg_get(config, "tis_imp_ratio_cap", -1)
    if cap <= 0 or rollout_log_probs is None:
        return pg_losses
    weights = torch.exp(old_log_prob - rollout_log_probs).clamp(max=cap).detach()
    return pg_losses * weights


def _metrics(pg_clipfrac: Any = 0.0, ppo_kl: Any = 0.0, pg_clipfrac_lower: Any = 0.0) -> dict[str, float]:
    def as_float(value: Any) -> float:
        return value.detach().item() if isinstance(value, torch.Tensor) else float(value)

    return {
        "actor/pg_clipfrac": as_float(pg_clipfrac),
        "actor/ppo_kl": as_float(ppo_kl),
        "actor/pg_clipfrac_lower": as_float(pg_clipfrac_lower),
    }


def _clip_range(config: Any) -> tuple[float, float]:
    clip_ratio = _cfg_get(config, "clip_ratio", 0.2)
    return _cfg_get(config, "clip_ratio_low", clip_ratio), _cfg_get(config, "clip_ratio_high", clip_ratio)


# ------------------------------------------------------------------------------------------------ policy losses


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with dual clip
    (Ye et al. 2019, https://arxiv.org/abs/1912.09729) and asymmetric clip-higher (DAPO).

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = max(-A*ratio, -A*clip(ratio, 1-eps_low, 1+eps_high));
    for A < 0: L = min(L, -A*clip_ratio_c). Config: clip_ratio (0.2), clip_ratio_low/high (default clip_ratio),
    clip_ratio_c (3.0, must be > 1). Shapes: all (bs, response_length).
    """
    clip_low, clip_high = _clip_range(config)
    clip_ratio_c = _cfg_get(config, "clip_ratio_c", 3.0)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    dual_clipped = torch.min(pg_losses3, clipped)
    pg_clipfrac_lower = verl_F.masked_mean(torch.gt(clipped, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, dual_clipped, clipped)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
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
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_agg_kwargs(config))

    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, https://arxiv.org/abs/2505.22617).

    PPO clipped loss, plus: among the tokens not already clipped whose covariance
    cov = (A - mean A) * (logp - mean logp) lies in (clip_cov_lb, clip_cov_ub), a random
    max(1, int(clip_cov_ratio * n_tokens)) of them get no gradient (loss zeroed). Config.policy_loss:
    clip_cov_ratio (0.0002), clip_cov_lb (1.0), clip_cov_ub (5.0). pg_clipfrac = share of zeroed tokens.
    """
    policy_cfg = _cfg_get(config, "policy_loss", None)
    clip_cov_ratio = _cfg_get(policy_cfg, "clip_cov_ratio", 0.0002)
    clip_cov_lb = _cfg_get(policy_cfg, "clip_cov_lb", 1.0)
    clip_cov_ub = _cfg_get(policy_cfg, "clip_cov_ub", 5.0)
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
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617).

    Unclipped surrogate L = -A * ratio; on the max(1, int(kl_cov_ratio * n_tokens)) tokens with the largest
    covariance (A - mean A) * (logp - mean logp) add ppo_kl_coef * |logp - old_logp|. Config.policy_loss:
    kl_cov_ratio (0.0002), ppo_kl_coef (0.1). Metric actor/ppo_kl is the mean |logp - old_logp|, as in verl.
    """
    policy_cfg = _cfg_get(config, "policy_loss", None)
    kl_cov_ratio = _cfg_get(policy_cfg, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = _cfg_get(policy_cfg, "ppo_kl_coef", 0.1)
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

    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(0.0, ppo_kl_abs, 0.0)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Policy Gradient loss (Chu et al. 2025, https://arxiv.org/abs/2504.02546): L = -logp * A, no ratio,
    no clip; pair it with the `gpg` advantage estimator."""
    pg_losses = _apply_tis(-log_prob * advantages, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    ppo_kl = verl_F.masked_mean(old_log_prob - log_prob, response_mask)
    return pg_loss, _metrics(0.0, ppo_kl, 0.0)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance weight, never the gradient.

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = -sg[clip(ratio, 1-eps_low, 1+eps_high)] * A * logp, so every
    token keeps a REINFORCE gradient. pg_clipfrac = share of tokens whose ratio was clipped.
    """
    clip_low, clip_high = _clip_range(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = verl_F.masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain REINFORCE (Williams 1992; AReaL's REINFORCE loss): L = -logp * A, on-policy, no importance ratio."""
    pg_losses = _apply_tis(-log_prob * advantages, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    ppo_kl = verl_F.masked_mean(old_log_prob - log_prob, response_mask)
    return pg_loss, _metrics(0.0, ppo_kl, 0.0)


@register_policy_loss("topr")
def compute_policy_loss_topr(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, https://arxiv.org/abs/2503.14286; ROLL's `topr`).

    Tokens with A > 0: L = -w_pos * A * logp (SFT-like, no importance weight); tokens with A <= 0:
    L = -w_neg * sg[clip(ratio, 0, 1)] * A * logp. ROLL splits by the sequence score's sign; here the sign of
    the advantage is used (the same for outcome rewards). Config: topr_positive_weight, topr_negative_weight (1.0).
    pg_clipfrac = share of negative tokens whose ratio exceeded 1.
    """
    w_pos = _cfg_get(config, "topr_positive_weight", 1.0)
    w_neg = _cfg_get(config, "topr_negative_weight", 1.0)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    positive = advantages > 0
    positive_losses = -w_pos * advantages * log_prob
    negative_losses = -w_neg * torch.clamp(ratio, 0.0, 1.0).detach() * advantages * log_prob
    pg_losses = torch.where(positive, positive_losses, negative_losses)
    pg_losses = _apply_tis(pg_losses, old_log_prob, rollout_log_probs, config)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    pg_clipfrac = verl_F.masked_mean(((ratio > 1.0) & ~positive).float(), response_mask)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, 0.0)


# ------------------------------------------------------------------------------------- value, entropy, KL


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO): clipped = values +- cliprange_value;
    vf_loss = 0.5 * agg_loss(max((vpred - R)^2, (clipped - R)^2)).

    Returns: vf_loss (scalar) and vf_clipfrac (0-d detached tensor: share of tokens where the clipped term won).
    Shapes: all inputs (bs, response_length).
    """
    vpred_clipped = verl_F.clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(vf_losses1, vf_losses2),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = verl_F.masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """agg_loss of the per-token categorical entropy. logits (bs, response_length, vocab), mask (bs, response_length)."""
    return agg_loss(verl_F.entropy_from_logits(logits), response_mask, loss_agg_mode)


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str) -> torch.Tensor:
    if mode in ("kl", "k1"):
        return logprob - ref_logprob
    if mode == "abs":
        return (logprob - ref_logprob).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if mode in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    if mode == "full":
        raise ValueError("kl_penalty 'full' needs the whole vocabulary distribution and is not supported")
    modes = list(KL_PENALTY_MODES) + [m + "+" for m in KL_PENALTY_MODES]
    raise ValueError(f"Unknown kl_penalty {mode!r}; choose one of {modes}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman, http://joschu.net/blog/kl-approx.html).

    kl/k1: logp - ref; abs: |logp - ref|; mse/k2: 0.5 (logp - ref)^2;
    low_var_kl/k3: x = clamp(ref - logp, -20, 20), clamp(exp(x) - x - 1, -10, 10).
    A "+" suffix (e.g. "k3+") keeps the base estimator's value but takes the gradient of k2 (straight-through),
    which is the unbiased KL gradient; "k2+"/"mse+" are plain k2. Shapes: (bs, response_length).
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str) -> torch.Tensor:
    base = mode[:-1] if mode.endswith("+") else mode
    value = _kl_value(logprob, ref_logprob, base)
    if not mode.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    update: err = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + err * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """KL controller from config keys type (fixed | adaptive), kl_coef, target_kl, horizon."""
    ctrl_type = _cfg_get(kl_ctrl_config, "type", None)
    kl_coef = _cfg_get(kl_ctrl_config, "kl_coef", 0.001)
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        horizon = _cfg_get(kl_ctrl_config, "horizon", 10000)
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        return AdaptiveKLController(kl_coef, _cfg_get(kl_ctrl_config, "target_kl", 0.1), horizon)
    raise ValueError(f"Unknown kl_ctrl.type {ctrl_type!r}; choose one of ['fixed', 'adaptive']")


# -------------------------------------------------------------------------------------- DataProto steps


def apply_kl_penalty(
    data: DataProto, kl_ctrl: FixedKLController | AdaptiveKLController, kl_penalty: str = "kl"
) -> tuple[DataProto, dict[str, float]]:
    """KL in the reward: token_level_rewards = token_level_scores - beta * kl(old_log_probs, ref_log_prob) * mask.

    Reads batch keys token_level_scores, old_log_probs, ref_log_prob, response_mask; writes token_level_rewards.
    Updates `kl_ctrl` with the batch mean of per-sequence mean KL and returns metrics
    actor/reward_kl_penalty (that KL) and actor/reward_kl_penalty_coeff (the beta used).
    """
    batch = data.batch
    response_mask = batch["response_mask"]
    kld = _kl_estimate(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty) * response_mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * kld
    current_kl = torch.mean(verl_F.masked_mean(kld, response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=batch.batch_size[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


def _estimator_kwargs(fn: Callable, available: dict[str, Any], name: str) -> dict[str, Any]:
    """The arguments `fn`'s signature asks for, taken from `available`; all of them if it has **kwargs."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    for pname, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname in available:
            kwargs[pname] = available[pname]
        elif param.default is param.empty:
            raise ValueError(
                f"advantage estimator {name!r} needs {pname!r}, which this batch does not provide; "
                f"available: {sorted(available)}"
            )
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        for key, value in available.items():
            kwargs.setdefault(key, value)
    return kwargs


def compute_advantage(
    data: DataProto,
    adv_estimator: str | AdvantageEstimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> DataProto:
    """Run the registered estimator `adv_estimator` on a batch and write `advantages` and `returns` (bs, response_length).

    Reads token_level_rewards, response_mask (derived from the response part of attention_mask when missing, and
    written back), values (gae), reward_baselines (remax) and non-tensor uid (group index). The estimator receives
    exactly the arguments its signature names among token_level_rewards, response_mask, index, values, gamma, lam,
    reward_baselines, norm_adv_by_std_in_grpo, epsilon (only if config has one) and config, so a user estimator with
    verl's signature runs unchanged. Without `config` a dict of gamma, lam and norm_adv_by_std_in_grpo is passed.
    `num_repeat` is accepted for verl compatibility and unused.
    """
    name = adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator
    fn = get_adv_estimator_fn(name)
    batch = data.batch
    if "response_mask" not in batch.keys():
        response_length = batch["token_level_rewards"].shape[-1]
        batch["response_mask"] = batch["attention_mask"][:, -response_length:]
    if config is None:
        config = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}

    available: dict[str, Any] = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "config": config,
    }
    for key in ("values", "reward_baselines"):
        if key in batch.keys():
            available[key] = batch[key]
    if "uid" in data.non_tensor_batch:
        available["index"] = data.non_tensor_batch["uid"]
    if _cfg_get(config, "epsilon", None) is not None:
        available["epsilon"] = _cfg_get(config, "epsilon", None)

    advantages, returns = fn(**_estimator_kwargs(fn, available, name))
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data
