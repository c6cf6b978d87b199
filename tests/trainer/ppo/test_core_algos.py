"""Tests for verl.trainer.ppo.core_algos: every estimator and loss against a reference written here in plain Python."""

import math
import statistics

import numpy as np
import pytest
import torch

from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import (
    AdvantageEstimator,
    agg_loss,
    compute_advantage,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)

# ---------------------------------------------------------------------------------------------- fixtures

# 7 responses of length 5 in 3 groups of sizes 3, 3 and 1; one response has a masked observation token inside.
UIDS = np.array(["a", "a", "b", "a", "b", "b", "c"], dtype=object)
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0],  # token 2 is a tool observation
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
    ],
    dtype=torch.float32,
)
SCORES = [1.0, 0.0, 2.0, 3.0, -1.0, 0.5, 4.0]


def outcome_rewards():
    """Score placed on each response's last valid token."""
    rewards = torch.zeros_like(MASK)
    for i, score in enumerate(SCORES):
        last = max(t for t in range(MASK.shape[1]) if MASK[i, t] > 0)
        rewards[i, last] = score
    return rewards


def dense_rewards(seed=0):
    torch.manual_seed(seed)
    return torch.randn(MASK.shape) * MASK


def groups():
    out = {}
    for i, uid in enumerate(UIDS):
        out.setdefault(uid, []).append(i)
    return out


def whiten_by_hand(rows, mask):
    """masked_whiten written out: mean and unbiased variance over masked entries."""
    selected = [x for row, m_row in zip(rows, mask.tolist()) for x, m in zip(row, m_row) if m > 0]
    mean = sum(selected) / len(selected)
    var = sum((x - mean) ** 2 for x in selected) / (len(selected) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def broadcast(per_seq):
    return torch.tensor(per_seq).unsqueeze(-1) * MASK


# ------------------------------------------------------------------------------------------ registries


def test_advantage_estimator_enum_and_builtin_names():
    assert AdvantageEstimator.GAE == "gae" and AdvantageEstimator.GRPO.value == "grpo"
    names = [e.value for e in AdvantageEstimator]
    assert names == [
        "gae",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "opo",
        "grpo_passk",
        "gpg",
        "rloo_vectorized",
        "grpo_vectorized",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
        "gdpo",
    ]
    for name in names + ["reinforce"]:
        assert callable(get_adv_estimator_fn(name))
    assert get_adv_estimator_fn(AdvantageEstimator.RLOO) is core_algos.compute_rloo_outcome_advantage
    for name in ["vanilla", "gspo", "clip_cov", "kl_cov", "gpg", "cispo", "reinforce", "topr"]:
        assert callable(get_policy_loss_fn(name))


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"Unknown advantage estimator simply: nope; registered: \['gae'.*'grpo'"):
        get_adv_estimator_fn("nope")
    with pytest.raises(ValueError, match=r"Unsupported loss mode: nope. Supported modes are: .*'gspo'.*'vanilla'"):
        get_policy_loss_fn("nope")


def test_registering_a_taken_name_is_an_error():
    with pytest.raises(ValueError, match="Adv estimator gae has already been registered"):

        @register_adv_est(AdvantageEstimator.GAE)
        def other_gae(token_level_rewards, response_mask, config=None):
            return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match="Policy loss vanilla has already been registered"):

        @register_policy_loss("vanilla")
        def other_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
            return log_prob.sum(), {}

    assert get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    assert get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss_vanilla


# A user's estimator and loss, registered by decorator from outside the package, with verl's signatures.
@register_adv_est("test_core_algos_sign")
def sign_estimator(token_level_rewards, response_mask, index, config=None, **kwargs):
    """Advantage = sign of the score, times the group size (uses index and config like a verl estimator)."""
    sizes = {uid: list(index).count(uid) for uid in index}
    scale = torch.tensor([float(sizes[uid]) for uid in index]) * config["scale"]
    adv = torch.sign(token_level_rewards.sum(-1)).mul(scale).unsqueeze(-1) * response_mask
    return adv, adv


@register_policy_loss("test_core_algos_l1")
def l1_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_log_probs=None
):
    loss = agg_loss((log_prob - old_log_prob).abs() * advantages, response_mask, loss_agg_mode)
    return loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}


