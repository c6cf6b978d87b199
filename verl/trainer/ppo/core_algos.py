"""PPO-family algorithm maths behind registries: verl's `verl.trainer.ppo.core_algos` surface.

Owns the advantage-estimator and policy-loss registries (`register_adv_est`, `get_adv_estimator_fn`,
`AdvantageEstimator`, `register_policy_loss`, `get_policy_loss_fn`), value and entropy losses, `compute_rewards`,
the deprecated `compute_policy_loss`, `get_kl_controller`, PF-PPO resampling and `compute_advantage`. Registers
the built-ins of `advantage*.py` and `policy_loss*.py` and re-exports them with `kl.py` and `loss_aggregation.py`
(none of which imports this module). Layer 3: no models, Ray or I/O.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.advantage import (
    BUILTIN_ADV_ESTIMATORS,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from verl.trainer.ppo.advantage_variants import (
    VARIANT_ADV_ESTIMATORS,
    compute_gdpo_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from verl.trainer.ppo.kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    kl_penalty_forward,
)
from verl.trainer.ppo.loss_aggregation import LOSS_AGG_MODES, agg_loss, cfg_get
from verl.trainer.ppo.policy_loss import (
    BUILTIN_POLICY_LOSSES,
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
from verl.trainer.ppo.policy_loss_bypass import compute_policy_loss_bypass_mode
from verl.trainer.ppo.policy_loss_variants import (
    VARIANT_POLICY_LOSSES,
    PolicyLossFn,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_sapo,
)

if TYPE_CHECKING:
    from verl.protocol import DataProto

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "GLOBAL_BATCH_KEYS",
    "KL_PENALTY_MODES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLossFn",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_pf_ppo_reweight_data",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_topr",
    "compute_policy_loss_vanilla",
    "compute_reinforce_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "kl_penalty_forward",
    "register_adv_est",
    "register_policy_loss",
]


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
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


# The registries are module globals looked up at call time (a test may swap in a new dict, as verl's tests do).
ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def _same_function(a: Callable, b: Callable) -> bool:
    """The same function, or the same definition seen again after a module re-import."""
    return a is b or (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under a name (a str or an `AdvantageEstimator`); registering
    another function under a taken name raises ValueError. Returns the function unchanged."""

    def decorator(fn: Callable) -> Callable:
        name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and not _same_function(existing, fn):
            raise ValueError(f"Adv estimator {name} has already been registered: {existing} vs {fn}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    """The estimator registered under `name_or_enum` (case-sensitive); ValueError if unknown."""
    name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"Unknown advantage estimator simply: {name}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss `fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_log_probs) -> (loss, metrics)` under `name`."""

    def decorator(fn: Callable) -> Callable:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and not _same_function(existing, fn):
            raise ValueError(f"Policy loss {name} has already been registered: {existing} vs {fn}")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered under `name`; ValueError listing the registered names if unknown."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


for _name, _fn in {**BUILTIN_ADV_ESTIMATORS, **VARIANT_ADV_ESTIMATORS}.items():
    register_adv_est(_name)(_fn)
for _name, _fn in {**BUILTIN_POLICY_LOSSES, **VARIANT_POLICY_LOSSES}.items():
    register_policy_loss(_name)(_fn)
register_policy_loss("bypass_mode")(compute_policy_loss_bypass_mode)  # algorithm.rollout_correction.bypass_mode


# ----------------------------------------------------------------------------------------- rewards, losses
def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """KL-penalised token rewards: scores - kl_ratio * (old_log_prob - ref_log_prob). All (bs, response_length)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deprecated functional dual-clip PPO loss (use `compute_policy_loss_vanilla`); verl still ships it.

    The same numbers as the "vanilla" loss with clip_ratio = `cliprange`, aggregated locally (no global batch
    info). Returns `(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)` as tensors.
    """
    warnings.warn(
        "compute_policy_loss is deprecated; use verl.trainer.ppo.core_algos.compute_policy_loss_vanilla",
        DeprecationWarning,
        stacklevel=2,
    )
    if not clip_ratio_c > 1.0:
        raise ValueError(
            f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, got {clip_ratio_c}."
        )
    config = {
        "clip_ratio": cliprange,
        "clip_ratio_low": cliprange if cliprange_low is None else cliprange_low,
        "clip_ratio_high": cliprange if cliprange_high is None else cliprange_high,
        "clip_ratio_c": clip_ratio_c,
    }
    pg_loss, metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, config=config
    )
    as_tensor = lambda name: torch.tensor(metrics[name], device=pg_loss.device)  # noqa: E731
    return pg_loss, as_tensor("actor/pg_clipfrac"), as_tensor("actor/ppo_kl"), as_tensor("actor/pg_clipfrac_lower")


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
    ctrl_type = cfg_get(kl_ctrl_config, "type", None)
    kl_coef = cfg_get(kl_ctrl_config, "kl_coef", 0.001)
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        horizon = cfg_get(kl_ctrl_config, "horizon", 10000)
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        return AdaptiveKLController(kl_coef, cfg_get(kl_ctrl_config, "target_kl", 0.1), horizon)
    raise ValueError(f"Unknown kl_ctrl.type {ctrl_type!r}; choose one of ['fixed', 'adaptive']")


