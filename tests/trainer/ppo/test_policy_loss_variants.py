"""Tests for verl/trainer/ppo/policy_loss_variants.py (dppo_tv, dppo_kl, sapo, geo_mean, dro): each loss against a
reference written here token by token in plain Python, its gradient, its metrics, masked tokens, truncated IS,
the registry, and the config keys it reads reaching it through the config check and the actor."""

import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer.config.test_config_surface import _compose
from tests.workers.test_dp_actor import PROMPT_LENS, RESPONSE_LENS, actor_config, add_ppo_fields, make_batch, make_model
from verl.trainer.config import prepare_config
from verl.trainer.ppo import core_algos, policy_loss_variants
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.actor import DataParallelPPOActor

NAMES = ["dppo_tv", "dppo_kl", "sapo", "geo_mean", "dro"]
METRIC_KEYS = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}

# 3 responses x 4 tokens; the last two tokens of response 1 and the last one of response 2 are padding
OLD = [[-0.5, -1.2, -0.05, -2.0], [-0.3, -0.9, -1.5, -0.7], [-2.5, -0.15, -0.6, -1.0]]
NEW = [[-0.2, -1.8, -0.5, -1.55], [-0.9, -0.4, -1.3, -0.75], [-1.0, -0.1, -0.2, -1.1]]
ADV = [[1.0, 1.0, -0.5, 1.5], [-1.0, 2.0, 0.0, -0.5], [0.5, -2.0, 1.0, 0.7]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
ROLLOUT = [[-0.9, -1.0, -0.3, -2.6], [-0.2, -1.9, -1.1, -0.2], [-2.4, -0.6, -0.1, -1.3]]


def tensors(new=NEW, old=OLD, adv=ADV, mask=MASK):
    return (
        torch.tensor(old),
        torch.tensor(new, requires_grad=True),
        torch.tensor(adv),
        torch.tensor(mask, dtype=torch.float32),
    )


def tokens():
    """(i, t, old, new, adv) for every unmasked token."""
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if m:
                yield i, t, OLD[i][t], NEW[i][t], ADV[i][t]


def n_tokens():
    return sum(sum(row) for row in MASK)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def base_config(**overrides):
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    config.update(overrides)
    return config


# ---------------------------------------------------------------------------------------------- DPPO


def dppo_reference(valid_fn, clip_c):
    """token-mean loss, gradient d loss / d logp, clipfrac, clipfrac_lower, ppo_kl of a DPPO loss, by hand."""
    loss, kl, invalid, lower = 0.0, 0.0, 0.0, 0.0
    grad = [[0.0] * 4 for _ in MASK]
    for i, t, o, n, a in tokens():
        ratio = math.exp(n - o)
        weight = min(ratio, clip_c)
        valid = valid_fn(math.exp(n), math.exp(o), a)
        loss += -a * weight * n * valid
        grad[i][t] = -a * weight * valid / n_tokens()
        invalid += 1 - valid
        lower += (ratio > clip_c) * valid
        kl += o - n
    count = n_tokens()
    return loss / count, grad, invalid / count, lower / count, kl / count


def tv_valid(low, high):
    return lambda p, p_old, a: float(p - p_old <= high) if a > 0 else float(p - p_old >= -low)


def kl_valid(low, high):
    def valid(p, p_old, a):
        kl = p_old * (math.log(p_old) - math.log(p)) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        return float(kl <= high or p <= p_old) if a > 0 else float(kl <= low or p >= p_old)

    return valid


@pytest.mark.parametrize(
    "name, valid_fn",
    [("dppo_tv", tv_valid(0.15, 0.1)), ("dppo_kl", kl_valid(0.15, 0.05))],
)
def test_dppo_value_gradient_and_metrics_by_hand(name, valid_fn):
    high = 0.1 if name == "dppo_tv" else 0.05
    config = base_config(clip_ratio_low=0.15, clip_ratio_high=high, clip_ratio_c=1.5)
    old, new, adv, mask = tensors()
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", config)
    want, grad, clipfrac, lower, kl = dppo_reference(valid_fn, clip_c=1.5)
    assert 0 < clipfrac < 1 and 0 < lower  # the inputs exercise both the trust region and the truncation
    assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)
    assert set(metrics) == METRIC_KEYS and all(isinstance(v, float) for v in metrics.values())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(lower)
    assert metrics["actor/ppo_kl"] == pytest.approx(kl, rel=1e-5)


def test_dppo_truncation_defaults_to_20_without_clip_ratio_c():
    old, new, adv, mask = tensors()
    loss, _ = get_policy_loss_fn("dppo_tv")(old, new, adv, mask, "token-mean", {"clip_ratio": 0.3})
    want, *_ = dppo_reference(tv_valid(0.3, 0.3), clip_c=20.0)
    assert loss.item() == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------- SAPO