def test_custom_policy_loss_is_reached_by_name():
    fn = get_policy_loss_fn("test_core_algos_l1")
    old, new = torch.zeros(1, 2), torch.tensor([[0.5, -1.0]])
    loss, _ = fn(old, new, torch.ones(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.75)


# ----------------------------------------------------------------------------------------- estimators


def test_gae_matches_plain_python_loop_with_observation_token():
    gamma, lam = 0.9, 0.8
    rewards = dense_rewards(1)
    torch.manual_seed(2)
    values = torch.randn(MASK.shape)
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, MASK, gamma, lam)

    raw, want_returns = [], []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), MASK.tolist()):
        next_value, last_gae = 0.0, 0.0
        gae_row = [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t] > 0:
                delta = r_row[t] + gamma * next_value - v_row[t]
                last_gae = delta + gamma * lam * last_gae
                next_value = v_row[t]
            gae_row[t] = last_gae  # carried through masked tokens
        raw.append(gae_row)
        want_returns.append([g + v for g, v in zip(gae_row, v_row)])
    torch.testing.assert_close(ret, torch.tensor(want_returns))
    torch.testing.assert_close(adv, torch.tensor(whiten_by_hand(raw, MASK)))


def test_grpo_group_statistics_by_hand():
    adv, ret = core_algos.compute_grpo_outcome_advantage(outcome_rewards(), MASK, UIDS, epsilon=1e-6)
    want = [0.0] * 7
    for rows in groups().values():
        scores = [SCORES[i] for i in rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (statistics.mean(scores), statistics.stdev(scores))
        for i in rows:
            want[i] = (SCORES[i] - mean) / (std + 1e-6)
    torch.testing.assert_close(adv, broadcast(want))
    assert torch.equal(adv, ret)
    assert adv[6, 0].item() == pytest.approx(4.0 / (1 + 1e-6))  # a group of one keeps its score


def test_grpo_without_std_is_dr_grpo():
    adv, _ = core_algos.compute_grpo_outcome_advantage(outcome_rewards(), MASK, UIDS, norm_adv_by_std_in_grpo=False)
    want = [0.0] * 7
    for rows in groups().values():
        mean = 0.0 if len(rows) == 1 else statistics.mean(SCORES[i] for i in rows)
        for i in rows:
            want[i] = SCORES[i] - mean
    torch.testing.assert_close(adv, broadcast(want))


def test_rloo_leave_one_out_by_hand():
    adv, ret = core_algos.compute_rloo_outcome_advantage(outcome_rewards(), MASK, UIDS)
    want = [0.0] * 7
    for rows in groups().values():
        for i in rows:
            others = [SCORES[j] for j in rows if j != i]
            want[i] = SCORES[i] - statistics.mean(others) if others else SCORES[i]
    torch.testing.assert_close(adv, broadcast(want))
    assert torch.equal(adv, ret)


def test_opo_length_weighted_baseline_by_hand():
    adv, _ = core_algos.compute_opo_outcome_advantage(outcome_rewards(), MASK, UIDS)
    lengths = MASK.sum(-1).tolist()
    want = [0.0] * 7
    for rows in groups().values():
        base = 0.0 if len(rows) == 1 else sum(lengths[j] * SCORES[j] for j in rows) / sum(lengths[j] for j in rows)
        for i in rows:
            want[i] = SCORES[i] - base
    torch.testing.assert_close(adv, broadcast(want))


def test_remax_returns_and_baseline_by_hand():
    rewards = dense_rewards(3)
    baselines = torch.tensor([0.5, -1.0, 0.0, 2.0, 1.0, 0.3, -0.2])
    adv, ret = core_algos.compute_remax_outcome_advantage(rewards, baselines, MASK)
    want_ret = [[sum(r[t:]) for t in range(len(r))] for r in (rewards * MASK).tolist()]
    torch.testing.assert_close(ret, torch.tensor(want_ret))
    torch.testing.assert_close(adv, torch.tensor(want_ret) - baselines.unsqueeze(-1) * MASK)


def test_reinforce_plus_plus_discounted_returns_skip_masked_tokens():
    gamma = 0.7
    rewards = dense_rewards(4)
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, MASK, config={"gamma": gamma})
    want_ret = []
    for r_row, m_row in zip(rewards.tolist(), MASK.tolist()):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t] > 0:
                running = r_row[t] + gamma * running
                row[t] = running  # masked tokens keep return 0
        want_ret.append(row)
    torch.testing.assert_close(ret, torch.tensor(want_ret))
    torch.testing.assert_close(adv, torch.tensor(whiten_by_hand(want_ret, MASK)) * MASK)


