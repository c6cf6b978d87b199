"""Rollout correction (verl 0.9.1's `algorithm.rollout_correction`): importance weights and rejection masks for the
gap between the policy that sampled a batch (pi_rollout) and the one the trainer computes (pi_train).

Owns verl's public functions of this module (same names, signatures and `rollout_corr/*` metric names): truncated
IS weights (`compute_rollout_correction_weights`), divergence-based rejection masks
(`compute_rollout_rejection_mask`), both with metrics, the decoupled and bypass modes and
`resolve_rollout_correction_config` (start-up checks). Metrics live in `rollout_corr_metrics` (re-exported here).
Layer 3: must not import core_algos, models, Ray or workers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import open_dict

import verl.utils.torch_functional as verl_F
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_metrics import (
    SAFETY_BOUND,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rs_metrics,
)

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "apply_bypass_mode",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "resolve_rollout_correction_config",
]

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = {
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
}
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}
ROLLOUT_IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


# ------------------------------------------------------------------------------------------ threshold specs
def _parse_rollout_is_threshold(threshold_spec: str | float) -> tuple[float, float | None]:
    """(upper, lower) of an IS threshold: a positive number or number-like string -> (upper, None) (TIS);
    "lower_upper" -> both (IcePop), 0 < lower <= upper. TypeError for a bool or another type, ValueError else."""
    if isinstance(threshold_spec, bool):
        raise TypeError("rollout_is_threshold must be a float or a string threshold specification, not a boolean.")
    if not isinstance(threshold_spec, (int, float, str)):
        raise TypeError(
            f"rollout_is_threshold must be a float or a string threshold specification, got {threshold_spec!r}"
        )
    spec = str(threshold_spec).strip()
    if not spec:
        raise ValueError("rollout_is_threshold must not be an empty string.")
    lower_text, _, upper_text = spec.partition("_") if "_" in spec else ("", "", spec)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if "_" in spec else None
    except ValueError as exc:
        raise ValueError(f"Invalid rollout_is_threshold '{threshold_spec}'.") from exc
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}.")
    if lower is not None and lower <= 0:
        raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}.")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold lower bound must be <= upper bound, got {spec}.")
    return upper, lower


def _parse_rollout_rs_thresholds(
    options: list[str], threshold_spec: str | float | None
) -> dict[str, dict[str, float | None]]:
    """{option: {"lower", "upper"}} from one spec per option (comma-separated) or one spec shared by all.

    k1 options take "lower_upper" ratio bounds, or one number u meaning [1/u, u]; k2/k3 options one positive
    upper bound (lower None)."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if not isinstance(threshold_spec, (int, float, str)):
        raise TypeError("rollout_rs_threshold must be a string or numeric value specifying per-option thresholds.")
    specs = [part.strip() for part in str(threshold_spec).split(",") if part.strip()]
    if not specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold expects either one threshold shared by all options or exactly {len(options)} "
            f"thresholds to match the provided rollout_rs options, got {len(specs)}."
        )
    specs = specs * len(options) if len(specs) == 1 else specs

    thresholds: dict[str, dict[str, float | None]] = {}
    for option, spec in zip(options, specs, strict=True):
        if not option.endswith("k1") and "_" in spec:
            raise ValueError(
                f"rollout_rs_threshold for option '{option}' must provide a single upper bound without '_'. "
                f"Received '{spec}'."
            )
        try:
            if "_" in spec:
                lower_text, upper_text = spec.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(spec)
                lower = 1.0 / upper if option.endswith("k1") and upper > 0 else None
        except ValueError as exc:
            raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from exc
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
        if lower is not None and lower > upper:
            raise ValueError(f"Thresholds for option '{option}' must be lower <= upper, got {spec}.")
        thresholds[option] = {"lower": lower, "upper": upper}
    return thresholds


