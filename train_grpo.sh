#!/usr/bin/env bash
# GRPO launcher: bash train_grpo.sh [hydra overrides ...]
#
# Without BASE_MODEL it runs the embedded default on CPU: builds a tiny Qwen2 model and tokenizer,
# generates the synthetic RLLA tool-calling task, warm-starts the model with SFT, then trains it
# with GRPO and prints validation reward before/after (see README).
# With BASE_MODEL=<HF model dir> DATA_DIR=<dir with train.parquet, test.parquet> it trains that model.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
SEED=${SEED:-1}
if [ -z "${BASE_MODEL:-}" ]; then
  WORK=${WORK_DIR:-outputs/default}
  "$PY" -m verl.trainer.prepare_default --out "$WORK" --seed "$SEED"
  BASE_MODEL=$WORK/sft_model
  DATA_DIR=$WORK/data
  DEFAULTS=(
    data.max_prompt_length=384 data.max_response_length=64 data.train_batch_size=8
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
    actor_rollout_ref.actor.optim.lr=2e-4 actor_rollout_ref.actor.use_kl_loss=true
    actor_rollout_ref.actor.kl_loss_coef=0.02 actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.val_kwargs.n=4 actor_rollout_ref.rollout.val_kwargs.do_sample=true
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    trainer.total_training_steps=60 trainer.test_freq=10 trainer.save_freq=0
    trainer.experiment_name=grpo_default_seed${SEED} trainer.seed=$SEED
  )
else
  DATA_DIR=${DATA_DIR:?set DATA_DIR to a folder holding train.parquet and test.parquet}
  DEFAULTS=()
fi
exec "$PY" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  actor_rollout_ref.model.path="$BASE_MODEL" \
  "${DEFAULTS[@]}" "$@"