def test_reinforce_plus_plus_baseline_by_hand():
    adv, ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(outcome_rewards(), MASK, UIDS)
    centred = [0.0] * 7
    for rows in groups().values():
        mean = 0.0 if len(rows) == 1 else statistics.mean(SCORES[i] for i in rows)
        for i in rows:
            centred[i] = SCORES[i] - mean
    rows = (torch.tensor(centred).unsqueeze(-1) * MASK).tolist()
    torch.testing.assert_close(adv, torch.tensor(whiten_by_hand(rows, MASK)) * MASK)
    assert torch.equal(adv, ret)


def test_gpg_by_hand():
    adv, _ = core_algos.compute_gpg_outcome_advantage(outcome_rewards(), MASK, UIDS)
    alpha = 7 / sum(1 for s in SCORES if s != 0)
    want = [0.0] * 7
    for rows in groups().values():
        mean = 0.0 if len(rows) == 1 else statistics.mean(SCORES[i] for i in rows)
        for i in rows:
            want[i] = alpha * (SCORES[i] - mean)
    torch.testing.assert_close(adv, broadcast(want))


def test_grpo_passk_only_best_gets_advantage():
    uids = np.array(["a", "a", "b", "a", "b", "b", "b"], dtype=object)
    adv, _ = core_algos.compute_grpo_passk_outcome_advantage(outcome_rewards(), MASK, uids, config={})
    scores_a, scores_b = [SCORES[i] for i in (0, 1, 3)], [SCORES[i] for i in (2, 4, 5, 6)]
    want = [0.0] * 7
    want[3] = (3.0 - 1.0) / (statistics.stdev(scores_a) + 1e-6)
    want[6] = (4.0 - 2.0) / (statistics.stdev(scores_b) + 1e-6)
    torch.testing.assert_close(adv, broadcast(want))
    adv_raw, _ = core_algos.compute_grpo_passk_outcome_advantage(
        outcome_rewards(), MASK, uids, config={"norm_adv_by_std_in_grpo": False}
    )
    assert adv_raw[3, 0].item() == pytest.approx(2.0) and adv_raw[6, 0].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 2 samples per group; group 'c' has 1"):
        core_algos.compute_grpo_passk_outcome_advantage(outcome_rewards(), MASK, UIDS)


def test_reinforce_batch_mean_baseline():
    adv, ret = get_adv_estimator_fn("reinforce")(outcome_rewards(), MASK)
    mean = statistics.mean(SCORES)
    torch.testing.assert_close(adv, broadcast([s - mean for s in SCORES]))
    assert torch.equal(adv, ret)


def test_estimator_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 7 rows"):
        core_algos.compute_grpo_outcome_advantage(outcome_rewards(), MASK, np.array(["a", "b"], dtype=object))


# ---------------------------------------------------------------------------------------------- agg_loss


def agg_by_hand(loss, mask, mode, scale=None):
    seqs = [(row, m) for row, m in zip(loss.tolist(), mask.tolist())]
    sums = [sum(x * w for x, w in zip(row, m)) for row, m in seqs]
    counts = [sum(m) for _, m in seqs]
    nonempty = [i for i, c in enumerate(counts) if c > 0]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "token-sum":
        return sum(sums)
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return sum(sums[i] for i in nonempty) / len(nonempty) / (scale or mask.shape[-1])
    raise AssertionError(mode)


