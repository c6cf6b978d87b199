#!/usr/bin/env bash
# verl's GSM8K multi-turn tool recipe on CPU: verl's tool agent loop (rows with agent_name=tool_agent) calling the
# example's two BaseTool tools (tool_config.yaml), trained with GRPO.
#
#   bash examples/gsm8k_tool_agent/run_gsm8k_tool_agent.sh [hydra overrides ...]
#   BASE_MODEL=/models/Qwen2.5-0.5B-Instruct DATA_DIR=data/gsm8k_tool bash examples/gsm8k_tool_agent/run_gsm8k_tool_agent.sh
#
# Without BASE_MODEL it builds the embedded tiny Qwen2 model (python -m verl.models.tiny), writes 64 synthetic problems
# (prepare_data.py) and warm-starts the model on tool-use demonstrations of them (warm_start.py), all in WORK_DIR
# (default outputs/gsm8k_tool_agent). Every argument is a Hydra override of main_ppo (the last word wins).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launcher_common.sh  # PY, SEED, PLACEMENT, CPU_JOB
EXAMPLE=examples/gsm8k_tool_agent
WORK_DIR=${WORK_DIR:-outputs/gsm8k_tool_agent}
export PYTHONPATH="$PWD/$EXAMPLE${PYTHONPATH:+:$PYTHONPATH}"  # tool_config.yaml names gsm8k_tools.<Class>
if [ -z "${BASE_MODEL:-}" ]; then
  DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
  [ -f "$DATA_DIR/train.parquet" ] || "$PY" "$EXAMPLE/prepare_data.py" --local_dir "$DATA_DIR" --seed "$SEED"
  [ -f "$WORK_DIR/tiny/config.json" ] || "$PY" -m verl.models.tiny --out "$WORK_DIR/tiny" --seed "$SEED"
  [ -f "$WORK_DIR/model/config.json" ] || "$PY" "$EXAMPLE/warm_start.py" --model "$WORK_DIR/tiny" \
    --data "$DATA_DIR/train.parquet" --out "$WORK_DIR/model"
  BASE_MODEL=$WORK_DIR/model
fi
DATA_DIR=${DATA_DIR:?set DATA_DIR to a folder holding train.parquet and test.parquet (prepare_data.py)}

exec "$PY" -m verl.trainer.main_ppo "${PLACEMENT[@]}" "${CPU_JOB[@]}" \
  actor_rollout_ref.model.path="$BASE_MODEL" \
  data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
  data.return_raw_chat=true data.max_prompt_length=384 data.max_response_length=256 data.train_batch_size=8 \
  algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.rollout.multi_turn.enable=true \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$EXAMPLE/tool_config.yaml" \
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \
  actor_rollout_ref.rollout.multi_turn.max_tool_response_length=256 \
  trainer.total_training_steps=4 trainer.test_freq=2 trainer.save_freq=0 trainer.seed="$SEED" \
  trainer.experiment_name=gsm8k_tool_agent_seed"$SEED" trainer.logger='[console]' \
  "$@"
