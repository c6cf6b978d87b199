#!/usr/bin/env bash
# ReMax end to end as a rollout workflow plus a loss (AReaL-lite's ReMax example) on CPU:
#   workflow `remax`: per prompt, a sampled and a greedy completion, both scored by the reward function;
#   estimator `remax`: advantage = r(sample) - r(greedy) on every response token (no normalisation);
#   loss `reinforce`: -log p(token) * advantage, on-policy (one optimizer step per batch).
#
#   bash examples/remax_reinforce/run_remax_reinforce.sh [hydra overrides ...]
#   BASE_MODEL=/models/Qwen2.5-0.5B-Instruct DATA_DIR=data/gsm8k bash examples/remax_reinforce/run_remax_reinforce.sh
#
# Environment: BASE_MODEL (HF model dir) and DATA_DIR (train.parquet + test.parquet); both unset = the embedded
# default (the synthetic RLLA tool-calling task and a tiny Qwen2 warm-started with SFT, prepared once in WORK_DIR,
# default outputs/default), SEED, N_GPUS, PYTHON. It runs with the CPU settings of
# scripts/launcher_common.sh (CPU_JOB); on GPUs pass verl's values as overrides. Every argument is a Hydra
# override of main_ppo (the last word wins).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launcher_common.sh  # PY, SEED, PLACEMENT, CPU_JOB
WORK_DIR=${WORK_DIR:-outputs/default}
if [ -z "${BASE_MODEL:-}" ]; then
  "$PY" -m verl.trainer.prepare_default --out "$WORK_DIR" --seed "$SEED"
  BASE_MODEL=$WORK_DIR/sft_model
  DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
fi
DATA_DIR=${DATA_DIR:?set DATA_DIR to a folder holding train.parquet and test.parquet}

exec "$PY" -m verl.trainer.main_ppo "${PLACEMENT[@]}" "${CPU_JOB[@]}" \
  actor_rollout_ref.model.path="$BASE_MODEL" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  algorithm.adv_estimator=remax \
  actor_rollout_ref.rollout.workflow=remax \
  actor_rollout_ref.actor.policy_loss.loss_mode=reinforce \
  actor_rollout_ref.rollout.n=1 \
  data.max_prompt_length=384 data.max_response_length=64 data.train_batch_size=16 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.ppo_epochs=1 actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.rollout.val_kwargs.n=4 actor_rollout_ref.rollout.val_kwargs.do_sample=true \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 data.val_max_samples=32 \
  trainer.total_training_steps=20 trainer.test_freq=10 trainer.save_freq=0 trainer.seed="$SEED" \
  trainer.experiment_name=remax_reinforce_seed"$SEED" \
  trainer.logger='[console,tensorboard]' \
  "$@"