AGG_MASK = torch.tensor(
    [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32
)  # row 2 is fully masked


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_agg_loss_single_rank_by_hand(mode):
    torch.manual_seed(5)
    loss_mat = torch.randn(AGG_MASK.shape)
    loss_mat[AGG_MASK == 0] = float("nan")  # outside the mask must not matter
    got = agg_loss(loss_mat, AGG_MASK, mode)
    assert got.item() == pytest.approx(agg_by_hand(loss_mat.nan_to_num(0.0), AGG_MASK, mode), rel=1e-5)


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_agg_loss_is_invariant_to_splitting_over_two_ranks(mode):
    torch.manual_seed(6)
    loss_mat = torch.randn(AGG_MASK.shape)
    full = agg_loss(loss_mat, AGG_MASK, mode)
    global_tokens = int(AGG_MASK.sum())
    global_seqs = int((AGG_MASK.sum(-1) > 0).sum())
    ranks = [slice(0, 2), slice(2, 5)]  # uneven split, the empty row on rank 1
    per_rank = [
        agg_loss(
            loss_mat[r], AGG_MASK[r], mode, dp_size=2, batch_num_tokens=global_tokens, global_batch_size=global_seqs
        )
        for r in ranks
    ]
    # the gradient all-reduce averages over the 2 ranks
    assert (sum(per_rank) / 2).item() == pytest.approx(full.item(), rel=1e-6)


def test_agg_loss_norm_scale_and_errors():
    loss_mat = torch.ones(AGG_MASK.shape)
    got = agg_loss(loss_mat, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=10)
    assert got.item() == pytest.approx(agg_by_hand(loss_mat, AGG_MASK, "seq-mean-token-sum-norm", scale=10))
    with pytest.raises(ValueError, match="token-mean with dp_size=2 needs batch_num_tokens"):
        agg_loss(loss_mat, AGG_MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="seq-mean-token-mean with dp_size=2 needs global_batch_size"):
        agg_loss(loss_mat, AGG_MASK, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match=r"Invalid loss_agg_mode 'mean'.*'token-mean', 'token-sum'"):
        agg_loss(loss_mat, AGG_MASK, "mean")
    assert agg_loss(loss_mat, torch.zeros_like(AGG_MASK), "token-mean").item() == 0.0


# ----------------------------------------------------------------------------------------- policy losses


def policy_inputs(seed=7):
    torch.manual_seed(seed)
    old = -torch.rand(4, 6) * 2
    new = (old + 0.5 * torch.randn(4, 6)).requires_grad_(True)
    adv = torch.randn(4, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]).float()
    return old, new, adv, mask


def token_mean(values, mask):
    pairs = [(v, m) for row, m_row in zip(values, mask.tolist()) for v, m in zip(row, m_row)]
    return sum(v * m for v, m in pairs) / sum(m for _, m in pairs)


def test_vanilla_ppo_with_asymmetric_and_dual_clip_by_hand():
    old, new, adv, mask = policy_inputs()
    adv[0, 0], new.data[0, 0] = -2.0, old[0, 0] + 2.0  # ratio e^2 > clip_ratio_c: dual clip engages
    config = {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 3.0}
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config)

    losses, clipped, lower = [], [], []
    for o_row, n_row, a_row in zip(old.tolist(), new.tolist(), adv.tolist()):
        row_l, row_c, row_low = [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(n - o)
            l1, l2 = -a * ratio, -a * min(max(ratio, 0.9), 1.3)
            pg = max(l1, l2)
            row_c.append(float(l2 > l1))
            row_low.append(float(a < 0 and pg > -a * 3.0))
            row_l.append(min(pg, -a * 3.0) if a < 0 else pg)
        losses.append(row_l), clipped.append(row_c), lower.append(row_low)
    assert loss.item() == pytest.approx(token_mean(losses, mask), rel=1e-5)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(token_mean(clipped, mask))
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(token_mean(lower, mask)) and lower[0][0] == 1.0
    kl = [[o - n for o, n in zip(o_row, n_row)] for o_row, n_row in zip(old.tolist(), new.tolist())]
    assert metrics["actor/ppo_kl"] == pytest.approx(token_mean(kl, mask), rel=1e-5)


def test_vanilla_defaults_and_dual_clip_check():
    old, new, adv, mask = policy_inputs()
    loss_default, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask)
    loss_explicit, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, config={"clip_ratio": 0.2})
    assert loss_default.item() == pytest.approx(loss_explicit.item())
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0.*got 0.5"):
        get_policy_loss_fn("vanilla")(old, new, adv, mask, config={"clip_ratio_c": 0.5})


def test_policy_loss_reads_global_batch_info():
    old, new, adv, mask = policy_inputs()
    info = {"dp_size": 2, "batch_num_tokens": 40}
    loss, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", {"global_batch_info": info})
    plain, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", {})
    n_local = mask.sum().item()
    assert loss.item() == pytest.approx(plain.item() * n_local / 40 * 2, rel=1e-6)
    with pytest.raises(ValueError, match=r"unknown keys \['dp'\]"):
        get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", {"global_batch_info": {"dp": 2}})


def test_policy_losses_accept_omegaconf_config_with_nulls():
    from omegaconf import OmegaConf

    old, new, adv, mask = policy_inputs()
    plain = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    omega = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": None,  # null falls back to clip_ratio
            "clip_ratio_high": 0.28,
            "clip_ratio_c": 3.0,
            "policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "kl_cov_ratio": None},
            "global_batch_info": {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": 4},
        }
    )
    for name in ["vanilla", "gspo", "kl_cov", "cispo"]:
        want, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", plain)
        got, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", omega)
        assert got.item() == pytest.approx(want.item(), rel=1e-6), name


