"""What a PPO run needs, read from its config (verl's `verl.trainer.ppo.utils`): `Role`, `need_reference_policy`,
`need_reward_model`, `need_critic`, the reward model's own pool (`reward_model_pool_spec`), and the trainer's
start-up checks (`check_trainer_config`): batch sizes, worker counts, and the inputs an estimator or a loss needs
from other config keys, each failing with one line that names the key, its value and what is allowed.

Layer 8 helper (below `ray_trainer`): reads configs only; no workers, Ray or models.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from verl.trainer.config.typed import build_typed_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.resource_pool import Role
from verl.workers.reward_model_worker import check_reward_model_config

__all__ = [
    "Role",
    "check_trainer_config",
    "need_critic",
    "need_reference_policy",
    "need_reward_model",
    "reward_model_pool_spec",
]

# estimators that read the actor's per-token sum of squared probabilities and its old log-probs
_OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


def need_reference_policy(config: DictConfig) -> bool:
    """A reference policy is needed for a KL term: in the reward (`algorithm.use_kl_in_reward`) or the loss."""
    return bool(config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss)


def reward_model_section(config: DictConfig) -> Any:
    """`reward.reward_model` ({} when absent)."""
    return (config.get("reward") or {}).get("reward_model") or {}


def need_reward_model(config: DictConfig) -> bool:
    """`reward.reward_model.enable`: a reward-model worker group scores every response (`rm_scores`)."""
    return bool(reward_model_section(config).get("enable", False))


def reward_model_pool_spec(config: DictConfig) -> dict[str, list[int]]:
    """`{"reward_pool": [n_gpus_per_node] * nnodes}` when the reward model has processes of its own
    (`reward.reward_model.enable_resource_pool`); `{}` when it shares the global pool (the default)."""
    section = reward_model_section(config)
    if not (need_reward_model(config) and section.get("enable_resource_pool", False)):
        return {}
    sizes = {key: section.get(key) for key in ("n_gpus_per_node", "nnodes")}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"reward.reward_model.{key}={value!r} must be a positive integer with "
                "reward.reward_model.enable_resource_pool=true (on CPU n_gpus_per_node counts processes)"
            )
    return {"reward_pool": [sizes["n_gpus_per_node"]] * sizes["nnodes"]}


def need_critic(config: DictConfig) -> bool:
    """`critic.enable` when set, else whether the estimator is GAE (verl's rule)."""
    enable = config.critic.get("enable", None)
    if enable is not None:
        return bool(enable)
    return config.algorithm.adv_estimator == core_algos.AdvantageEstimator.GAE


# ------------------------------------------------------------------------------------------ start-up checks
def _check_sizes(cfg: DictConfig, n_actor_processes: int, train_size: int) -> None:
    """Positive batch sizes, train_batch_size divisible by the mini-batch, samples divisible by the workers."""
    actor = cfg.actor_rollout_ref.actor
    positive = {
        "data.train_batch_size": cfg.data.train_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "actor_rollout_ref.rollout.n": cfg.actor_rollout_ref.rollout.n,
        "actor_rollout_ref.actor.ppo_mini_batch_size": actor.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_epochs": actor.ppo_epochs,
        "trainer.total_epochs": cfg.trainer.total_epochs,
    }
    if not actor.use_dynamic_bsz:  # verl: a token budget needs no count
        positive["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] = actor.ppo_micro_batch_size_per_gpu
    # the old-log-prob and reference passes (the workers need them; verl checks them before starting)
    positive["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] = (
        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    )
    if need_reference_policy(cfg):
        ref = cfg.actor_rollout_ref.ref
        positive["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = ref.log_prob_micro_batch_size_per_gpu
    for key, value in positive.items():
        if value is None or int(value) <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    bs, mini, n = cfg.data.train_batch_size, actor.ppo_mini_batch_size, cfg.actor_rollout_ref.rollout.n
    if bs % mini != 0:
        raise ValueError(
            f"data.train_batch_size={bs} must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size={mini}"
        )
    if (mini * n) % n_actor_processes != 0:
        raise ValueError(
            f"ppo_mini_batch_size * rollout.n = {mini * n} samples must be divisible by the number of worker "
            f"processes ({n_actor_processes} = trainer.nnodes * trainer.n_gpus_per_node)"
        )
    if train_size < bs:
        raise ValueError(f"the training set has {train_size} prompts, fewer than data.train_batch_size={bs}")


def _check_algorithm_inputs(cfg: DictConfig) -> None:
    """What an estimator or a loss reads from elsewhere in the config is there (else it fails mid-run)."""
    estimator = str(cfg.algorithm.adv_estimator)
    actor = cfg.actor_rollout_ref.actor
    if estimator in ("grpo", "rloo", "grpo_passk", "opo") and cfg.actor_rollout_ref.rollout.n < 2:
        print(f"warning: adv_estimator={estimator} with rollout.n=1 gives zero advantages")
    if estimator in _OPTIMAL_TOKEN_BASELINES:
        if not actor.get("calculate_sum_pi_squared", False):
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs the actor's sum of squared probabilities; set "
                "actor_rollout_ref.actor.calculate_sum_pi_squared=true"
            )
        if not actor.get("recompute_old_log_prob", True):
            raise ValueError(
                f"algorithm.adv_estimator={estimator} reads sum_pi_squared from the old-log-prob pass, which "
                "actor_rollout_ref.actor.recompute_old_log_prob=false skips; set it to true"
            )
    if estimator == "gdpo" and not cfg.algorithm.get("gdpo_reward_keys"):
        raise ValueError(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the reward components (keys the "
            "reward function returns) to normalise one by one"
        )
    loss_mode = str(actor.policy_loss.loss_mode)
    beta = actor.policy_loss.get("dro_beta")
    if loss_mode == "dro" and (beta is None or float(beta) <= 0):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.dro_beta={beta!r}; policy_loss.loss_mode=dro needs a positive "
            "float (the weight of the squared log-ratio penalty)"
        )


def check_trainer_config(cfg: DictConfig, n_actor_processes: int, train_size: int) -> None:
    """The trainer's start-up checks (ValueError, one line): registered estimator and loss, batch sizes and
    worker counts, the inputs the chosen estimator/loss need, the reward model and `trainer.resume_mode`."""
    build_typed_config(cfg)  # verl's dataclasses: types, ranges and unknown keys, each error naming the key
    core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator)  # unknown name -> ValueError listing names
    core_algos.get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
    _check_sizes(cfg, n_actor_processes, train_size)
    _check_algorithm_inputs(cfg)
    if need_reward_model(cfg):
        check_reward_model_config(reward_model_section(cfg))
    if cfg.trainer.resume_mode not in ("auto", "disable", "resume_path"):
        raise ValueError(f"trainer.resume_mode={cfg.trainer.resume_mode!r}; allowed: auto, disable, resume_path")
