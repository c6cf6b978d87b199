"""Advantage estimators: pure functions from rewards (and values) to `(advantages, returns)`, verl's signatures.

Owns gae, grpo (and its vectorized twin), grpo_passk, rloo (and vectorized), opo, reinforce_plus_plus(_baseline),
remax, gpg, reinforce, and `BUILTIN_ADV_ESTIMATORS`, the table core_algos registers them from (under
`AdvantageEstimator` names). Does not own the registry (`register_adv_est`, `get_adv_estimator_fn`: core_algos).
Layer 3 (docs/architecture.md#layers): imports torch, numpy, `verl.utils.torch_functional` and `loss_aggregation.cfg_get` only.
Estimators run without gradient; all reward/mask/advantage tensors are (bs, response_length), `index` is (bs,).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.loss_aggregation import cfg_get


def _group_rows(index: np.ndarray | list, batch_size: int) -> dict[Any, list[int]]:
    """Row numbers of each group id, in first-seen order."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} rows")
    groups: dict[Any, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        groups[uid].append(row)
    return groups


# ------------------------------------------------------------------------------------- advantage estimators


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
    norm_by_std = cfg_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
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


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262).

    Discounted return-to-go G_t = r_t + gamma * G_{t+1} over the unmasked tokens, gamma = config["gamma"] (1.0 when
    absent): masked tokens (multi-turn observations, padding) are skipped, G carried past them unchanged, and get
    return 0. advantages = masked_whiten(G, mask) * mask; returns = G * mask.
    Shapes: (bs, response_length).
    """
    gamma = cfg_get(config, "gamma", 1.0)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            mask_t = response_mask[:, t]
            running = (token_level_rewards[:, t] + gamma * running) * mask_t + (1 - mask_t) * running
            returns[:, t] = running * mask_t
        advantages = verl_F.masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


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


def _group_ids(index: np.ndarray | list, scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Group ids 0..G-1 in first-seen order of the `index` values, as a long tensor on `scores`' device, and G."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} entries but the batch has {scores.shape[0]} rows")
    id_of: dict[Any, int] = {}
    ids = [id_of.setdefault(uid, len(id_of)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=scores.device), len(id_of)


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage without a Python loop over groups; equal to `compute_grpo_outcome_advantage`.

    Group means and unbiased stds come from scatter-adds (two passes, so near-equal rewards keep their precision);
    a group of one uses mean 0, std 1. A_i = (score_i - mean) / (std + epsilon), or score_i - mean.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids, num_groups = _group_ids(index, scores)
        counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
            0, ids, torch.ones_like(scores)
        )
        sums = torch.zeros_like(counts).index_add_(0, ids, scores)
        mean = sums / counts
        sq_dev = torch.zeros_like(counts).index_add_(0, ids, (scores - mean[ids]) ** 2)
        std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
        single = counts < 2
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
        centred = scores - mean[ids]
        scalars = centred / (std[ids] + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO without a Python loop over groups; equal to `compute_rloo_outcome_advantage`.

    In a group of n > 1: A_i = (n * score_i - sum of the group) / (n - 1); a group of one gets 0, as in verl's
    vectorized version (the loop version keeps its score).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids, num_groups = _group_ids(index, scores)
        counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
            0, ids, torch.ones_like(scores)
        )
        sums = torch.zeros_like(counts).index_add_(0, ids, scores)
        n = counts[ids]
        advantages = ((n * scores - sums[ids]) / (n - 1).clamp(min=1)) * (n > 1)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


BUILTIN_ADV_ESTIMATORS: dict[str, Any] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "reinforce": compute_reinforce_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
}
