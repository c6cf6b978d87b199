#!/usr/bin/env bash
# Multi-domain RLVR (ROLL's pipeline) on CPU: one model trained on GSM8K-style math, RLLA tool calls and small code
# tasks together. Each step takes 50% math, 25% tools, 25% code prompts (data.domain_interleave_probs), scores each
# domain with its own reward workers (math_rule, rlla, code_sandbox), processes rewards per domain, and regenerates
# groups whose samples all scored the same (DAPO's filter_groups, at most 2 rounds a step).
#
#   bash examples/rlvr_multi_domain/run_rlvr_multi_domain.sh [hydra overrides ...]
#   BASE_MODEL=/models/Qwen2.5-0.5B-Instruct bash examples/rlvr_multi_domain/run_rlvr_multi_domain.sh trainer.device=cuda
#
# Environment: BASE_MODEL (HF model dir; unset = build a tiny random Qwen2, a smoke run of the pipeline: it does not
# learn these tasks in minutes), WORK_DIR (default outputs/rlvr_multi_domain: data, model, checkpoints, logs),
# DATA_DIR (default $WORK_DIR/data, made by prepare_data.py when missing), GSM8K_DIR (real GSM8K jsonl for the math
# domain instead of generated problems), N_GPUS, PYTHON. It runs with the CPU settings of
# scripts/launcher_common.sh (CPU_JOB); on GPUs pass verl's values as overrides. Every argument is a Hydra
# override of main_ppo (the last word wins).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launcher_common.sh  # PY, PLACEMENT, CPU_JOB
WORK_DIR=${WORK_DIR:-outputs/rlvr_multi_domain}
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}

if [ ! -f "$DATA_DIR/code/test.parquet" ]; then
  "$PY" examples/rlvr_multi_domain/prepare_data.py --local_dir "$DATA_DIR" ${GSM8K_DIR:+--gsm8k_dir "$GSM8K_DIR"}
fi
if [ -z "${BASE_MODEL:-}" ]; then
  BASE_MODEL=$WORK_DIR/tiny_model
  [ -f "$BASE_MODEL/config.json" ] || "$PY" -m verl.models.tiny --out "$BASE_MODEL"
fi

domain() {  # domain NAME REWARD [extra settings] -> one entry of data.domains
  echo "$1: {train_files: ['$DATA_DIR/$1/train.parquet'], val_files: ['$DATA_DIR/$1/test.parquet'], reward: $2${3:-}}"
}
DOMAINS="{$(domain math math_rule), $(domain tools rlla ', weight: 0.5, reward_clip: 3.0'), $(domain code code_sandbox)}"

exec "$PY" -m verl.trainer.main_ppo "${PLACEMENT[@]}" "${CPU_JOB[@]}" \
  actor_rollout_ref.model.path="$BASE_MODEL" \
  data.domains="$DOMAINS" \
  data.domain_interleave_probs="{math: 0.5, tools: 0.25, code: 0.25}" \
  data.val_tag_key=domain \
  data.max_prompt_length=384 data.max_response_length=32 data.train_batch_size=4 \
  algorithm.adv_estimator=reinforce algorithm.reward_norm=group \
  algorithm.overlong_mask=drop \
  algorithm.filter_groups.enable=true algorithm.filter_groups.max_num_gen_batches=2 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.actor.policy_loss.loss_mode=topr \
  trainer.total_training_steps=20 trainer.test_freq=10 trainer.save_freq=10 \
  trainer.experiment_name=rlvr_multi_domain trainer.default_local_dir="$WORK_DIR/checkpoints" \
  trainer.logger='[console,tensorboard]' \
  "$@"
