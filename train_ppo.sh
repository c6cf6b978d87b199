#!/usr/bin/env bash
# PPO (GAE with a critic) launcher: bash train_ppo.sh [hydra overrides ...]
# Same model/data logic as train_grpo.sh (embedded default without BASE_MODEL).
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
    actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.optim.lr=1e-4 critic.optim.lr=1e-4 trainer.critic_warmup=0
    trainer.total_training_steps=40 trainer.test_freq=10 trainer.save_freq=0
    trainer.experiment_name=ppo_default_seed${SEED} trainer.seed=$SEED
  )
else
  DATA_DIR=${DATA_DIR:?set DATA_DIR to a folder holding train.parquet and test.parquet}
  DEFAULTS=()
fi
exec "$PY" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95 \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  actor_rollout_ref.model.path="$BASE_MODEL" \
  "${DEFAULTS[@]}" "$@"
