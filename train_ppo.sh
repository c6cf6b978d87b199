#!/usr/bin/env bash
# PPO (GAE with a critic) launcher: bash train_ppo.sh [hydra overrides ...]
# Same model and data logic as train_grpo.sh: the embedded default without BASE_MODEL, else BASE_MODEL + DATA_DIR.
# Environment variables: see scripts/launcher_common.sh. Every argument is passed to main_ppo as an override.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/launcher_common.sh
resolve_model_and_data
DEFAULTS=()
if [ "$EMBEDDED" = 1 ]; then
  DEFAULTS=(
    "${CPU_JOB[@]}"
    data.max_prompt_length=384 data.max_response_length=100 data.train_batch_size=8
    actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.optim.lr=1e-4 critic.optim.lr=1e-4 trainer.critic_warmup=0
    trainer.total_training_steps=40 trainer.test_freq=10 trainer.save_freq=0
    trainer.experiment_name=ppo_default_seed${SEED}${RUN_SUFFIX} trainer.seed=$SEED
  )
fi
run_main_ppo algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95 \
  "${DEFAULTS[@]}" "${COMMON[@]}" "$@"
