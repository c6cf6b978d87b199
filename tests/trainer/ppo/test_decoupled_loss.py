"""AReaL's decoupled PPO objective (`actor.use_decoupled_loss`, verl/trainer/ppo/policy_loss.py) against a hand
computation: PPO clipped against the proximal policy (old_log_probs), each token weighted by
pi_prox / pi_behav (rollout_log_probs), tokens over `behav_imp_weight_cap` dropped but still counted."""

import math

import pytest
import torch

from verl.trainer.ppo.core_algos import get_policy_loss_fn

# 2 sequences x 4 tokens; the last token of sequence 1 is padding
LOG_PROB = [[-1.0, -0.5, -2.0, -0.3], [-1.2, -0.1, -0.7, -5.0]]
OLD = [[-1.1, -0.2, -2.05, -0.9], [-1.0, -0.4, -0.7, -5.0]]  # proximal: the actor before the update
ROLLOUT = [[-1.3, -0.2, -3.0, -0.95], [-1.1, -0.45, -0.6, -4.0]]  # behaviour: the (stale) rollout policy
ADV = [[1.0, 1.0, -1.0, 2.0], [-0.5, 0.5, 1.5, 1.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
CLIP, DUAL = 0.2, 3.0


def hand_loss(cap):
    """Per-token decoupled dual-clip PPO, token-mean over the mask, written out with math only."""
    total, count = 0.0, 0
    grads = [[0.0] * 4 for _ in range(2)]
    tokens = sum(sum(row) for row in MASK)
    for i in range(2):
        for t in range(4):
            if not MASK[i][t]:
                continue
            count += 1
            a, r = ADV[i][t], math.exp(LOG_PROB[i][t] - OLD[i][t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)
            loss, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if a < 0 and loss > -a * DUAL:
                loss, grad = -a * DUAL, 0.0
            w = math.exp(OLD[i][t] - ROLLOUT[i][t])
            if cap is not None and w > cap:
                w = 0.0
            total += loss * w
            grads[i][t] = grad * w / tokens
    return total / count, grads


def config(**overrides):
    base = {"clip_ratio": CLIP, "clip_ratio_low": CLIP, "clip_ratio_high": CLIP, "clip_ratio_c": DUAL}
    base.update(overrides)
    return base


def run(loss_mode, cfg, rollout=ROLLOUT):
    log_prob = torch.tensor(LOG_PROB, requires_grad=True)
    loss, metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=torch.tensor(OLD),
        log_prob=log_prob,
        advantages=torch.tensor(ADV),
        response_mask=torch.tensor(MASK, dtype=torch.float32),
        loss_agg_mode="token-mean",
        config=cfg,
        rollout_log_probs=None if rollout is None else torch.tensor(rollout),
    )
    loss.backward()
    return loss.item(), log_prob.grad.tolist(), metrics


@pytest.mark.parametrize("cap", [None, 2.0])
def test_decoupled_vanilla_loss_and_gradient_match_the_hand_computation(cap):
    expected_loss, expected_grad = hand_loss(cap)
    loss, grad, _ = run("vanilla", config(use_decoupled_loss=True, behav_imp_weight_cap=cap))
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for row, expected_row in zip(grad, expected_grad):
        assert row == pytest.approx(expected_row, abs=1e-6)


def test_the_cap_drops_tokens_and_matters():
    # token (0, 2) has w = exp(-2.05 + 3.0) = 2.59 > 2: dropped with cap 2, kept without a cap
    assert math.exp(OLD[0][2] - ROLLOUT[0][2]) > 2.0
    assert hand_loss(2.0)[0] != pytest.approx(hand_loss(None)[0])
    _, grad, _ = run("vanilla", config(use_decoupled_loss=True, behav_imp_weight_cap=2.0))
    assert grad[0][2] == 0.0


def test_fresh_rollouts_make_it_plain_ppo_and_off_is_unchanged():
    plain, plain_grad, _ = run("vanilla", config(), rollout=None)
    same, same_grad, _ = run("vanilla", config(use_decoupled_loss=True), rollout=OLD)  # behaviour == proximal
    off, off_grad, _ = run("vanilla", config(use_decoupled_loss=False))  # rollout log-probs present but unused
    assert same == pytest.approx(plain, rel=1e-6) and off == plain
    assert torch.allclose(torch.tensor(same_grad), torch.tensor(plain_grad)) and off_grad == plain_grad


def test_reinforce_loss_is_weighted_too():
    loss, _, _ = run("reinforce", config(use_decoupled_loss=True))
    expected = sum(
        -LOG_PROB[i][t] * ADV[i][t] * math.exp(OLD[i][t] - ROLLOUT[i][t])
        for i in range(2)
        for t in range(4)
        if MASK[i][t]
    ) / sum(sum(row) for row in MASK)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_missing_rollout_log_probs_and_double_correction_are_rejected():
    with pytest.raises(ValueError, match="use_decoupled_loss=true needs rollout_log_probs.*calculate_log_probs=true"):
        run("vanilla", config(use_decoupled_loss=True), rollout=None)
    with pytest.raises(ValueError, match="set only one"):
        run("vanilla", config(use_decoupled_loss=True, tis_imp_ratio_cap=2.0))
