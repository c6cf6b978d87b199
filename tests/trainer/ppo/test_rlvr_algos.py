"""ROLL's algorithms in the registries: the `topr` policy loss (Tapered Off-Policy REINFORCE, Le Roux et al. 2025)
and the `reinforce` estimator with a batch-mean baseline, checked value and gradient against hand computations."""

import pytest
import torch

from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn


def test_topr_gradient_is_sft_on_positive_and_truncated_ratio_on_negative_tokens():
    old = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -1.0, -3.0]])
    new = torch.tensor([[-0.5, -1.5, -2.0], [-1.0, -0.2, -3.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    config = {"topr_positive_weight": 1.5, "topr_negative_weight": 0.5}
    loss, metrics = get_policy_loss_fn("topr")(old, new, adv, mask, "token-mean", config)
    loss.backward()
    n = 5.0  # valid tokens
    ratios = torch.exp(new.detach() - old)  # row 1: e^-0.5 (< 1, kept), e^0.8 (> 1, cut to 1), 1
    expected = torch.tensor(
        [
            [-1.5 * 2.0 / n, -1.5 * 2.0 / n, 0.0],  # positive: -w_pos * A, whatever the ratio (e^0.5, e^-0.5)
            [0.5 * ratios[1, 0].item() / n, 0.5 * 1.0 / n, 0.5 * 1.0 / n],  # negative: -w_neg * min(ratio, 1) * A
        ]
    )
    torch.testing.assert_close(new.grad, expected)
    value = sum(-1.5 * 2.0 * new[0, t].item() for t in range(2)) + sum(
        -0.5 * min(ratios[1, t].item(), 1.0) * -1.0 * new[1, t].item() for t in range(3)
    )
    assert loss.item() == pytest.approx(value / n, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 5)  # one negative token had ratio > 1


def test_topr_on_policy_with_equal_weights_is_reinforce():
    logp = torch.tensor([[-1.0, -2.0], [-0.3, -0.7]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    grads = []
    for name in ("topr", "reinforce"):
        new = logp.clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn(name)(logp, new, adv, mask, "token-mean", {})
        loss.backward()
        grads.append(new.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_reinforce_baseline_is_the_batch_mean_of_sequence_rewards():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [-0.1, 0.0, 2.0], [0.0, 0.5, 0.0]])  # token rewards (e.g. KL-shaped)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = get_adv_estimator_fn("reinforce")(rewards, mask)
    totals = [1.0, 1.9, 0.5]
    mean = sum(totals) / 3
    expected = torch.tensor([[t - mean] * 3 for t in totals]) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)
    assert adv.sum().item() == pytest.approx((totals[0] - mean) * 3 + (totals[1] - mean) * 3 + (totals[2] - mean) * 2)
