#!/usr/bin/env bash
# PPO (GAE with a critic) on GSM8K, verl's classic example, on CPU (default) or GPUs.
#
#   bash examples/ppo_trainer/run_ppo.sh [hydra overrides ...]
#   BASE_MODEL=/models/Qwen2.5-0.5B-Instruct N_GPUS=8 bash examples/ppo_trainer/run_ppo.sh trainer.device=cuda
#
# Data and model as in examples/grpo_trainer/run_grpo.sh (DATA_DIR, GSM8K_RAW, BASE_MODEL).
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/gsm8k_setup.sh
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-gsm8k_ppo}
exec bash train_ppo.sh \
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=8 \
  actor_rollout_ref.rollout.n=1 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.optim.lr=1e-5 critic.optim.lr=1e-5 data.val_max_samples=64 \
  trainer.total_epochs=1 trainer.test_freq=20 trainer.save_freq=20 "$@"