def test_sapo_soft_gate_is_seq_mean_token_mean_by_hand():
    tau_pos, tau_neg = 1.5, 2.5
    config = base_config(tau_pos=tau_pos, tau_neg=tau_neg)
    old, new, adv, mask = tensors()
    loss, metrics = get_policy_loss_fn("sapo")(old, new, adv, mask, "token-mean", config)  # mode is ignored
    seq_sum, seq_len = [0.0] * 3, [sum(row) for row in MASK]
    grad = [[0.0] * 4 for _ in MASK]
    for i, t, o, n, a in tokens():
        ratio, tau = math.exp(n - o), tau_pos if a > 0 else tau_neg
        s = sigmoid(tau * (ratio - 1))
        seq_sum[i] += -a * s * 4 / tau
        grad[i][t] = -a * 4 * s * (1 - s) * ratio / seq_len[i] / len(MASK)  # d gate / d logp = 4 s (1-s) ratio
    assert loss.item() == pytest.approx(sum(s / n for s, n in zip(seq_sum, seq_len)) / len(MASK), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
    assert set(metrics) == METRIC_KEYS


def test_sapo_gate_has_the_policy_gradient_slope_at_ratio_one():
    old, _, adv, mask = tensors()
    new = old.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn("sapo")(old, new, adv, mask, config={})  # verl's tau_pos 1.0, tau_neg 1.05
    loss.backward()
    seq_len = mask.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(new.grad, -adv * mask / seq_len / 3)


@pytest.mark.parametrize("taus", [{"tau_pos": 0.0}, {"tau_neg": -1.0}])
def test_sapo_rejects_non_positive_temperatures(taus):
    old, new, adv, mask = tensors()
    with pytest.raises(ValueError, match="tau_pos > 0 and actor.tau_neg > 0"):
        get_policy_loss_fn("sapo")(old, new, adv, mask, config=taus)


# ------------------------------------------------------------------------------------------ geo_mean


def geo_mean_reference(low, high, seq_weights=None):
    """Per-sequence GMPO losses and the clip fractions, by hand."""
    losses, clip_hi, clip_lo = [], 0, 0
    for i, row in enumerate(MASK):
        idx = [t for t, m in enumerate(row) if m]
        clipped_sum = 0.0
        for t in idx:
            x, a = NEW[i][t] - OLD[i][t], ADV[i][t]
            if a > 0:
                xc = min(x, high)
            elif a < 0:
                xc = max(x, -low)
            else:
                xc = 0.0
            clipped_sum += xc
            out_of_range = x > high or x < -low
            clip_hi += out_of_range and a > 0
            clip_lo += out_of_range and a < 0
        seq_adv = sum(ADV[i][t] for t in idx) / len(idx)
        loss = -seq_adv * math.exp(clipped_sum / len(idx))
        losses.append(loss * (1.0 if seq_weights is None else seq_weights[i]))
    return losses, clip_hi / n_tokens(), clip_lo / n_tokens()


def test_geo_mean_sequence_ratio_and_clip_fractions_by_hand():
    config = base_config(clip_ratio_low=0.3, clip_ratio_high=0.25)
    old, new, adv, mask = tensors()
    loss, metrics = get_policy_loss_fn("geo_mean")(old, new, adv, mask, "seq-mean-token-sum", config)  # mode ignored
    losses, clip_hi, clip_lo = geo_mean_reference(0.3, 0.25)
    assert clip_hi > 0 and clip_lo > 0
    assert loss.item() == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clip_hi)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(clip_lo)
    kl = sum(o - n for _, _, o, n, _ in tokens()) / n_tokens()
    assert metrics["actor/ppo_kl"] == pytest.approx(kl, rel=1e-5)


def test_geo_mean_gradient_flows_only_through_unclipped_tokens():
    old, new, adv, mask = tensors()
    loss, _ = get_policy_loss_fn("geo_mean")(
        old, new, adv, mask, config={"clip_ratio_low": 0.3, "clip_ratio_high": 0.25}
    )
    loss.backward()
    grad = [[0.0] * 4 for _ in MASK]
    losses, _, _ = geo_mean_reference(0.3, 0.25)
    for i, row in enumerate(MASK):
        for t in range(4):  # d(-A_i exp(mean x_c)) / d logp_t = L_i / |y_i| where x_c follows x, else 0
            x, a = NEW[i][t] - OLD[i][t], ADV[i][t]
            follows = (a > 0 and x <= 0.25) or (a < 0 and x >= -0.3)
            grad[i][t] = losses[i] / sum(row) / 3 * row[t] * follows
    assert any(g == 0 for g, m in zip(sum(grad, []), sum(MASK, [])) if m)  # some token is clipped
    torch.testing.assert_close(new.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)


