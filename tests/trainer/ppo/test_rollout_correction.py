"""verl 0.9.1's `algorithm.rollout_correction` (verl/trainer/ppo/rollout_corr_helper.py, rollout_corr_metrics.py,
policy_loss_bypass.py) against a hand computation written here with `math` only: token and sequence IS weights
(TIS truncation, IcePop, batch normalisation), every rejection mode, the `rollout_corr/*` metrics, the trainer's
batch step, bypass mode (ppo_clip and reinforce), the IS weights in the decoupled loss, the start-up checks, and
a bf16-vs-fp32 Qwen2 whose mismatch the metrics see. The end-to-end runs are marked slow."""

from __future__ import annotations

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from tests.cpu_overrides import cpu_config
from verl.protocol import DataProto
from verl.trainer.config import check_config
from verl.trainer.ppo import rollout_corr_helper as rch
from verl.trainer.ppo.async_rollout import resolve_async_config
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.actor.dp_actor import _optional_loss_inputs

# 3 sequences x 4 tokens: log pi_rollout, the log-ratio log(pi_train / pi_rollout) and the valid tokens
ROLLOUT = [[-1.0, -0.5, -2.0, -0.3], [-1.5, -0.2, -0.7, -1.0], [-0.4, -0.9, -1.1, -2.5]]
LOG_RATIO = [[0.5, -0.2, 1.0, 0.3], [0.1, 0.0, -0.3, 9.9], [-0.05, 0.02, 0.04, -0.01]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
TRAIN = [[r + d for r, d in zip(rr, dd)] for rr, dd in zip(ROLLOUT, LOG_RATIO)]
ROWS, COLS = 3, 4


def tensors():
    return torch.tensor(TRAIN), torch.tensor(ROLLOUT), torch.tensor(MASK, dtype=torch.float32)


def valid(i):
    return [t for t in range(COLS) if MASK[i][t]]


def as_list(tensor):
    return [[float(v) for v in row] for row in tensor]


def close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert x == pytest.approx(y, abs=tol), (a, b)


# ------------------------------------------------------------------------------------------------ IS weights
def hand_weights(level, upper, lower=None):
    """Per-token (level="token") or per-sequence (product of ratios on every token) weights, 0 on padding; a lone
    upper bound truncates (TIS), lower and upper zero what lies outside (IcePop)."""
    out = []
    for i in range(ROWS):
        seq = math.exp(sum(LOG_RATIO[i][t] for t in valid(i)))
        row = []
        for t in range(COLS):
            raw = (math.exp(LOG_RATIO[i][t]) if level == "token" else seq) if MASK[i][t] else 0.0
            if lower is None:
                row.append(min(raw, upper))
            else:
                row.append(raw if lower <= raw <= upper else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold, upper, lower", [(2.0, 2.0, None), ("1.5", 1.5, None), ("0.9_2.0", 2.0, 0.9)])
def test_is_weights_truncate_or_zero_outside_the_bounds(level, threshold, upper, lower):
    train, rollout, mask = tensors()
    weights, metrics = rch.compute_rollout_correction_weights(train - rollout, mask, level, threshold)
    expected = hand_weights(level, upper, lower)
    close(as_list(weights), expected)
    assert not weights.requires_grad
    flat = [expected[i][t] for i in range(ROWS) for t in valid(i)]
    assert metrics["rollout_is_mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-6)
    assert max(flat) <= upper
    assert ("rollout_is_oob_ratio" in metrics) == (lower is not None)


def test_token_is_metrics_by_hand():
    train, rollout, mask = tensors()
    weights, m = rch.compute_rollout_correction_weights(train - rollout, mask, "token", 2.0)
    w = hand_weights("token", 2.0)
    flat = [w[i][t] for i in range(ROWS) for t in valid(i)]
    raw = [math.exp(LOG_RATIO[i][t]) for i in range(ROWS) for t in valid(i)]
    n = len(flat)
    mean = sum(flat) / n
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_min"] == pytest.approx(min(flat))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(sum(r > 2.0 for r in raw) / n)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(sum(r < 0.5 for r in raw) / n)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(sum(x * x for x in flat) / n - mean**2), abs=1e-5)
    ess = 1.0 / (sum((x / mean) ** 2 for x in flat) / n)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(ess, abs=1e-5)
    seq_means = [sum(w[i][t] for t in valid(i)) / len(valid(i)) for i in range(ROWS)]
    assert m["rollout_is_seq_mean"] == pytest.approx(sum(seq_means) / ROWS, abs=1e-6)
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(max(abs(s - 1) for s in seq_means), abs=1e-6)


def test_sequence_is_metrics_report_the_untruncated_extremes():
    train, rollout, mask = tensors()
    _, m = rch.compute_rollout_correction_weights(train - rollout, mask, "sequence", 2.0)
    sums = [sum(LOG_RATIO[i][t] for t in valid(i)) for i in range(ROWS)]
    assert m["rollout_is_max"] == pytest.approx(math.exp(max(sums)), rel=1e-5)  # 1.6 -> 4.95, above the bound
    assert m["rollout_is_min"] == pytest.approx(math.exp(min(sums)), rel=1e-5)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(sum(s > math.log(2.0) for s in sums) / ROWS)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_divides_by_the_mean_weight(level):
    train, rollout, mask = tensors()
    weights, metrics = rch.compute_rollout_correction_weights(train - rollout, mask, level, 2.0, True)
    w = hand_weights(level, 2.0)
    if level == "token":
        flat = [w[i][t] for i in range(ROWS) for t in valid(i)]
        mean = sum(flat) / len(flat)
    else:
        mean = sum(w[i][valid(i)[0]] for i in range(ROWS)) / ROWS
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(mean, abs=1e-6)
    close(as_list(weights), [[x / mean for x in row] for row in w])


# ------------------------------------------------------------------------------------------------- rejection
def token_stat(kind, d):
    d = max(-20.0, min(20.0, d))
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[kind]


def hand_keep(option, spec):
    """Keep mask (rows x cols of 0/1) of one rejection option, computed per token / sequence with math."""
    aggregation, kind = option.rsplit("_", 1)
    if kind == "k1":
        lo, hi = (float(x) for x in spec.split("_")) if "_" in str(spec) else (1 / float(spec), float(spec))
        lo, hi = math.log(lo), math.log(hi)
    else:
        lo, hi = -math.inf, float(spec)
    keep = []
    for i in range(ROWS):
        stats = [token_stat(kind, LOG_RATIO[i][t]) for t in valid(i)]
        if aggregation == "token":
            row = [1 if lo <= token_stat(kind, LOG_RATIO[i][t]) <= hi else 0 for t in range(COLS)]
        else:
            value = {"seq_sum": sum, "seq_mean": lambda s: sum(s) / len(s), "seq_max": max}[aggregation](stats)
            row = [1 if lo <= value <= hi else 0] * COLS
        keep.append(row)
    return keep


RS_CASES = [
    ("token_k1", "0.7_1.4"),
    ("token_k2", 0.03),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_3.0"),
    ("seq_sum_k2", 0.2),
    ("seq_sum_k3", 0.2),
    ("seq_mean_k1", 1.2),
    ("seq_mean_k2", 0.02),
    ("seq_mean_k3", 0.03),
    ("seq_max_k2", 0.1),
    ("seq_max_k3", 0.1),
]


def test_every_supported_option_is_covered():
    assert {option for option, _ in RS_CASES} == rch.SUPPORTED_ROLLOUT_RS_OPTIONS


@pytest.mark.parametrize("option, spec", RS_CASES)
def test_each_rejection_mode_masks_what_leaves_its_bounds(option, spec):
    train, rollout, mask = tensors()
    new_mask, m = rch.compute_rollout_rejection_mask(train - rollout, mask, option, spec)
    keep = hand_keep(option, spec)
    expected = [[MASK[i][t] * keep[i][t] for t in range(COLS)] for i in range(ROWS)]
    assert as_list(new_mask) == expected and new_mask.dtype == mask.dtype
    n_valid = sum(map(sum, MASK))
    rejected_tokens = sum(MASK[i][t] - expected[i][t] for i in range(ROWS) for t in range(COLS))
    rejected_rows = sum(any(MASK[i][t] and not expected[i][t] for t in range(COLS)) for i in range(ROWS))
    assert 0 < rejected_tokens < n_valid, "the thresholds are chosen to reject some tokens, not all"
    assert m[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected_tokens / n_valid)
    assert m[f"rollout_rs_{option}_seq_masked_fraction"] == pytest.approx(rejected_rows / ROWS)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / n_valid)
    for suffix in ("mean", "max", "min", "std", "fraction_high", "fraction_low", "seq_mean", "seq_max_deviation"):
        assert f"rollout_rs_{option}_{suffix}" in m


def test_several_options_must_all_pass():
    train, rollout, mask = tensors()
    new_mask, m = rch.compute_rollout_rejection_mask(train - rollout, mask, "token_k1,seq_max_k2", "0.7_1.4,0.1")
    a, b = hand_keep("token_k1", "0.7_1.4"), hand_keep("seq_max_k2", 0.1)
    assert as_list(new_mask) == [[MASK[i][t] * a[i][t] * b[i][t] for t in range(COLS)] for i in range(ROWS)]
    assert "rollout_rs_token_k1_mean" in m and "rollout_rs_seq_max_k2_mean" in m


@pytest.mark.parametrize(
    "rs, spec, message",
    [
        ("token_k4", 1.0, "Invalid rollout_rs option"),
        ("token_k2", "0.1_0.2", "single upper bound"),
        ("token_k1,token_k2", "1.5,0.1,0.2", "either one threshold"),
        ("token_k1", "2.0_1.0", "lower <= upper"),
        ("token_k2", None, "must be provided"),
    ],
)
def test_bad_rejection_specs_are_refused(rs, spec, message):
    train, rollout, mask = tensors()
    with pytest.raises(ValueError, match=message):
        rch.compute_rollout_rejection_mask(train - rollout, mask, rs, spec)


# ------------------------------------------------------------------------------------------------- metrics
def test_offpolicy_metrics_by_hand():
    train, rollout, mask = tensors()
    _, _, m = rch.compute_rollout_correction_and_rejection_mask(train, rollout, mask)
    assert all(key.startswith("rollout_corr/") for key in m)
    tokens = [(i, t) for i in range(ROWS) for t in valid(i)]
    kl = sum(-LOG_RATIO[i][t] for i, t in tokens) / len(tokens)
    k3 = sum(math.exp(LOG_RATIO[i][t]) - LOG_RATIO[i][t] - 1 for i, t in tokens) / len(tokens)
    train_mean = [sum(TRAIN[i][t] for t in valid(i)) / len(valid(i)) for i in range(ROWS)]
    roll_mean = [sum(ROLLOUT[i][t] for t in valid(i)) / len(valid(i)) for i in range(ROWS)]
    diff = [r - tr for r, tr in zip(roll_mean, train_mean)]
    chi2_token = sum(math.exp(2 * LOG_RATIO[i][t]) for i, t in tokens) / len(tokens) - 1
    chi2_seq = sum(math.exp(2 * sum(LOG_RATIO[i][t] for t in valid(i))) for i in range(ROWS)) / ROWS - 1
    expected = {
        "kl": kl,
        "k3_kl": k3,
        "training_ppl": sum(math.exp(-x) for x in train_mean) / ROWS,
        "training_log_ppl": -sum(train_mean) / ROWS,
        "rollout_ppl": sum(math.exp(-x) for x in roll_mean) / ROWS,
        "rollout_log_ppl": -sum(roll_mean) / ROWS,
        "log_ppl_diff": sum(diff) / ROWS,
        "log_ppl_abs_diff": sum(map(abs, diff)) / ROWS,
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": sum(math.exp(x) for x in diff) / ROWS,
        "chi2_token": chi2_token,
        "chi2_seq": chi2_seq,
    }
    assert set(m) == {f"rollout_corr/{key}" for key in expected}  # metrics only: no IS, no rejection
    for key, value in expected.items():
        assert m[f"rollout_corr/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_pipeline_returns_weights_mask_and_every_family_of_metrics():
    train, rollout, mask = tensors()
    proto, new_mask, m = rch.compute_rollout_correction_and_rejection_mask(
        train, rollout, mask, "sequence", 2.0, False, "token_k2", 0.03
    )
    close(as_list(proto.batch["rollout_is_weights"]), hand_weights("sequence", 2.0))
    assert as_list(new_mask) == [
        [MASK[i][t] * k for t, k in enumerate(r)] for i, r in enumerate(hand_keep("token_k2", 0.03))
    ]
    for key in ("rollout_is_mean", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction", "kl", "chi2_seq"):
        assert f"rollout_corr/{key}" in m
    with pytest.raises(ValueError, match="at least one valid token"):
        rch.compute_rollout_correction_and_rejection_mask(train, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="does not match"):
        rch.compute_rollout_correction_and_rejection_mask(train[:, :2], rollout, mask)


def test_metrics_from_logprobs_are_the_prefixed_offpolicy_metrics():
    train, rollout, mask = tensors()
    plain = rch.compute_offpolicy_metrics(train, rollout, mask)
    assert rch.compute_rollout_corr_metrics_from_logprobs(train, rollout, mask) == {
        f"rollout_corr/{k}": v for k, v in plain.items()
    }


# ------------------------------------------------------------------------------------------- trainer steps
def batch(with_rollout=True):
    train, rollout, mask = tensors()
    tensors_ = {"old_log_probs": train, "response_mask": mask}
    if with_rollout:
        tensors_["rollout_log_probs"] = rollout
    return DataProto.from_dict(tensors=tensors_)


def test_add_to_batch_writes_weights_and_the_rejected_mask():
    cfg = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.1}
    out, m = rch.compute_rollout_correction_and_add_to_batch(batch(), OmegaConf.create(cfg))
    close(as_list(out.batch["rollout_is_weights"]), hand_weights("token", 2.0))
    keep = hand_keep("seq_max_k2", 0.1)
    assert as_list(out.batch["response_mask"]) == [[MASK[i][t] * keep[i][t] for t in range(COLS)] for i in range(ROWS)]
    assert m["rollout_corr/rollout_rs_masked_fraction"] > 0

    metrics_only = rch.compute_rollout_correction_and_add_to_batch(batch(), OmegaConf.create({"rollout_is": None}))
    assert "rollout_is_weights" not in metrics_only[0].batch.keys() and "rollout_corr/kl" in metrics_only[1]
    unchanged, none = rch.compute_rollout_correction_and_add_to_batch(batch(False), OmegaConf.create({}))
    assert none == {} and "rollout_is_weights" not in unchanged.batch.keys()
    with pytest.raises(ValueError, match="calculate_log_probs=true"):
        rch.compute_rollout_correction_and_add_to_batch(batch(False), OmegaConf.create(cfg))


def test_apply_bypass_mode_reuses_the_rollout_log_probs_and_switches_the_loss():
    data = batch()
    policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    rc = OmegaConf.create({"bypass_mode": True, "loss_type": "reinforce"})
    rch.apply_bypass_mode(data, rc, policy_loss)
    assert torch.equal(data.batch["old_log_probs"], data.batch["rollout_log_probs"])
    assert policy_loss.loss_mode == "bypass_mode" and policy_loss.rollout_correction.loss_type == "reinforce"
    with pytest.raises(ValueError, match="calculate_log_probs=true"):
        rch.apply_bypass_mode(batch(False), rc, policy_loss)


# ----------------------------------------------------------------------------------------------- the losses
ADV = [[1.0, -1.0, 0.5, 2.0], [-0.5, 1.5, 1.0, 1.0], [0.3, -0.2, 1.0, -1.0]]
CLIP_LOW, CLIP_HIGH, DUAL = 0.2, 0.28, 3.0


def loss_config(**rollout_correction):
    return OmegaConf.create(
        {
            "clip_ratio": CLIP_LOW,
            "clip_ratio_low": CLIP_LOW,
            "clip_ratio_high": CLIP_HIGH,
            "clip_ratio_c": DUAL,
            "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": rollout_correction},
        }
    )


def hand_ppo(log_ratio_to_old, weights, keep):
    """Token-mean dual-clip PPO loss over kept valid tokens (ratio = exp(log_ratio_to_old)), each token * weight."""
    total, count = 0.0, 0
    for i in range(ROWS):
        for t in valid(i):
            if not keep[i][t]:
                continue
            a, r = ADV[i][t], math.exp(log_ratio_to_old[i][t])
            loss = max(-a * r, -a * min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH))
            if a < 0:
                loss = min(loss, -a * DUAL)
            total, count = total + loss * weights[i][t], count + 1
    return total / count


def run_loss(mode, cfg, old, log_prob, **extra):
    lp = torch.tensor(log_prob, requires_grad=True)
    loss, metrics = get_policy_loss_fn(mode)(
        old_log_prob=torch.tensor(old),
        log_prob=lp,
        advantages=torch.tensor(ADV),
        response_mask=torch.tensor(MASK, dtype=torch.float32),
        loss_agg_mode="token-mean",
        config=cfg,
        **extra,
    )
    loss.backward()
    return loss.item(), metrics, as_list(lp.grad)


def test_bypass_ppo_clip_is_ppo_against_the_rollout_with_rejection_and_no_weights():
    cfg = loss_config(
        loss_type="ppo_clip",
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.7_1.4",
    )
    loss, metrics, _ = run_loss("bypass_mode", cfg, ROLLOUT, TRAIN)  # old_log_prob = the rollout's (bypass)
    ones = [[1.0] * COLS for _ in range(ROWS)]
    assert loss == pytest.approx(hand_ppo(LOG_RATIO, ones, hand_keep("token_k1", "0.7_1.4")), abs=1e-6)
    assert metrics["rollout_corr/rollout_is_max"] <= 1.5  # weights computed and logged, not applied
    assert "actor/pg_clipfrac" in metrics and "rollout_corr/rollout_rs_masked_fraction" in metrics


@pytest.mark.parametrize("rollout_is", [None, "token", "sequence"])
def test_bypass_reinforce_weights_log_prob_times_advantage(rollout_is):
    cfg = loss_config(loss_type="reinforce", rollout_is=rollout_is, rollout_is_threshold=2.0)
    loss, metrics, grad = run_loss("bypass_mode", cfg, ROLLOUT, TRAIN)
    w = [[1.0] * COLS for _ in range(ROWS)] if rollout_is is None else hand_weights(rollout_is, 2.0)
    tokens = [(i, t) for i in range(ROWS) for t in valid(i)]
    assert loss == pytest.approx(sum(-w[i][t] * ADV[i][t] * TRAIN[i][t] for i, t in tokens) / len(tokens), abs=1e-6)
    # the weights are detached: d loss / d log pi = -w * A / n, no term through w
    close(grad, [[-w[i][t] * ADV[i][t] / len(tokens) if MASK[i][t] else 0.0 for t in range(COLS)] for i in range(ROWS)])
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(LOG_RATIO[i][t] for i, t in tokens) / len(tokens), abs=1e-6)