@pytest.mark.parametrize("name", ["vanilla", "cispo", "gpg", "reinforce", "topr"])
def test_truncated_importance_sampling_weights_token_losses(name):
    old, new, adv, mask = policy_inputs()
    rollout = old - torch.randn(4, 6)
    fn = get_policy_loss_fn(name)
    cap = 1.5
    assert ((torch.exp(old - rollout) > cap) & (mask > 0)).any()  # the cap matters for this input
    with_tis, _ = fn(old, new, adv, mask, "token-sum", {"tis_imp_ratio_cap": cap}, rollout_log_probs=rollout)
    off, _ = fn(old, new, adv, mask, "token-sum", {"tis_imp_ratio_cap": -1}, rollout_log_probs=rollout)
    no_rollout, _ = fn(old, new, adv, mask, "token-sum", {"tis_imp_ratio_cap": cap})
    weights = torch.exp(old - rollout).clamp(max=cap)
    # per-token losses of this loss, recovered one token at a time through token-sum on one-hot masks
    per_token = torch.zeros(4, 6)
    for i in range(4):
        for t in range(6):
            one = torch.zeros(4, 6)
            one[i, t] = 1.0
            per_token[i, t] = fn(old, new, adv, one, "token-sum", {})[0].detach()
    assert with_tis.item() == pytest.approx((per_token * weights * mask).sum().item(), rel=1e-5)
    assert off.item() == pytest.approx(no_rollout.item()) == pytest.approx((per_token * mask).sum().item(), rel=1e-5)