def compute_pf_ppo_reweight_data(data: DataProto, reweight_method: str = "pow", weight_pow: float = 2.0) -> DataProto:
    """PF-PPO (Policy Filtration, https://arxiv.org/abs/2409.06957): resample the batch, with replacement, with
    weights from the sequence scores (sum of token_level_scores): "pow" |s|^weight_pow, "max_min" 1 for the
    highest and lowest score else 0, "max_random" 0.4 for the highest else 0.1 (+1e-8 each). Returns a new
    DataProto of the same size; meta_info lists of batch length are resampled too."""
    scores = data.batch["token_level_scores"].sum(dim=-1)
    with torch.no_grad():
        if reweight_method == "pow":
            weights = torch.pow(torch.abs(scores), weight_pow)
        elif reweight_method == "max_min":
            weights = ((scores == scores.max()) | (scores == scores.min())).float()
        elif reweight_method == "max_random":
            weights = torch.where(scores == scores.max(), 0.4, 0.1)
        else:
            raise ValueError(f"Unsupported reweight_method: {reweight_method!r}; allowed: pow, max_min, max_random")
        weights = torch.clamp(weights + 1e-8, min=1e-8)
    batch_size = scores.shape[0]
    sample = torch.multinomial(weights, batch_size, replacement=True)
    resampled = data.select_idxs(sample)
    resampled.meta_info = {
        key: [value[i] for i in sample.tolist()] if isinstance(value, list) and len(value) == batch_size else value
        for key, value in copy.deepcopy(data.meta_info).items()
    }
    return resampled


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
    written back), values (gae), reward_baselines (remax), old_log_probs, sum_pi_squared and rollout_is_weights
    (optimal_token_baseline; rollout_is_weights None when absent) and non-tensor uid (group index). The estimator
    receives exactly the arguments its signature names among token_level_rewards, response_mask, index, values,
    gamma, lam, reward_baselines, old_log_probs, sum_pi_squared, rollout_is_weights, norm_adv_by_std_in_grpo,
    epsilon (only if config has one), config, batch and non_tensor_batch (gdpo's per-component rewards), so a user
    estimator with verl's signature runs unchanged. An estimator naming sum_pi_squared on a batch without it
    raises ValueError asking for actor_rollout_ref.actor.calculate_sum_pi_squared=True. Without `config` a dict of
    gamma, lam and norm_adv_by_std_in_grpo is passed. `num_repeat` is accepted for verl compatibility and unused.
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
    for key in ("values", "reward_baselines", "old_log_probs", "sum_pi_squared"):
        if key in batch.keys():
            available[key] = batch[key]
    available["rollout_is_weights"] = batch["rollout_is_weights"] if "rollout_is_weights" in batch.keys() else None
    available["batch"] = batch
    available["non_tensor_batch"] = data.non_tensor_batch
    if "sum_pi_squared" in inspect.signature(fn).parameters and "sum_pi_squared" not in available:
        raise ValueError(
            f"advantage estimator {name!r}: step-dependent optimal baseline requires sum_pi_squared from actor. "
            "Please set actor_rollout_ref.actor.calculate_sum_pi_squared=True in config."
        )
    if "uid" in data.non_tensor_batch:
        available["index"] = data.non_tensor_batch["uid"]
    if cfg_get(config, "epsilon", None) is not None:
        available["epsilon"] = cfg_get(config, "epsilon", None)

    advantages, returns = fn(**_estimator_kwargs(fn, available, name))
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data
