"""KL between the actor and the reference policy: per-token estimators, KL-coefficient controllers, KL in reward.

Owns: `kl_penalty` (the k1/abs/k2/k3 estimators and their "+" straight-through variants), `kl_penalty_forward`,
`FixedKLController`, `AdaptiveKLController` and the `DataProto` step `apply_kl_penalty`. `get_kl_controller` (reads config) stays in
core_algos, which re-exports everything here. Layer 3 (docs/architecture.md#layers): imports torch, numpy and
`verl.utils.torch_functional` only (DataProto for type hints); must not import core_algos, models, Ray or I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

import verl.utils.torch_functional as verl_F

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "KL_PENALTY_MODES",
    "kl_penalty",
    "kl_penalty_forward",
    "FixedKLController",
    "AdaptiveKLController",
    "apply_kl_penalty",
]

KL_PENALTY_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The value of the KL estimator `kl_penalty` (no "+" suffix; see `kl_penalty`). Shapes: (bs, response_length)."""
    return _kl_value(logprob, ref_logprob, kl_penalty)


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