def test_gspo_sequence_ratio_value_and_gradient():
    old, new, adv, mask = policy_inputs(8)
    seq_adv = torch.randn(4, 1).expand(4, 6).contiguous()
    config = {"clip_ratio": 10.0}  # no clipping: gradient is -A * s_i / (|y_i| * n_seq) per token
    loss, metrics = get_policy_loss_fn("gspo")(old, new, seq_adv, mask, "token-mean", config)
    per_seq, grads = [], torch.zeros(4, 6)
    for i in range(4):
        valid = [t for t in range(6) if mask[i, t] > 0]
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in valid) / len(valid))
        per_seq.append(-seq_adv[i, 0].item() * s)
        for t in valid:
            grads[i, t] = -seq_adv[i, 0].item() * s / len(valid) / 4
    assert loss.item() == pytest.approx(sum(per_seq) / 4, rel=1e-5)  # seq-mean-token-mean despite "token-mean"
    loss.backward()
    torch.testing.assert_close(new.grad, grads, rtol=1e-5, atol=1e-7)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_cispo_value_gradient_and_clipfrac():
    old, new, adv, mask = policy_inputs(9)
    loss, metrics = get_policy_loss_fn("cispo")(old, new, adv, mask, "token-mean", {"clip_ratio": 0.2})
    ratio = torch.exp(new.detach() - old)
    clipped = ratio.clamp(0.8, 1.2)
    n = mask.sum()
    assert loss.item() == pytest.approx((-(clipped * adv * new.detach()) * mask).sum().item() / n.item(), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(new.grad, -clipped * adv * mask / n)  # ratio gets no gradient
    assert metrics["actor/pg_clipfrac"] == pytest.approx(token_mean(((ratio < 0.8) | (ratio > 1.2)).tolist(), mask))


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
def test_plain_policy_gradient_losses(name):
    old, new, adv, mask = policy_inputs(10)
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", {})
    values = (-new.detach() * adv).tolist()
    assert loss.item() == pytest.approx(token_mean(values, mask), rel=1e-5)
    loss.backward()
    torch.testing.assert_close(new.grad, -adv * mask / mask.sum())
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def test_topr_positive_sft_negative_truncated_ratio():
    old, new, adv, mask = policy_inputs(11)
    config = {"topr_positive_weight": 2.0, "topr_negative_weight": 0.5}
    loss, metrics = get_policy_loss_fn("topr")(old, new, adv, mask, "token-mean", config)
    values, over = [], []
    for o_row, n_row, a_row in zip(old.tolist(), new.tolist(), adv.tolist()):
        row, row_over = [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(n - o)
            row.append(-2.0 * a * n if a > 0 else -0.5 * min(ratio, 1.0) * a * n)
            row_over.append(float(a <= 0 and ratio > 1.0))
        values.append(row), over.append(row_over)
    assert loss.item() == pytest.approx(token_mean(values, mask), rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(token_mean(over, mask))


def test_clip_cov_zeroes_gradient_of_high_covariance_tokens():
    old, new, adv, mask = policy_inputs(12)
    config = {"clip_ratio": 0.2, "policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}}
    loss, metrics = get_policy_loss_fn("clip_cov")(old, new, adv, mask, "token-mean", config)
    logp, m = new.detach().tolist(), mask.tolist()
    valid = [(i, t) for i in range(4) for t in range(6) if m[i][t] > 0]
    mean_a = sum(adv[i, t].item() for i, t in valid) / len(valid)
    mean_l = sum(logp[i][t] for i, t in valid) / len(valid)
    values, zeroed = [[0.0] * 6 for _ in range(4)], [[0.0] * 6 for _ in range(4)]
    for i, t in valid:
        a, ratio = adv[i, t].item(), math.exp(logp[i][t] - old[i, t].item())
        l1, l2 = -a * ratio, -a * min(max(ratio, 0.8), 1.2)
        cov = (a - mean_a) * (logp[i][t] - mean_l)
        drop = not (l2 > l1) and 0.05 < cov < 5.0  # clip_num covers every candidate here
        zeroed[i][t] = float(drop)
        values[i][t] = 0.0 if drop else max(l1, l2)
    assert sum(map(sum, zeroed)) > 0
    assert loss.item() == pytest.approx(token_mean(values, mask), rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(token_mean(zeroed, mask))


def test_kl_cov_adds_kl_term_on_top_covariance_token():
    old, new, adv, mask = policy_inputs(13)
    config = {"policy_loss": {"kl_cov_ratio": 0.01, "ppo_kl_coef": 0.5}}  # int(19 * 0.01) -> k = 1
    loss, metrics = get_policy_loss_fn("kl_cov")(old, new, adv, mask, "token-mean", config)
    logp, m = new.detach().tolist(), mask.tolist()
    valid = [(i, t) for i in range(4) for t in range(6) if m[i][t] > 0]
    mean_a = sum(adv[i, t].item() for i, t in valid) / len(valid)
    mean_l = sum(logp[i][t] for i, t in valid) / len(valid)
    top = max(valid, key=lambda it: (adv[it].item() - mean_a) * (logp[it[0]][it[1]] - mean_l))
    values = [[0.0] * 6 for _ in range(4)]
    for i, t in valid:
        log_ratio = logp[i][t] - old[i, t].item()
        values[i][t] = -adv[i, t].item() * math.exp(log_ratio) + (0.5 * abs(log_ratio) if (i, t) == top else 0.0)
    assert loss.item() == pytest.approx(token_mean(values, mask), rel=1e-5)
    abs_kl = [[abs(n - o) for n, o in zip(n_row, o_row)] for n_row, o_row in zip(logp, old.tolist())]
    assert metrics["actor/ppo_kl"] == pytest.approx(token_mean(abs_kl, mask), rel=1e-5)


# --------------------------------------------------------------------------------------- KL and value


def test_kl_penalty_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    diffs = (logp - ref).tolist()
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor(diffs))
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor(diffs))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([abs(d) for d in diffs]))
    k2 = torch.tensor([0.5 * d * d for d in diffs])
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), k2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), k2)
    k3 = []
    for d in diffs:
        x = min(max(-d, -20.0), 20.0)
        k3.append(min(max(math.exp(x) - x - 1, -10.0), 10.0))
    assert k3[-1] == 10.0  # clamped
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor(k3))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor(k3))


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "k2"])
def test_plus_forms_keep_value_and_take_k2_gradient(base):
    logp = torch.tensor([-1.0, -2.0, -0.3, -4.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0])
    plus = kl_penalty(logp, ref, base + "+")
    torch.testing.assert_close(plus.detach(), kl_penalty(logp.detach(), ref, base))
    weights = torch.tensor([1.0, 2.0, -1.0, 0.5])
    (grad,) = torch.autograd.grad((plus * weights).sum(), logp)
    torch.testing.assert_close(grad, (logp.detach() - ref) * weights)  # d/dlogp of 0.5 (logp - ref)^2


def test_kl_penalty_errors_name_the_mode():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="'full'"):
        kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match=r"Unknown kl_penalty 'k4'.*'low_var_kl'.*'k3\+'"):
        kl_penalty(x, x, "k4")


