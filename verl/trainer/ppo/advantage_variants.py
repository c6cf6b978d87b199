"""verl's advantage estimators that need more than rewards and group ids: gdpo (per-component rewards from
`non_tensor_batch`), optimal_token_baseline and tir_optimal_token_baseline (per-token baselines from
`old_log_probs` and `sum_pi_squared`), in `VARIANT_ADV_ESTIMATORS`, which core_algos registers.
Layer 3: must not import core_algos. Estimators run without gradient; tensors (bs, response_length), `index` (bs,).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.advantage import _group_rows, compute_grpo_outcome_advantage
from verl.trainer.ppo.loss_aggregation import cfg_get

__all__ = [
    "VARIANT_ADV_ESTIMATORS",
    "compute_gdpo_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
]


# ------------------------------------------------------------------------------------------------------ gdpo
def _gdpo_component_rewards(
    config: Any, non_tensor_batch: dict, batch: Any, response_mask: torch.Tensor
) -> list[torch.Tensor]:
    """One (bs, response_length) reward tensor per key of `config.gdpo_reward_keys`: the key's per-sample score
    from `non_tensor_batch` at the last response token (by the response part of `batch["attention_mask"]`)."""
    keys = cfg_get(config, "gdpo_reward_keys", None)
    if not keys:
        raise ValueError(
            "GDPO requires 'algorithm.gdpo_reward_keys' listing the individual reward component keys returned "
            f"by compute_score (e.g. ['format_reward', 'accuracy_reward']); got {keys!r}"
        )
    device = response_mask.device
    prompt_length = batch["prompts"].size(1)
    last_token = batch["attention_mask"][:, prompt_length:].sum(dim=1) - 1
    rows = torch.arange(response_mask.shape[0], device=device)
    components = []
    for key in keys:
        if key not in non_tensor_batch:
            raise ValueError(
                f"GDPO reward key '{key}' not found in non_tensor_batch. Available keys: "
                f"{list(non_tensor_batch.keys())}. Make sure your compute_score returns a dict containing '{key}'."
            )
        score = torch.tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=device)
        rewards = torch.zeros_like(response_mask, dtype=torch.float32)
        rewards[rows, last_token] = score
        components.append(rewards)
    return components


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, Group reward-Decoupled normalization Policy Optimization (https://arxiv.org/abs/2601.05242).

    Each reward component k (the keys `config.gdpo_reward_keys`, read from `non_tensor_batch`) is normalised
    within its group first, as GRPO does: A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + epsilon) (or
    r_k - mean with `norm_adv_by_std_in_grpo=False`), so a dominant reward does not drown the weaker ones. Then
    A = masked_whiten(sum_k w_k * A_k, mask) * mask with w = `config.gdpo_reward_weights` (default all 1).
    Without `config`, `non_tensor_batch` or `batch` the one component is `token_level_rewards`.
    returns = advantages. Shapes: rewards/mask (bs, response_length), index (bs,); `batch` needs `prompts`
    (bs, prompt_length) and `attention_mask` (bs, prompt_length + response_length).
    """
    with torch.no_grad():
        components, weights = [token_level_rewards], None
        if config is not None and non_tensor_batch is not None and batch is not None:
            components = _gdpo_component_rewards(config, non_tensor_batch, batch, response_mask)
            weights = cfg_get(config, "gdpo_reward_weights", None)
        if weights is None:
            weights = [1.0] * len(components)
        elif len(weights) != len(components):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(weights)} entries but gdpo_reward_keys has "
                f"{len(components)}; give one weight per key or null for equal weights"
            )
        weights = torch.tensor(list(weights), dtype=torch.float32, device=token_level_rewards.device)
        total = None
        for weight, rewards in zip(weights, components):
            normalised, _ = compute_grpo_outcome_advantage(
                token_level_rewards=rewards,
                response_mask=response_mask,
                index=index,
                epsilon=epsilon,
                norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                config=config,
            )
            total = weight * normalised if total is None else total + weight * normalised
        advantages = verl_F.masked_whiten(total, response_mask) * response_mask
    return advantages, advantages