def test_geo_mean_normalises_by_the_global_sequence_count():
    old, new, adv, mask = tensors()
    info = {"dp_size": 2, "global_batch_size": 8, "batch_num_tokens": 40}
    loss, _ = get_policy_loss_fn("geo_mean")(old, new, adv, mask, config=base_config(global_batch_info=info))
    losses, _, _ = geo_mean_reference(0.2, 0.2)
    assert loss.item() == pytest.approx(sum(losses) / 8 * 2, rel=1e-5)


@pytest.mark.parametrize("source", ["tis", "rollout_is_weights"])
def test_geo_mean_importance_weight_is_the_geometric_mean_per_sequence(source):
    cap = 1.5
    old, new, adv, mask = tensors()
    fn = get_policy_loss_fn("geo_mean")
    if source == "tis":
        config = base_config(tis_imp_ratio_cap=cap)
        loss, _ = fn(old, new, adv, mask, config=config, rollout_log_probs=torch.tensor(ROLLOUT))
    else:
        weights = torch.exp(old - torch.tensor(ROLLOUT)).clamp(max=cap)
        loss, _ = fn(old, new, adv, mask, config=base_config(), rollout_is_weights=weights)
    seq_weights = []
    for i, row in enumerate(MASK):
        logs = [math.log(min(math.exp(OLD[i][t] - ROLLOUT[i][t]), cap) + 1e-10) for t in range(4) if row[t]]
        seq_weights.append(math.exp(sum(logs) / len(logs)))
    losses, _, _ = geo_mean_reference(0.2, 0.2, seq_weights)
    assert loss.item() == pytest.approx(sum(losses) / 3, rel=1e-5)


# ---------------------------------------------------------------------------------------------- DRO


def test_dro_value_gradient_and_metric_by_hand():
    beta = 0.7
    old, new, adv, mask = tensors()
    config = base_config(policy_loss={"loss_mode": "dro", "dro_beta": beta})
    loss, metrics = get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean", config)
    want = sum(-(n * a - 0.5 * beta * (n - o) ** 2) for _, _, o, n, a in tokens()) / n_tokens()
    assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    grad = [[0.0] * 4 for _ in MASK]
    for i, t, o, n, a in tokens():
        grad[i][t] = -(a - beta * (n - o)) / n_tokens()
    torch.testing.assert_close(new.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)
    assert set(metrics) == {"actor/ppo_kl"}  # verl's dro returns this metric only
    assert metrics["actor/ppo_kl"] == pytest.approx(sum(o - n for _, _, o, n, _ in tokens()) / n_tokens(), rel=1e-5)


@pytest.mark.parametrize("policy_loss", [None, {}, {"dro_beta": None}, {"dro_beta": 0.0}, {"dro_beta": -1.0}])
def test_dro_needs_a_positive_beta(policy_loss):
    old, new, adv, mask = tensors()
    with pytest.raises(ValueError, match="policy_loss.dro_beta must be a positive value"):
        get_policy_loss_fn("dro")(old, new, adv, mask, config={"policy_loss": policy_loss})


# ------------------------------------------------------------------------------------------- common


def full_config():
    return base_config(tau_pos=1.0, tau_neg=1.05, policy_loss={"loss_mode": "x", "dro_beta": 0.1})


@pytest.mark.parametrize("name", NAMES)
def test_registered_exported_and_in_the_variant_table(name):
    fn = getattr(policy_loss_variants, f"compute_policy_loss_{name}")
    assert get_policy_loss_fn(name) is fn is getattr(core_algos, f"compute_policy_loss_{name}")
    assert policy_loss_variants.VARIANT_POLICY_LOSSES[name] is fn
    assert f"compute_policy_loss_{name}" in core_algos.__all__
    assert core_algos.PolicyLossFn is policy_loss_variants.PolicyLossFn and "PolicyLossFn" in core_algos.__all__


