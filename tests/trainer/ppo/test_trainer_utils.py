"""`verl.trainer.ppo.utils`: which roles a config needs (verl's rules) and the trainer's start-up checks, each
failing with the key, its value and what to set."""

from __future__ import annotations

import pytest

from tests.cpu_overrides import cpu_config
from verl.trainer.ppo.utils import check_trainer_config, need_critic, need_reference_policy, need_reward_model


def test_roles_follow_verls_rules():
    assert need_critic(cpu_config("algorithm.adv_estimator=gae"))
    assert not need_critic(cpu_config("algorithm.adv_estimator=grpo"))
    assert need_critic(cpu_config("algorithm.adv_estimator=grpo", "critic.enable=true"))
    assert not need_critic(cpu_config("algorithm.adv_estimator=gae", "critic.enable=false"))
    assert need_reference_policy(cpu_config("actor_rollout_ref.actor.use_kl_loss=true"))
    assert need_reference_policy(cpu_config("actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true"))  # fmt: skip
    assert not need_reference_policy(cpu_config("actor_rollout_ref.actor.use_kl_loss=false"))
    assert not need_reward_model(cpu_config())


def test_a_valid_config_passes():
    check_trainer_config(cpu_config(), n_actor_processes=2, train_size=100)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.adv_estimator=optimal_token_baseline"],
            "algorithm.adv_estimator=optimal_token_baseline needs .* set actor_rollout_ref.actor.calculate_sum_pi_squared=true",
        ),
        (
            [
                "algorithm.adv_estimator=tir_optimal_token_baseline",
                "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                "actor_rollout_ref.actor.recompute_old_log_prob=false",
            ],
            "recompute_old_log_prob=false skips; set it to true",
        ),
        (["algorithm.adv_estimator=gdpo"], "adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "dro_beta=None; policy_loss.loss_mode=dro needs a positive"),  # fmt: skip
        (
            ["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.0"],
            "dro_beta=0.0",
        ),
        (["algorithm.adv_estimator=nosuch"], "nosuch"),
        (["data.train_batch_size=6"], "data.train_batch_size=6 must be divisible by .*ppo_mini_batch_size=8"),
        (["trainer.resume_mode=sometimes"], "trainer.resume_mode='sometimes'; allowed: auto, disable, resume_path"),
    ],
)
def test_bad_combinations_fail_at_start_up_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_trainer_config(cpu_config(*overrides), n_actor_processes=1, train_size=100)


def test_samples_must_split_over_the_workers_and_the_data_must_fill_a_batch():
    with pytest.raises(ValueError, match=r"= 32 samples must be divisible by the number of worker processes \(3"):
        check_trainer_config(cpu_config(), n_actor_processes=3, train_size=100)
    with pytest.raises(ValueError, match="the training set has 5 prompts, fewer than data.train_batch_size=8"):
        check_trainer_config(cpu_config(), n_actor_processes=1, train_size=5)


def test_the_optimal_token_baseline_passes_with_its_inputs():
    cfg = cpu_config(
        "algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"
    )
    check_trainer_config(cfg, n_actor_processes=1, train_size=100)