def _rs_options(rollout_rs: Any) -> list[str]:
    """The distinct options of a comma-separated `rollout_rs`, in order; ValueError for an unknown one."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if option and option not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {option}. Must be one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
        if option and option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    return options


# ------------------------------------------------------------------------------------------------ rejection
def _sequence_max(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) max of `values` over valid tokens; 0 for a sequence without any."""
    max_values = values.masked_fill(~response_mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(max_values) & (max_values < 0), torch.zeros_like(max_values), max_values)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Hard trust region: mask tokens or whole sequences whose divergence estimate leaves its bounds.

    `log_ratio` = log pi_train - log pi_rollout and `response_mask` (1 = valid) are (bs, response_length). With
    lr = clamp(log_ratio, -20, 20) the per-token estimates are k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr.
    `rollout_rs` lists comma-separated options, every one must pass:
    - token_k{1,2,3}: each token on its own; seq_sum_k{1,2,3} / seq_mean_k{1,2,3} / seq_max_k{2,3}: the sum /
      mean / max over a sequence's valid tokens decides for the whole sequence.
    - k1 options keep log(lower) <= statistic <= log(upper) (bounds on pi_rollout / pi_train, or on its product
      or geometric mean over the sequence); k2/k3 options keep statistic <= upper.
    `rollout_rs_threshold`: one spec per option (comma-separated) or one for all, see `_parse_rollout_rs_thresholds`.
    Returns (response_mask * keep in `response_mask`'s dtype, metrics without prefix: per option
    `rollout_rs_{option}_*` of `compute_rs_metrics` plus `_masked_fraction` (tokens) and `_seq_masked_fraction`
    (sequences), and over all options `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction` (share of
    all sequences with at least one masked valid token)).
    """
    options = _rs_options(rollout_rs)
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    thresholds = _parse_rollout_rs_thresholds(options, rollout_rs_threshold)

    lr = log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    reducers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "seq_sum": lambda v: verl_F.masked_sum(v, response_mask, axis=-1),
        "seq_mean": lambda v: verl_F.masked_mean(v, response_mask, axis=-1),
        "seq_max": lambda v: _sequence_max(v, response_mask),
    }
    mask_bool = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        aggregation, estimator = option.rsplit("_", 1)
        upper, lower = thresholds[option]["upper"], thresholds[option]["lower"]
        is_k1 = estimator == "k1"
        high = math.log(upper) if is_k1 else upper  # bounds in the statistic's units
        low = math.log(lower) if is_k1 else 0.0
        if aggregation == "token":
            per_sequence, stat = None, per_token[estimator]
        else:
            per_sequence = reducers[aggregation](per_token[estimator])
            stat = per_sequence.unsqueeze(-1).expand_as(lr)
        keep = (stat <= high) & (stat >= low) if is_k1 else stat <= high
        metrics.update(
            compute_rs_metrics(
                option_name=option,
                rs_statistic=stat,
                response_mask=response_mask,
                seq_valid_mask=seq_valid,
                level="token" if option in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS else "sequence",
                per_sequence_values=per_sequence,
                rollout_rs_threshold=high,
                rollout_rs_threshold_lower=low,
                apply_lower_threshold=is_k1,
            )
        )
        keep_float = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_float
        seq_rejected = (~keep & mask_bool).any(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = verl_F.masked_mean(1 - keep_float, response_mask).item()
        n_valid = seq_valid.float().sum()
        seq_share = (seq_rejected & seq_valid).float().sum() / n_valid if n_valid > 0 else torch.tensor(0.0)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = seq_share.item()

    metrics["rollout_rs_masked_fraction"] = verl_F.masked_mean(1 - combined, response_mask).item()
    rejected = (combined <= 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


# ---------------------------------------------------------------------------------------------- IS weights
def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _distributed_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / sum(mask), both sums taken over every data-parallel rank."""
    totals = torch.stack([(values * mask).sum(), mask.sum()]).to(torch.float64)
    torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.SUM)
    return (totals[0] / totals[1]).to(values.dtype)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights w ~ pi_train / pi_rollout, detached, 0 on padding; shapes (bs, response_length).

    - rollout_is="token": w_t = exp(clamp(log_ratio_t, -20, 20)) (biased, low variance);
      "sequence": w = exp(clamp(sum_t log_ratio_t, -20, 20)) on every token of the sequence (unbiased, high
      variance).
    - `rollout_is_threshold` u (number or "u"): TIS, w = min(w, u); "l_u": IcePop, w = 0 outside [l, u].
    - `rollout_is_batch_normalize`: w / mean(w), the mean over valid tokens (token level) or over sequences
      (sequence level), taken over all data-parallel ranks when torch.distributed is initialised.
    Metrics (no prefix): `compute_is_metrics` of the weights before normalisation, `rollout_is_oob_ratio` (IcePop:
    share of tokens outside the bounds) and `rollout_is_batch_norm_factor` (the mean divided by; 1.0 when it is
    ~0 and nothing is divided).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {set(ROLLOUT_IS_LEVELS)}.")
    upper, lower = _parse_rollout_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_for_metrics = verl_F.masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)  # (bs, 1)
        raw = torch.exp(log_ratio_for_metrics.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))

    metrics = compute_is_metrics(
        rollout_is_weights=weights,
        raw_rollout_is_weights=raw,
        log_ratio_for_metrics=log_ratio_for_metrics,
        response_mask=response_mask,
        rollout_is=rollout_is,
        rollout_is_threshold=upper,
        rollout_is_threshold_lower=lower,
    )
    if lower is not None:
        out_of_bounds = ((raw < lower) | (raw > upper)).float()
        metrics["rollout_is_oob_ratio"] = verl_F.masked_mean(out_of_bounds, response_mask).item()
    weights = weights.detach()  # IS weights change the measure, not the objective: no gradient through them

    if rollout_is_batch_normalize:
        mask = response_mask.to(dtype=weights.dtype)
        if rollout_is == "token":  # the mean over valid tokens
            values = weights
        else:  # the mean over sequences of their (equal) token weights
            values = verl_F.masked_mean(weights, response_mask, axis=-1)
            mask = (mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
        if _distributed():
            mean = _distributed_masked_mean(values, mask)
        elif rollout_is == "token":
            mean = verl_F.masked_mean(values, mask)
        else:
            mean = (values * mask).sum() / mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


# ---------------------------------------------------------------------------------------------- pipeline
def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[DataProto | None, torch.Tensor, dict[str, float]]:
    """IS weights (when `rollout_is` and its threshold are set), the rejection mask (when `rollout_rs` is set)
    and the off-policy metrics of log pi_train = `old_log_prob` against log pi_rollout = `rollout_log_prob`.

    All tensors (bs, response_length). Returns (a DataProto holding `rollout_is_weights`, or None; the response
    mask with rejected tokens zeroed (a copy of `response_mask` without rejection); every metric prefixed with
    `rollout_corr/`, as floats). ValueError when the mask has no valid token, the shapes differ, or `rollout_rs`
    is set without `rollout_rs_threshold`.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape {rollout_log_prob.shape}."
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {old_log_prob.shape} does not match response_mask shape {response_mask.shape}."
        )
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, Any] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio=log_ratio,
            response_mask=response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    modified_response_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(
                "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                "Set rollout_rs_threshold to the desired threshold value."
            )
        modified_response_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio=log_ratio,
            response_mask=response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))

    prefixed = {
        f"rollout_corr/{key}": value.item() if isinstance(value, torch.Tensor) else value
        for key, value in metrics.items()
    }
    proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, modified_response_mask, prefixed


def _setting(config: Any, key: str, default: Any) -> Any:
    return default if config is None else config.get(key, default)


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config: Any) -> tuple[DataProto, dict]:
    """The trainer's decoupled mode: correct for pi_rollout against the recomputed old policy.

    Reads `old_log_probs`, `rollout_log_probs` and `response_mask` of `batch.batch`; always replaces
    `response_mask` by the rejected one and adds `rollout_is_weights` (bs, response_length) when
    `rollout_corr_config.rollout_is` is set. Returns (batch, `rollout_corr/*` metrics). Without
    `rollout_log_probs` the batch is returned unchanged with no metrics when neither IS nor rejection is asked for,
    and ValueError is raised when one is.
    """
    rollout_is = _setting(rollout_corr_config, "rollout_is", None)
    rollout_rs = _setting(rollout_corr_config, "rollout_rs", None)
    if "rollout_log_probs" not in batch.batch.keys():
        if rollout_is is None and rollout_rs is None:
            return batch, {}
        raise ValueError(
            f"algorithm.rollout_correction (rollout_is={rollout_is!r}, rollout_rs={rollout_rs!r}) needs the "
            "rollout's log-probs in the batch; set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    weights, modified_response_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch.batch["old_log_probs"],
        rollout_log_prob=batch.batch["rollout_log_probs"],
        response_mask=batch.batch["response_mask"],
        rollout_is=rollout_is,
        rollout_is_threshold=_setting(rollout_corr_config, "rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=_setting(rollout_corr_config, "rollout_is_batch_normalize", False),
        rollout_rs=rollout_rs,
        rollout_rs_threshold=_setting(rollout_corr_config, "rollout_rs_threshold", None),
    )
    batch.batch["response_mask"] = modified_response_mask
    if weights is not None:
        batch = batch.union(weights)
    return batch, metrics


def apply_bypass_mode(
    batch: DataProto,
    rollout_corr_config: Any = None,
    policy_loss_config: Any = None,
) -> None:
    """Bypass mode: old_log_probs := rollout_log_probs (two policies, no old-log-prob forward pass), and the
    actor's `policy_loss` config gets `rollout_correction` and `loss_mode="bypass_mode"` (in place), so that
    `compute_policy_loss_bypass_mode` applies IS/rejection against the current policy with `loss_type`.
    ValueError when the batch has no `rollout_log_probs`."""
    if "rollout_log_probs" not in batch.batch.keys():
        raise ValueError(
            "bypass_mode=True requires rollout_log_probs in batch. "
            "Ensure rollout worker is configured to calculate_log_probs=true."
        )
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if policy_loss_config is not None:
        with open_dict(policy_loss_config):
            policy_loss_config["rollout_correction"] = rollout_corr_config
            policy_loss_config["loss_mode"] = "bypass_mode"


# ---------------------------------------------------------------------------------------------- start-up
KEY = "algorithm.rollout_correction"


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{KEY}.{key}={value!r} {why}")


def _notice(message: str) -> None:
    print(f"notice: {message}", file=sys.stderr)


def resolve_rollout_correction_config(config: Any, notify: Callable[[str], None] = _notice) -> None:
    """Check `algorithm.rollout_correction` against what verl would refuse at its first step, and the settings it
    needs or clashes with, raising ValueError (one line: key, value, what is allowed); then, in bypass mode, write
    verl's `apply_bypass_mode` settings into `actor_rollout_ref.actor.policy_loss` before the workers start.

    Refused: rollout_is not in (null, token, sequence) or set with a null/invalid threshold; an unknown rollout_rs
    option or a missing/invalid rollout_rs_threshold; bypass_mode with a loss_type other than ppo_clip/reinforce or
    a policy_loss.loss_mode other than vanilla/bypass_mode; loss_mode=bypass_mode without bypass_mode=true; IS,
    rejection or bypass without rollout.calculate_log_probs; rollout_is or bypass_mode together with the project's
    own behaviour corrections (actor.tis_imp_ratio_cap > 0, actor.use_decoupled_loss=true). Settings verl ignores
    (loss_type without bypass, batch normalisation without rollout_is) give one notice.
    """
    block = (config.get("algorithm") or {}).get("rollout_correction")
    actor = config.actor_rollout_ref.actor
    policy_loss = actor.get("policy_loss") or {}
    loss_mode = policy_loss.get("loss_mode", "vanilla")
    if block is None:
        if loss_mode == "bypass_mode":
            raise ValueError("actor.policy_loss.loss_mode='bypass_mode' needs algorithm.rollout_correction.")
        return
    rollout_is, threshold = block.get("rollout_is"), block.get("rollout_is_threshold", 2.0)
    rollout_rs, rs_threshold = block.get("rollout_rs"), block.get("rollout_rs_threshold")
    bypass, loss_type = bool(block.get("bypass_mode", False)), block.get("loss_type", "ppo_clip")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise _refuse("rollout_is", rollout_is, "is not supported; allowed: null, token, sequence")
    if rollout_is is not None:
        try:
            if threshold is None:
                raise ValueError("it must be set when rollout_is is")
            _parse_rollout_is_threshold(threshold)
        except (TypeError, ValueError) as exc:
            raise _refuse(
                "rollout_is_threshold", threshold, f"is invalid ({exc}); allowed: u > 0 (TIS) or 'l_u' (IcePop)"
            ) from None
    if rollout_rs is not None:
        try:
            _parse_rollout_rs_thresholds(_rs_options(rollout_rs), rs_threshold)
        except (TypeError, ValueError) as exc:
            raise _refuse(
                "rollout_rs", rollout_rs, f"with rollout_rs_threshold={rs_threshold!r} is invalid: {exc}"
            ) from None
    if loss_type not in BYPASS_LOSS_TYPES:
        raise _refuse("loss_type", loss_type, f"is not supported; allowed: {', '.join(BYPASS_LOSS_TYPES)}")
    if loss_type != "ppo_clip" and not bypass:
        notify(f"{KEY}.loss_type={loss_type!r} has no effect without bypass_mode=true (as in verl)")
    if block.get("rollout_is_batch_normalize", False) and rollout_is is None:
        notify(f"{KEY}.rollout_is_batch_normalize=true has no effect without rollout_is (as in verl)")
    if bypass and rollout_is is not None and loss_type == "ppo_clip":
        notify(
            f"{KEY}.rollout_is={rollout_is!r} with bypass_mode and loss_type=ppo_clip: the weights are logged, not "
            "applied (the PPO ratio is already pi/pi_rollout), as in verl"
        )
    if loss_mode == "bypass_mode" and not bypass:
        raise ValueError(
            "actor.policy_loss.loss_mode='bypass_mode' is set by algorithm.rollout_correction.bypass_mode=true; "
            "set that instead"
        )
    if bypass and loss_mode not in ("vanilla", "bypass_mode"):
        why = f"replaces actor.policy_loss.loss_mode={loss_mode!r} (by bypass_mode: ppo_clip or reinforce by loss_type)"
        raise _refuse("bypass_mode", True, f"{why}; leave loss_mode at vanilla")
    used = [
        name for name, on in (("rollout_is", rollout_is), ("rollout_rs", rollout_rs), ("bypass_mode", bypass)) if on
    ]
    if used and not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        why = "needs the rollout's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true"
        raise _refuse(used[0], block.get(used[0]), why)
    tis_cap = actor.get("tis_imp_ratio_cap", -1)
    for name in [name for name in ("rollout_is", "bypass_mode") if name in used]:
        if tis_cap is not None and tis_cap > 0:
            why = f"and actor.tis_imp_ratio_cap={tis_cap} both weight by the rollout's log-probs; set it to -1"
            raise _refuse(name, block.get(name), why)
        if actor.get("use_decoupled_loss") is True:
            why = "and actor.use_decoupled_loss=true both correct for the rollout policy; set use_decoupled_loss=false"
            raise _refuse(name, block.get(name), why)
    if bypass:
        with open_dict(config):
            actor.policy_loss.loss_mode = "bypass_mode"
            actor.policy_loss.rollout_correction = block