def test_bypass_needs_its_config_and_a_known_loss_type():
    with pytest.raises(ValueError, match="rollout_correction config not found"):
        run_loss("bypass_mode", OmegaConf.create({"policy_loss": {}}), ROLLOUT, TRAIN)
    with pytest.raises(ValueError, match="Invalid loss_type"):
        run_loss("bypass_mode", loss_config(loss_type="ppo"), ROLLOUT, TRAIN)


def test_decoupled_vanilla_loss_multiplies_tokens_by_the_is_weights():
    old = [[x - 0.1 * (t % 2) for t, x in enumerate(row)] for row in TRAIN]  # the recomputed old policy
    w = hand_weights("token", 2.0)
    log_prob = [[x + 0.15 for x in row] for row in old]
    loss, _, _ = run_loss("vanilla", loss_config(), old, log_prob, rollout_is_weights=torch.tensor(w))
    shift = [[0.15] * COLS for _ in range(ROWS)]
    assert loss == pytest.approx(hand_ppo(shift, w, [[1] * COLS] * ROWS), abs=1e-6)


def test_the_actor_passes_only_the_inputs_a_loss_declares():
    data = {"rollout_log_probs": torch.zeros(1), "rollout_is_weights": torch.ones(1)}

    def verl_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
        pass

    def old_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs=None):
        pass

    assert set(_optional_loss_inputs(verl_style, data)) == {"rollout_is_weights"}
    assert set(_optional_loss_inputs(get_policy_loss_fn("vanilla"), data)) == set(data)
    assert _optional_loss_inputs(old_style, {"rollout_log_probs": torch.zeros(1)}).keys() == {"rollout_log_probs"}
    with pytest.raises(ValueError, match="no rollout_is_weights argument"):
        _optional_loss_inputs(old_style, data)