def test_variants_module_does_not_import_core_algos():
    code = "import sys, verl.trainer.ppo.policy_loss_variants; print('verl.trainer.ppo.core_algos' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_are_ignored(name):
    old, new, adv, mask = tensors()
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", full_config())
    garbage = mask == 0
    old2 = torch.where(garbage, torch.full_like(old, -0.01), old)
    new2 = torch.where(garbage, torch.full_like(old, -7.0), new.detach()).requires_grad_(True)
    adv2 = torch.where(garbage, torch.full_like(adv, 50.0), adv)
    loss2, metrics2 = get_policy_loss_fn(name)(old2, new2, adv2, mask, "token-mean", full_config())
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    assert metrics2 == pytest.approx(metrics, rel=1e-6)
    loss2.backward()
    assert torch.all(new2.grad[garbage] == 0) and new2.grad[~garbage].abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_global_batch_info_and_omegaconf_configs(name):
    old, new, adv, mask = tensors()
    plain = full_config()
    omega = OmegaConf.create({**plain, "clip_ratio_low": None, "clip_ratio_high": None})  # nulls fall back
    want, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", plain)
    got, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", omega)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    info = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 8}
    scaled, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", {**plain, "global_batch_info": info})
    local = n_tokens() if name in ("dppo_tv", "dppo_kl", "dro") else 3  # tokens or sequences
    denominator = 40 if name in ("dppo_tv", "dppo_kl", "dro") else 8
    assert scaled.item() == pytest.approx(want.item() * local / denominator * 2, rel=1e-5)


@pytest.mark.parametrize("source", ["tis", "rollout_is_weights"])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "dro", "sapo"])
def test_importance_weights_multiply_token_losses(name, source):
    """TIS (tis_imp_ratio_cap with rollout_log_probs) or verl's rollout_is_weights: w times each token's loss."""
    cap = 1.5
    old, new, adv, mask = tensors()
    rollout = torch.tensor(ROLLOUT)
    weights = torch.exp(old - rollout).clamp(max=cap)
    assert ((torch.exp(old - rollout) > cap) & (mask > 0)).any()
    fn = get_policy_loss_fn(name)
    config = full_config()
    if source == "tis":
        tis_config = {**config, "tis_imp_ratio_cap": cap}
        with_tis, _ = fn(old, new, adv, mask, "token-sum", tis_config, rollout_log_probs=rollout)
    else:
        with_tis, _ = fn(old, new, adv, mask, "token-sum", config, rollout_is_weights=weights)
    without, _ = fn(old, new, adv, mask, "token-sum", config, rollout_log_probs=rollout)  # cap unset: off
    per_token = torch.zeros(3, 4)  # each token's loss, through one-hot masks (sapo: a one-token sequence mean)
    for i in range(3):
        for t in range(4):
            one = torch.zeros(3, 4)
            one[i, t] = 1.0
            per_token[i, t] = fn(old, new, adv, one, "token-sum", config)[0].detach()
    if name == "sapo":  # seq-mean-token-mean over the 3 rows of token sums / token counts
        lengths = mask.sum(dim=-1)
        assert with_tis.item() == pytest.approx(((per_token * weights * mask).sum(-1) / lengths).mean().item())
        assert without.item() == pytest.approx(((per_token * mask).sum(-1) / lengths).mean().item(), rel=1e-5)
    else:
        assert with_tis.item() == pytest.approx((per_token * weights * mask).sum().item(), rel=1e-5)
        assert without.item() == pytest.approx((per_token * mask).sum().item(), rel=1e-5)


# -------------------------------------------------------------------------------- config and actor


def test_config_keys_are_accepted_and_typed():
    config = prepare_config(
        _compose(
            "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
            "actor_rollout_ref.actor.policy_loss.dro_beta=0.05",
            "actor_rollout_ref.actor.tau_pos=2",
            "actor_rollout_ref.actor.tau_neg=3.5",
        )
    )
    actor = config.actor_rollout_ref.actor
    assert (actor.tau_pos, actor.tau_neg, actor.policy_loss.dro_beta) == (2, 3.5, 0.05)
    with pytest.raises(ValueError, match="dro_beta='big' has type str"):
        prepare_config(_compose("actor_rollout_ref.actor.policy_loss.dro_beta=big"))


@pytest.mark.parametrize("name", ["sapo", "dro"])
def test_the_actor_hands_the_keys_to_the_loss(name, monkeypatch):
    seen = []
    real = core_algos.POLICY_LOSS_REGISTRY[name]

    def spy(*args, **kwargs):
        config = kwargs["config"]
        seen.append((config.tau_pos, config.tau_neg, config.policy_loss.dro_beta))
        return real(*args, **kwargs)

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, name, spy)
    torch.manual_seed(0)
    model = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), model, old_shift=0.1)
    policy_loss = {"loss_mode": name, "dro_beta": 0.25}
    config = actor_config(policy_loss=policy_loss, tau_pos=1.25, tau_neg=2.0)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.1))
    metrics = actor.update_policy(data)
    assert seen == [(1.25, 2.0, 0.25)]
    assert len(metrics["actor/pg_loss"]) == 1 and math.isfinite(metrics["actor/pg_loss"][0])
    assert "actor/ppo_kl" in metrics