# ------------------------------------------------------------------------------------ optimal token baseline
def _path_variance(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """W_t = sum_{j<=t} mask_j * (1 - 2 pi_j + sum_v pi_j(v)^2) [* rho_j^2], pi_j = exp(old_log_probs_j)."""
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights**2
    return (per_token * response_mask).cumsum(dim=-1)


def _reward_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{j>=t} mask_j * r_j, (bs, response_length)."""
    return (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def _lone_longest(lengths: list[int]) -> tuple[int, int] | None:
    """(position in the group, second-largest length) when one member is strictly the longest, else None."""
    ordered = sorted(lengths)
    longest, second = ordered[-1], ordered[-2]
    if longest > second and lengths.count(longest) == 1:
        return lengths.index(longest), second
    return None


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (OTB): a baseline per group and per token position instead of one per trajectory.

    G_t = reward-to-go; W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2) is the cumulative path-variance proxy (the
    squared score norm ||s_j||^2), scaled token by token by rho_j^2 when `rollout_is_weights` is given. Within a
    group of N > 1: B_t = sum_i G_{i,t} W_{i,t} m_{i,t} / (sum_i W_{i,t} m_{i,t} + epsilon); a group of one has
    B = 0. With `handle_zero_tail`, a strictly longest trajectory gets B = 0 from the second-longest length on.
    advantages = (G - B) * mask; returns = G.
    Shapes: rewards, mask, old_log_probs, sum_pi_squared, rollout_is_weights (bs, response_length); index (bs,).
    """
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask)
        w_cumulative = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights)
        baselines = torch.zeros_like(returns)
        for rows in _group_rows(index, returns.shape[0]).values():
            if len(rows) == 1:
                continue
            mask = response_mask[rows]
            weight = w_cumulative[rows] * mask
            baselines[rows] = ((returns[rows] * weight).sum(dim=0) / (weight.sum(dim=0) + epsilon)).to(returns.dtype)
            if handle_zero_tail:
                lone = _lone_longest([int(n) for n in mask.sum(dim=-1).tolist()])
                if lone is not None:
                    baselines[rows[lone[0]], lone[1] :] = 0.0
        advantages = (returns - baselines) * response_mask
    return advantages, returns


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline for tool-integrated (multi-turn) responses: OTB over the policy's own tokens.

    G and W as in `compute_optimal_token_baseline_advantage`. Each row's masked-in tokens (the model's turns;
    tool observations are masked out) are first packed to the front, so the baseline of a group at step k
    compares every trajectory's k-th generated token, wherever it sits in the padded row:
    B_k = sum_i G_{i,k} W_{i,k} / (sum_i W_{i,k} + epsilon) (packed rows are 0 past their length). Rows without
    response tokens are left out of their group and get 0; a group of one has B = 0; `handle_zero_tail` zeroes
    B of a strictly longest trajectory from the second-longest length on. A = G - B, scattered back to the
    masked-in positions (0 elsewhere); returns = G.
    Shapes: rewards, mask, old_log_probs, sum_pi_squared, rollout_is_weights (bs, response_length); index (bs,).
    """
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, response_mask)
        w_cumulative = _path_variance(old_log_probs, sum_pi_squared, response_mask, rollout_is_weights)
        keep = response_mask.bool()
        lengths = keep.sum(dim=-1)
        packed_len = int(lengths.max().item()) if lengths.numel() > 0 else 0
        rows, cols = keep.nonzero(as_tuple=True)
        step = (keep.long().cumsum(dim=-1) - 1)[rows, cols]  # position of each kept token in its packed row
        packed_w = w_cumulative.new_zeros((returns.shape[0], packed_len))
        packed_g = torch.zeros_like(packed_w)
        packed_w[rows, step] = w_cumulative[rows, cols]
        packed_g[rows, step] = returns[rows, cols].to(packed_g.dtype)

        baselines = torch.zeros_like(packed_g)
        length_list = [int(n) for n in lengths.tolist()]
        for members in _group_rows(index, returns.shape[0]).values():
            members = [i for i in members if length_list[i] > 0]
            if len(members) < 2:
                continue
            w_group = packed_w[members]
            b_star = (packed_g[members] * w_group).sum(dim=0) / (w_group.sum(dim=0) + epsilon)
            baselines[members] = b_star.to(baselines.dtype)
            if handle_zero_tail:
                lone = _lone_longest([length_list[i] for i in members])
                if lone is not None:
                    baselines[members[lone[0]], lone[1] :] = 0.0

        packed_adv = packed_g - baselines
        advantages = torch.zeros_like(returns)
        advantages[rows, cols] = packed_adv[rows, step].to(advantages.dtype)
        advantages = advantages * response_mask
    return advantages, returns


VARIANT_ADV_ESTIMATORS: dict[str, Any] = {
    "gdpo": compute_gdpo_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_multi_turn_optimal_token_baseline_advantage,
}
