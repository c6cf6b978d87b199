"""Diagnostics of the gap between the policy that sampled the rollout and the policy being trained.

Owns the metric half of verl 0.9.1's rollout correction (`algorithm.rollout_correction`): statistics of the
importance-sampling weights (`compute_is_metrics`), of one rejection criterion (`compute_rs_metrics`), and the
off-policy diagnostics that need only the two log-probs (`compute_offpolicy_metrics`: KL, perplexities, chi-square;
`compute_rollout_corr_metrics_from_logprobs` adds the `rollout_corr/` prefix). Names and formulas are verl's; the
keys are returned without prefix except by the last function. `rollout_corr_helper` (the weights and masks) calls
these and re-exports them. Layer 3 (docs/architecture.md#layers): torch and `verl.utils.torch_functional` only.

Every tensor is (bs, response_length) unless said otherwise; `response_mask` is 1 on the tokens that count.
"""

from __future__ import annotations

from typing import Any

import torch

import verl.utils.torch_functional as verl_F

__all__ = [
    "SAFETY_BOUND",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rs_metrics",
]

# log-ratios are clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exp: exp(20) ~ 4.9e8, exp(-20) ~ 2.1e-9
SAFETY_BOUND = 20.0


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("-inf")).max().item()


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("inf")).min().item()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """sqrt(E[v^2] - E[v]^2) over the mask of v = clamp(values, low, high); 0 with fewer than two tokens."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    mean = verl_F.masked_mean(clamped, mask)
    var = verl_F.masked_mean(clamped.square(), mask) - mean.square()
    return torch.sqrt(var.clamp(min=0.0)).item()


def _std(values: torch.Tensor) -> float:
    """Unbiased std of a 1-D tensor, 0 for fewer than two entries."""
    return values.std().item() if values.numel() > 1 else 0.0


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """Statistics of the importance-sampling weights w (after truncation / IcePop) and of the raw ratios.

    `raw_rollout_is_weights`: the ratios before truncation, masked (0 on padding). `log_ratio_for_metrics`: the
    unclamped log-ratio, (bs, response_length) for `rollout_is="token"`, (bs, 1) (the per-sequence sum) for
    "sequence". The lower bound defaults to 1 / `rollout_is_threshold`. Keys (no prefix):
    - rollout_is_mean: masked mean of w; rollout_is_max / _min: token: masked max/min of w; sequence: exp of the
      max/min sequence log-ratio (the max clamped at SAFETY_BOUND), i.e. before truncation;
    - rollout_is_ratio_fraction_high / _low: share of tokens (token: raw ratio) or sequences (sequence: log-ratio
      against the log bounds) above the upper / below the lower bound;
    - rollout_is_std: masked std of clamp(w, 0, upper); rollout_is_eff_sample_size: 1 / E[(w' / E[w'])^2] of the
      same clamped w' (1 = all weights equal);
    - rollout_is_seq_mean / _std / _max / _min / _max_deviation (max |mean_t w - 1|) of the per-sequence mean
      weights, and rollout_is_seq_fraction_high / _low of the per-sequence mean raw ratios.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    upper = float(rollout_is_threshold)
    lower = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    metrics: dict[str, float] = {}
    if rollout_is == "sequence":
        log_upper = torch.log(torch.tensor(upper, device=rollout_is_weights.device))
        log_lower = torch.log(torch.tensor(lower, device=rollout_is_weights.device))
        metrics["rollout_is_max"] = torch.exp(log_ratio_for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_mean"] = verl_F.masked_mean(rollout_is_weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        metrics["rollout_is_mean"] = verl_F.masked_mean(rollout_is_weights, response_mask).item()
        high = (raw_rollout_is_weights > upper).float()
        low = (raw_rollout_is_weights < lower).float()
        metrics["rollout_is_ratio_fraction_high"] = verl_F.masked_mean(high, response_mask).item()
        metrics["rollout_is_ratio_fraction_low"] = verl_F.masked_mean(low, response_mask).item()
        metrics["rollout_is_max"] = _masked_max(rollout_is_weights, response_mask)
        metrics["rollout_is_min"] = _masked_min(rollout_is_weights, response_mask)

    metrics["rollout_is_std"] = _clamped_std(rollout_is_weights, response_mask, 0.0, upper)
    clamped = rollout_is_weights.clamp(min=0.0, max=upper)
    normalized = clamped / (verl_F.masked_mean(clamped, response_mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / verl_F.masked_mean(normalized.square(), response_mask).item()

    if rollout_is_weights.dim() > 1:
        seq_mean = verl_F.masked_mean(rollout_is_weights, response_mask, axis=-1)
        metrics["rollout_is_seq_mean"] = seq_mean.mean().item()
        metrics["rollout_is_seq_std"] = _std(seq_mean)
        metrics["rollout_is_seq_max"] = seq_mean.max().item()
        metrics["rollout_is_seq_min"] = seq_mean.min().item()
        metrics["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
        # the raw means: a mean of truncated weights can never exceed the upper bound
        raw_seq_mean = verl_F.masked_mean(raw_rollout_is_weights, response_mask, axis=-1)
        metrics["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
        metrics["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).float().mean().item()
    return metrics


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """Statistics of one rejection criterion's statistic, keys `rollout_rs_{option_name}_*` (no `rollout_corr/`).

    `rs_statistic`: (bs, response_length), a sequence statistic broadcast over its tokens when `level` is
    "sequence"; `per_sequence_values`: (bs,) that statistic per sequence (None: the masked token mean is used);
    `seq_valid_mask`: (bs,) sequences with at least one valid token. Thresholds are in the statistic's units (for
    k1 options the logs of the ratio bounds); the lower one counts only with `apply_lower_threshold`.
    Keys: _mean (token mean), _max / _min and _fraction_high / _low (per sequence for sequence level, per token
    otherwise), _std (of the statistic clamped to the bounds), and _seq_mean / _seq_std / _seq_max / _seq_min /
    _seq_max_deviation (max |value|, the ideal being 0) / _seq_fraction_high (/ _seq_fraction_low) over sequences.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    prefix = f"rollout_rs_{option_name}"
    upper, lower = rollout_rs_threshold, rollout_rs_threshold_lower
    seq_values = per_sequence_values
    if seq_values is None:
        seq_values = verl_F.masked_mean(rs_statistic, response_mask, axis=-1)
    if seq_values.dim() > 1:
        seq_values = seq_values.squeeze(-1)
    valid = seq_values[seq_valid_mask]
    by_sequence = level == "sequence" and valid.numel() > 0

    metrics: dict[str, float] = {f"{prefix}_mean": verl_F.masked_mean(rs_statistic, response_mask).item()}
    if by_sequence:
        metrics[f"{prefix}_max"] = valid.max().item()
        metrics[f"{prefix}_min"] = valid.min().item()
        metrics[f"{prefix}_fraction_high"] = (valid > upper).float().mean().item()
        metrics[f"{prefix}_fraction_low"] = (valid < lower).float().mean().item() if apply_lower_threshold else 0.0
    else:
        metrics[f"{prefix}_max"] = _masked_max(rs_statistic, response_mask)
        metrics[f"{prefix}_min"] = _masked_min(rs_statistic, response_mask)
        high = verl_F.masked_mean((rs_statistic > upper).float(), response_mask).item()
        low = verl_F.masked_mean((rs_statistic < lower).float(), response_mask).item()
        metrics[f"{prefix}_fraction_high"] = high
        metrics[f"{prefix}_fraction_low"] = low if apply_lower_threshold else 0.0
    clamp_low = lower if apply_lower_threshold else 0.0
    metrics[f"{prefix}_std"] = _clamped_std(rs_statistic, response_mask, clamp_low, upper)

    names = ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high")
    if valid.numel() == 0:
        metrics.update({f"{prefix}_{name}": 0.0 for name in (*names, "seq_fraction_low")})
        return metrics
    values = (valid.mean(), _std(valid), valid.max(), valid.min(), valid.abs().max(), (valid > upper).float().mean())
    metrics.update({f"{prefix}_{name}": float(value) for name, value in zip(names, values, strict=True)})
    if apply_lower_threshold:
        metrics[f"{prefix}_seq_fraction_low"] = (valid < lower).float().mean().item()
    return metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, Any]:
    """Off-policy diagnostics between the training policy (`old_log_prob`) and the rollout policy (no prefix).

    Per sequence i let m_i = mean_t log pi_train and r_i = mean_t log pi_rollout over its valid tokens, and per
    token log rho = log pi_train - log pi_rollout. Keys:
    - training_ppl = mean_i exp(-m_i), training_log_ppl = mean_i (-m_i); with rollout log-probs also
      rollout_ppl, rollout_log_ppl (the same of r_i);
    - kl = masked mean of (log pi_rollout - log pi_train), the direct estimator of KL(pi_rollout || pi_train);
      k3_kl = masked mean of (rho - log rho - 1);
    - log_ppl_diff (mean_i of d_i = r_i - m_i = log(training ppl / rollout ppl)), log_ppl_abs_diff (mean |d_i|),
      log_ppl_diff_max / _min, ppl_ratio = mean_i exp(d_i);
    - chi2_token = masked mean of rho^2 - 1 and chi2_seq = mean_i (prod_t rho)^2 - 1, with log rho and its
      per-sequence sum clamped to +-SAFETY_BOUND.
    """
    assert response_mask.any(), "Expected at least one valid token in response_mask"
    metrics: dict[str, Any] = {}
    train_mean = verl_F.masked_mean(old_log_prob, response_mask, axis=-1)
    metrics["training_ppl"] = torch.exp(-train_mean).mean().detach().item()
    metrics["training_log_ppl"] = (-train_mean).mean().detach().item()
    if rollout_log_prob is None:
        return metrics

    log_ratio = old_log_prob - rollout_log_prob
    metrics["kl"] = verl_F.masked_mean(rollout_log_prob - old_log_prob, response_mask).detach().item()
    metrics["k3_kl"] = verl_F.masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).detach().item()
    rollout_mean = verl_F.masked_mean(rollout_log_prob, response_mask, axis=-1)
    metrics["rollout_ppl"] = torch.exp(-rollout_mean).mean().detach().item()
    metrics["rollout_log_ppl"] = (-rollout_mean).mean().detach().item()
    diff = rollout_mean - train_mean
    metrics["log_ppl_diff"] = diff.mean().detach().item()
    metrics["log_ppl_abs_diff"] = diff.abs().mean().detach().item()
    metrics["log_ppl_diff_max"] = diff.max().detach().item()
    metrics["log_ppl_diff_min"] = diff.min().detach().item()
    metrics["ppl_ratio"] = torch.exp(diff).mean().detach().item()
    rho = torch.exp(log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics["chi2_token"] = (verl_F.masked_mean(rho.square(), response_mask) - 1.0).detach().item()
    seq_log_ratio = verl_F.masked_sum(log_ratio, response_mask, axis=-1).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    metrics["chi2_seq"] = (torch.exp(2.0 * seq_log_ratio).mean() - 1.0).detach().item()
    return metrics


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """`compute_offpolicy_metrics` of the current policy's `log_prob` against the rollout's, keys prefixed with
    `rollout_corr/` (verl calls this from the actor to follow the gap as the policy moves)."""
    metrics = compute_offpolicy_metrics(
        old_log_prob=log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask
    )
    return {f"rollout_corr/{key}": float(value) for key, value in metrics.items()}
