"""The overrides every test run of the PPO trainer passes: this project's small-CPU settings where verl's
defaults (which `ppo_trainer.yaml` holds) are GPU or large-scale settings. Not a test module.

`CPU_OVERRIDES` is a Hydra dotlist (prepend it to `python -m verl.trainer.main_ppo` arguments; a test's own
overrides come after it and win); `cpu_config(*overrides)` is the YAML with both merged, for tests that build
the config in-process.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

import verl

CONFIG_YAML = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "ppo_trainer.yaml")

CPU_OVERRIDES = [
    "actor_rollout_ref.rollout.name=hf",
    "trainer.device=cpu",
    "trainer.logger=[console]",
    "trainer.n_gpus_per_node=1",
    "trainer.total_epochs=1",
    "trainer.balance_batch=false",
    "trainer.log_val_generations=3",
    "trainer.project_name=verl_cpu",
    "trainer.experiment_name=grpo_tiny",
    "data.val_files=null",
    "data.train_batch_size=8",
    "data.max_response_length=128",
    "data.dataloader_num_workers=0",
    "data.filter_overlong_prompts=true",
    "data.return_raw_chat=false",
    "data.seed=1",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.seed=0",
    "actor_rollout_ref.rollout.calculate_log_probs=false",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.fsdp_config.dtype=float32",
    "actor_rollout_ref.ref.fsdp_config.dtype=float32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.data_loader_seed=1",
    "critic.model.path=${actor_rollout_ref.model.path}",
    "critic.model.enable_gradient_checkpointing=false",
    "critic.model.use_remove_padding=false",
    "critic.fsdp.dtype=float32",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "critic.forward_micro_batch_size_per_gpu=16",
    "critic.ppo_max_token_len_per_gpu=16384",
    "critic.data_loader_seed=1",
]


def cpu_config(*overrides: str) -> DictConfig:
    """`ppo_trainer.yaml` with `CPU_OVERRIDES` and then `overrides` (a dotlist) merged, unresolved."""
    config = OmegaConf.load(CONFIG_YAML)
    return OmegaConf.merge(config, OmegaConf.from_dotlist(CPU_OVERRIDES + list(overrides)))
