#!/usr/bin/env bash
# GRPO launcher: bash train_grpo.sh [hydra overrides ...]
#
# Without BASE_MODEL it runs the embedded default on CPU: builds a tiny Qwen2 model and tokenizer, generates the
# synthetic RLLA tool-calling task, warm-starts the model with SFT on partly stale demonstrations, then trains it
# with GRPO and prints the validation reward before/after, sampled and greedy (see README). CONTROL=1 runs the same
# job with a constant training reward (the reward-free control). With BASE_MODEL=<HF model dir> DATA_DIR=<dir with
# train.parquet, test.parquet> it trains that model. Environment variables: see scripts/launcher_common.sh. Every
# argument is passed to `python -m verl.trainer.main_ppo` as an override (the last word wins).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/launcher_common.sh
resolve_model_and_data
DEFAULTS=()
if [ "$EMBEDDED" = 1 ]; then
  DEFAULTS=(
    "${CPU_JOB[@]}"
    data.max_prompt_length=384 data.max_response_length=100 data.train_batch_size=8
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
    actor_rollout_ref.actor.optim.lr=2e-4 actor_rollout_ref.actor.use_kl_loss=false
    actor_rollout_ref.rollout.calculate_log_probs=true actor_rollout_ref.actor.recompute_old_log_prob=false
    actor_rollout_ref.model.share_prompt_prefix=true
    actor_rollout_ref.rollout.val_kwargs.n=4 actor_rollout_ref.rollout.val_kwargs.do_sample=true
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 trainer.val_greedy=true
    trainer.total_training_steps=120 trainer.test_freq=60 trainer.save_freq=0
    trainer.experiment_name=grpo_default_seed${SEED}${RUN_SUFFIX} trainer.seed=$SEED
  )
fi
run_main_ppo algorithm.adv_estimator=grpo "${DEFAULTS[@]}" "${COMMON[@]}" "$@"