# ---------------------------------------------------------------------------------------------- start-up
def trainer_config(**overrides):
    cfg = cpu_config("actor_rollout_ref.rollout.calculate_log_probs=true")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


RC = "algorithm.rollout_correction"


def test_the_block_is_accepted_by_the_config_checks_and_bypass_switches_the_loss():
    cfg = trainer_config(
        **{f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": "0.5_5.0", f"{RC}.rollout_rs": "seq_mean_k1"},
        **{f"{RC}.rollout_rs_threshold": 1.01, f"{RC}.bypass_mode": True, f"{RC}.loss_type": "reinforce"},
    )
    check_config(cfg)  # no longer refused; a string IcePop threshold has the right type
    rch.resolve_rollout_correction_config(cfg)
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    assert cfg.actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type == "reinforce"
    default = trainer_config()
    rch.resolve_rollout_correction_config(default)
    assert default.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({f"{RC}.rollout_is": "tokens"}, "rollout_is='tokens' is not supported; allowed: null, token, sequence"),
        ({f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": "abc"}, "rollout_is_threshold='abc' is invalid"),
        ({f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": None}, "rollout_is_threshold=None is invalid"),
        ({f"{RC}.rollout_rs": "seq_max_k1", f"{RC}.rollout_rs_threshold": 2.0}, "rollout_rs='seq_max_k1'"),
        ({f"{RC}.rollout_rs": "token_k2"}, "rollout_rs_threshold must be provided"),
        ({f"{RC}.loss_type": "ppo"}, "loss_type='ppo' is not supported; allowed: ppo_clip, reinforce"),
        ({f"{RC}.bypass_mode": True, "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}, "leave loss_mode"),
        ({"actor_rollout_ref.actor.policy_loss.loss_mode": "bypass_mode"}, "bypass_mode=true; set that instead"),
        (
            {f"{RC}.rollout_is": "token", "actor_rollout_ref.rollout.calculate_log_probs": False},
            "rollout_is='token' needs the rollout's log-probs",
        ),
        ({f"{RC}.bypass_mode": True, "actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0}, "tis_imp_ratio_cap=2.0"),
        ({f"{RC}.rollout_is": "sequence", "actor_rollout_ref.actor.use_decoupled_loss": True}, "use_decoupled_loss"),
    ],
)
def test_bad_settings_stop_start_up_with_one_line(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        rch.resolve_rollout_correction_config(trainer_config(**overrides))
    assert "\n" not in str(info.value)


def test_settings_verl_ignores_give_a_notice():
    notes = []
    cfg = trainer_config(**{f"{RC}.loss_type": "reinforce", f"{RC}.rollout_is_batch_normalize": True})
    rch.resolve_rollout_correction_config(cfg, notify=notes.append)
    assert len(notes) == 2 and "loss_type" in notes[0] and "rollout_is_batch_normalize" in notes[1]


def test_async_mode_leaves_the_correction_to_verls_block():
    cfg = trainer_config(**{"trainer.rollout_mode": "async", f"{RC}.rollout_is": "token"})
    resolve_async_config(cfg)
    assert cfg.actor_rollout_ref.actor.use_decoupled_loss is False
    rch.resolve_rollout_correction_config(cfg)


# ------------------------------------------------------------------------------------ bf16 vs fp32 mismatch
def test_a_bf16_rollout_of_a_tiny_qwen2_shows_in_the_metrics_and_weights_stay_bounded():
    """The rollout computes log-probs in bfloat16, the trainer in float32, same weights: the metrics see the
    precision gap (|log-ratio| up to ~2e-3 here), the truncated weights never pass the threshold and rejection
    catches the worst tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils.torch_functional import logprobs_from_logits

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    input_ids = torch.randint(0, 96, (6, 24))
    response_len = 16

    def response_log_probs(m):
        with torch.no_grad():
            logits = m(input_ids=input_ids).logits[:, -response_len - 1 : -1].float()
        return logprobs_from_logits(logits, input_ids[:, -response_len:])

    train = response_log_probs(model)
    rollout = response_log_probs(model.to(torch.bfloat16))
    mask = torch.ones_like(train)
    mask[1, 10:] = 0
    weights, new_mask, m = rch.compute_rollout_correction_and_rejection_mask(
        train, rollout, mask, "token", 1.001, False, "token_k2", 1e-6
    )
    assert abs(m["rollout_corr/kl"]) > 1e-5 and m["rollout_corr/k3_kl"] > 0
    assert m["rollout_corr/log_ppl_abs_diff"] > 0 and m["rollout_corr/chi2_token"] != 0
    assert m["rollout_corr/training_ppl"] != m["rollout_corr/rollout_ppl"]
    w = weights.batch["rollout_is_weights"]
    assert float(w.max()) <= 1.001 + 1e-6 and float(w[mask == 0].abs().max()) == 0.0
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] > 0  # some ratios were truncated
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1 and new_mask.sum() < mask.sum()
    seq, _, ms = rch.compute_rollout_correction_and_rejection_mask(train, rollout, mask, "sequence", 1.001)
    assert float(seq.batch["rollout_is_weights"].max()) <= 1.001 + 1e-6 and ms["rollout_corr/rollout_is_max"] > 1.001


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, overrides",
    [
        (
            "decoupled",
            [f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold='0.5_2.0'"],
        ),
        (
            "bypass",
            [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence"]
            + [f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.01"],
        ),
    ],
)
def test_a_grpo_run_with_rollout_correction_logs_its_metrics(tiny_model_dir, tmp_path, mode, overrides):
    import json

    from tests.ppo_e2e import grpo_args, run_ppo, write_data

    run_dir = tmp_path / "run"
    # in one process (trainer.single_process=true): the same worker and trainer code as under Ray, at ~12 CPU-s less
    args = grpo_args(
        tiny_model_dir, write_data(tmp_path, 8), run_dir, "trainer.save_freq=-1", "trainer.single_process=true"
    )
    args += ["actor_rollout_ref.rollout.calculate_log_probs=true", "trainer.total_training_steps=2", *overrides]
    run_ppo(args, tmp_path)
    rows = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert "actor/pg_loss" in row and "actor/entropy" in row
        if mode == "decoupled":  # token IS: the max of the weights truncated at the threshold (2.0)
            assert row["rollout_corr/rollout_is_max"] <= 2.0 + 1e-6
        else:  # sequence IS: verl's rollout_is_max is the untruncated ratio's; above 2.0 only if some ratio was cut
            high = row["rollout_corr/rollout_is_ratio_fraction_high"]
            assert row["rollout_corr/rollout_is_max"] <= 2.0 + 1e-6 or high > 0, row
        if mode == "decoupled":  # the trainer's metrics: the hf rollout holds the actor's float32 weights, no gap
            assert row["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-4), row
            assert row["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.0, abs=1e-6)
            assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        else:  # the actor's metrics, per micro-batch: the policy moves away from the rollout's within the step
            assert math.isfinite(row["rollout_corr/kl"]) and "rollout_corr/rollout_rs_seq_mean_k3_mean" in row
