"""PPO-family algorithm maths as pure functions on tensors, each registered by name.

Owns: the advantage-estimator registry (`register_adv_est`, `get_adv_estimator_fn`, `AdvantageEstimator`) and
its estimators (gae, grpo, rloo, remax, reinforce_plus_plus, reinforce_plus_plus_baseline, opo, gpg, grpo_passk,
reinforce), the policy-loss registry (`register_policy_loss`, `get_policy_loss_fn`), `agg_loss`, the value and
entropy losses, `get_kl_controller` and the `DataProto` step the trainer calls: `compute_advantage`.
The built-in policy losses live in `policy_loss.py` and the KL estimators, controllers and `apply_kl_penalty` in
`kl.py`; this module re-exports them all, so `core_algos.<name>` keeps working and importing it registers the losses.
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
from verl.trainer.ppo.kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "LOSS_AGG_MODES",
    "KL_PENALTY_MODES",
    "GLOBAL_BATCH_KEYS",
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
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_gpg",
    "compute_policy_loss_cispo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_topr",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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


# ----------------------------------------------------------------------------------------- value, entropy


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


# ------------------------------------------------------------------------------------ built-in policy losses

# Imported last, on purpose: policy_loss.py imports `register_policy_loss`, `agg_loss` and `_cfg_get` from this
# module (at its own end), so they must be defined before this line runs. Importing it here registers the built-in
# losses whenever core_algos is imported and re-exports them under their old names.
from verl.trainer.ppo.policy_loss import (  # noqa: E402
    GLOBAL_BATCH_KEYS,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_reinforce,
    compute_policy_loss_topr,
    compute_policy_loss_vanilla,
)
