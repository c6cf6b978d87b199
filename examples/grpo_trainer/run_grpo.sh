#!/usr/bin/env bash
# GRPO on GSM8K, verl's classic example, on CPU (default) or GPUs.
#
#   bash examples/grpo_trainer/run_grpo.sh [hydra overrides ...]
#   BASE_MODEL=/models/Qwen2.5-0.5B-Instruct N_GPUS=8 bash examples/grpo_trainer/run_grpo.sh trainer.device=cuda \
#       actor_rollout_ref.rollout.name=vllm data.train_batch_size=256 actor_rollout_ref.actor.ppo_mini_batch_size=64
#
# Data: DATA_DIR (default data/gsm8k) must hold train.parquet and test.parquet; when it does not, they are made
# from GSM8K_RAW (default ../shared/data/gsm8k: train.jsonl, test.jsonl) by examples/data_preprocess/gsm8k.py.
# Model: BASE_MODEL, or unset to build a tiny random Qwen2 with a tokenizer trained on GSM8K's text (a smoke run
# of the whole pipeline: a random 1M-parameter model does not learn arithmetic in minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/gsm8k_setup.sh
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-gsm8k_grpo}
exec bash train_grpo.sh \
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=8 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.optim.lr=1e-5 data.val_max_samples=64 \
  trainer.total_epochs=1 trainer.test_freq=20 trainer.save_freq=20 "$@"