def test_kl_controllers():
    fixed = core_algos.get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    adaptive = core_algos.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.5, "horizon": 100})
    adaptive.update(current_kl=0.6, n_steps=10)  # error 0.2 -> x1.02
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    adaptive.update(current_kl=5.0, n_steps=10)  # error clipped at 0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 1.02)
    adaptive.update(current_kl=0.45, n_steps=50)  # error -0.1
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.95)
    with pytest.raises(ValueError, match=r"Unknown kl_ctrl.type 'pid'.*'fixed', 'adaptive'"):
        core_algos.get_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="horizon must be > 0.*got 0"):
        core_algos.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 0})


def test_value_loss_clipped_by_hand():
    vpreds = torch.tensor([[1.0, 0.2, -0.5], [2.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.1, 0.0], [1.0, 0.0, 0.8]])
    returns = torch.tensor([[0.0, 1.0, -1.0], [3.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    losses, clipped = [], []
    for vp_row, v_row, r_row in zip(vpreds.tolist(), values.tolist(), returns.tolist()):
        losses.append([]), clipped.append([])
        for vp, v, r in zip(vp_row, v_row, r_row):
            vc = min(max(vp, v - 0.2), v + 0.2)
            losses[-1].append(max((vp - r) ** 2, (vc - r) ** 2))
            clipped[-1].append(float((vc - r) ** 2 > (vp - r) ** 2))
    assert loss.item() == pytest.approx(0.5 * token_mean(losses, mask))
    assert clipfrac.item() == pytest.approx(token_mean(clipped, mask))


def test_entropy_loss_is_masked_mean_of_entropy():
    logits = torch.tensor([[[0.0, 0.0], [1.0, -1.0]], [[3.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]]).float()

    def entropy(row):
        ps = [math.exp(x) / sum(math.exp(y) for y in row) for x in row]
        return -sum(p * math.log(p) for p in ps)

    want = (entropy([0.0, 0.0]) + entropy([1.0, -1.0]) + entropy([3.0, 0.0])) / 3
    assert core_algos.compute_entropy_loss(logits, mask).item() == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------------- DataProto entry points

protocol = pytest.importorskip("verl.protocol")


def make_batch(**extra_tensors):
    prompt_mask = torch.ones(7, 3)
    tensors = {
        "token_level_rewards": outcome_rewards(),
        "attention_mask": torch.cat([prompt_mask, MASK], dim=-1).long(),
        "responses": torch.zeros(7, 5, dtype=torch.long),
        **extra_tensors,
    }
    return protocol.DataProto.from_dict(tensors=tensors, non_tensors={"uid": UIDS})


def test_apply_kl_penalty_by_hand_and_updates_controller():
    torch.manual_seed(14)
    old, ref = -torch.rand(7, 5), -torch.rand(7, 5)
    data = make_batch(token_level_scores=outcome_rewards(), old_log_probs=old, ref_log_prob=ref, response_mask=MASK)
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.01, horizon=1000)
    data, metrics = core_algos.apply_kl_penalty(data, ctrl, kl_penalty="kl")
    kl = (old - ref) * MASK
    torch.testing.assert_close(data.batch["token_level_rewards"], outcome_rewards() - 0.2 * kl)
    per_seq = [sum(row) / sum(m) for row, m in zip(kl.tolist(), MASK.tolist())]
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(statistics.mean(per_seq), rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    err = min(max(statistics.mean(per_seq) / 0.01 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.2 * (1 + err * 7 / 1000))


def test_compute_advantage_grpo_derives_response_mask_from_attention_mask():
    data = compute_advantage(make_batch(), AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=False)
    assert torch.equal(data.batch["response_mask"], MASK.long())
    want, _ = core_algos.compute_grpo_outcome_advantage(outcome_rewards(), MASK, UIDS, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(data.batch["advantages"], want)
    torch.testing.assert_close(data.batch["returns"], want)


def test_compute_advantage_passes_values_baselines_gamma_and_config():
    torch.manual_seed(15)
    values, baselines = torch.randn(7, 5), torch.randn(7)
    data = compute_advantage(make_batch(values=values, response_mask=MASK), "gae", gamma=0.9, lam=0.7)
    want_adv, want_ret = core_algos.compute_gae_advantage_return(outcome_rewards(), values, MASK, 0.9, 0.7)
    torch.testing.assert_close(data.batch["advantages"], want_adv)
    torch.testing.assert_close(data.batch["returns"], want_ret)

    data = compute_advantage(make_batch(reward_baselines=baselines, response_mask=MASK), "remax")
    want_adv, _ = core_algos.compute_remax_outcome_advantage(outcome_rewards(), baselines, MASK)
    torch.testing.assert_close(data.batch["advantages"], want_adv)

    data = compute_advantage(make_batch(response_mask=MASK), "reinforce_plus_plus", config={"gamma": 0.5})
    want_adv, want_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        outcome_rewards(), MASK, config={"gamma": 0.5}
    )
    torch.testing.assert_close(data.batch["returns"], want_ret)
    data = compute_advantage(make_batch(response_mask=MASK), "reinforce_plus_plus", gamma=0.5)  # no config
    torch.testing.assert_close(data.batch["returns"], want_ret)


def test_compute_advantage_runs_a_user_registered_estimator():
    data = compute_advantage(make_batch(response_mask=MASK), "test_core_algos_sign", config={"scale": 2.0})
    sizes = {"a": 3, "b": 3, "c": 1}
    want = [math.copysign(1.0, s) * (s != 0) * sizes[u] * 2.0 for s, u in zip(SCORES, UIDS)]
    torch.testing.assert_close(data.batch["advantages"], broadcast(want))


def test_compute_advantage_errors_name_what_is_missing():
    with pytest.raises(ValueError, match=r"advantage estimator 'gae' needs 'values'"):
        compute_advantage(make_batch(response_mask=MASK), "gae")
    with pytest.raises(ValueError, match=r"Unknown advantage estimator simply: ppo"):
        compute_advantage(make_batch(response_mask=MASK), "ppo")


# ---------------------------------------------------------------- verl 0.9.1 API additions
@pytest.mark.parametrize("norm", [True, False])
def test_vectorized_estimators_match_the_loops(norm):
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    index = np.array(["a", "b", "a", "c", "b", "a", "b"], dtype=object)  # group "c" has one member
    mask = (torch.rand(7, 5, generator=gen) > 0.3).float()
    rewards = torch.randn(7, 5, generator=gen) * mask
    loop, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    vec, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(vec, loop)
    two_each = index[[0, 1, 2, 4]]
    loop, _ = core_algos.compute_rloo_outcome_advantage(rewards[[0, 1, 2, 4]], mask[[0, 1, 2, 4]], two_each)
    vec, _ = core_algos.compute_rloo_vectorized_outcome_advantage(rewards[[0, 1, 2, 4]], mask[[0, 1, 2, 4]], two_each)
    torch.testing.assert_close(vec, loop)
    assert get_adv_estimator_fn("grpo_vectorized") is core_algos.compute_grpo_vectorized_outcome_advantage


def test_deprecated_compute_policy_loss_equals_vanilla_and_compute_rewards():
    gen = torch.Generator().manual_seed(1)
    old, new = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    adv, mask = torch.randn(3, 4, generator=gen), torch.ones(3, 4)
    with pytest.warns(DeprecationWarning, match="compute_policy_loss_vanilla"):
        loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    ref, metrics = core_algos.compute_policy_loss_vanilla(old, new, adv, mask, config={"clip_ratio": 0.2})
    torch.testing.assert_close(loss, ref)
    assert clipfrac.item() == pytest.approx(metrics["actor/pg_clipfrac"])
    assert ppo_kl.item() == pytest.approx(metrics["actor/ppo_kl"])
    rewards = core_algos.compute_rewards(torch.ones(2, 2), torch.zeros(2, 2), torch.full((2, 2), -1.0), kl_ratio=0.5)
    assert rewards.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    torch.testing.assert_close(core_algos.kl_penalty_forward(new, old, "k3"), core_algos.kl_penalty(new, old, "k3+"))


def test_pf_ppo_resampling_keeps_size_and_prefers_high_scores():
    from verl.protocol import DataProto

    scores = torch.zeros(4, 3)
    scores[2, -1] = 5.0
    data = DataProto.from_dict(
        tensors={"token_level_scores": scores, "row": torch.arange(4)}, meta_info={"k": [0, 1, 2, 3]}
    )
    torch.manual_seed(0)
    out = core_algos.compute_pf_ppo_reweight_data(data, reweight_method="pow", weight_pow=2.0)
    assert len(out) == 4 and out.batch["row"].tolist() == [2, 2, 2, 2] and out.meta_info["k"] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="Unsupported reweight_method"):
        core_algos.compute_pf_ppo_reweight_data(data, reweight_method="nope")
