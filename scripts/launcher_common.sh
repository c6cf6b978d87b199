# Shared by train_grpo.sh and train_ppo.sh (sourced, not run): picks the Python, prepares the embedded default
# job when BASE_MODEL is unset, checks the data files, and builds the overrides every launch passes.
#
# Environment: BASE_MODEL (HF model dir; unset = build the tiny default), DATA_DIR (train.parquet + test.parquet),
# EXPERIMENT_NAME, N_GPUS (GPUs per node; on CPU worker processes per node), NNODES, SEED, WORK_DIR (default job
# folder), SFT_STEPS (SFT warm-start steps of the default job), CONTROL (=1: the reward-free control run, every
# training response scored 0 by verl/utils/reward_score/control.py, validation by the real reward), PYTHON.
# ToolRL's reward switches (WITHLENGTH, CORRECTMAX1, MAX1STEP30MAX3, SCHEDULEREWARD, SCHEDULELENGTH, REFINEDREWARD,
# COARSEREWARD, INTERMEDIATEREWARD =1) are read by the RLLA reward at call time.

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
SEED=${SEED:-1}
LAUNCH_START=$SECONDS

# PLACEMENT: where every launch runs (N_GPUS worker processes per node, NNODES nodes; the GPU when one is
# visible, else the CPU; the `hf` rollout engine). CPU_JOB: what a CPU job (the embedded default, the CPU examples)
# sets explicitly where verl's defaults are GPU settings (bfloat16 compute, gradient checkpointing, 8 data-loader
# processes). A later override wins.
PLACEMENT=(
  trainer.n_gpus_per_node="${N_GPUS:-1}" trainer.nnodes="${NNODES:-1}"
  actor_rollout_ref.rollout.name=hf trainer.device=auto
)
CPU_JOB=(
  actor_rollout_ref.actor.fsdp_config.dtype=float32 actor_rollout_ref.ref.fsdp_config.dtype=float32
  actor_rollout_ref.rollout.dtype=float32 critic.fsdp.dtype=float32
  actor_rollout_ref.model.enable_gradient_checkpointing=false actor_rollout_ref.model.use_remove_padding=false
  critic.model.enable_gradient_checkpointing=false critic.model.use_remove_padding=false
  data.dataloader_num_workers=0 data.filter_overlong_prompts=true data.return_raw_chat=false data.seed=1
  actor_rollout_ref.actor.shuffle=true actor_rollout_ref.actor.data_loader_seed=1 critic.data_loader_seed=1
  actor_rollout_ref.rollout.seed=0 actor_rollout_ref.rollout.calculate_log_probs=false
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 critic.ppo_micro_batch_size_per_gpu=16
  critic.forward_micro_batch_size_per_gpu=16
  trainer.balance_batch=false trainer.log_val_generations=3 trainer.project_name=verl_cpu
)

# Sets BASE_MODEL, DATA_DIR, EMBEDDED (1 when the embedded default job is used), COMMON (overrides of every
# launch) and RUN_SUFFIX ("_control" with CONTROL=1, for the launchers' experiment names).
resolve_model_and_data() {
  if [ -z "${BASE_MODEL:-}" ]; then
    local work=${WORK_DIR:-outputs/default}
    local sft_steps=()
    [ -n "${SFT_STEPS:-}" ] && sft_steps=(--sft_steps "$SFT_STEPS")
    # OpenMP's own waiting (spin a while, then sleep), with each SFT step's thread count following the machine's
    # load (fsdp_sft_trainer.step_thread_policy, as the trainer's CPU workers run): ~15% faster steps than sleeping
    # threads (OMP_WAIT_POLICY=PASSIVE, the setting before) on a quiet machine, and no spinning against a busy one
    "$PY" -m verl.trainer.prepare_default --out "$work" --seed "$SEED" "${sft_steps[@]}"
    BASE_MODEL=$work/sft_model
    DATA_DIR=$work/data
    EMBEDDED=1
  else
    if [ -z "${DATA_DIR:-}" ]; then
      echo "error: BASE_MODEL is set but DATA_DIR is not; set DATA_DIR to a folder holding train.parquet and test.parquet" >&2
      exit 1
    fi
    EMBEDDED=0
  fi
  local f
  for f in "$DATA_DIR/train.parquet" "$DATA_DIR/test.parquet"; do
    if [ ! -f "$f" ]; then
      echo "error: missing data file $f; make RLLA parquet with 'python dataset/rlla_4k_raw/rlla.py --local_dir $DATA_DIR'" \
        "(or --synthetic N) or GSM8K with 'python examples/data_preprocess/gsm8k.py --local_dir $DATA_DIR'" >&2
      exit 1
    fi
  done
  COMMON=(
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet"
    actor_rollout_ref.model.path="$BASE_MODEL"
    "${PLACEMENT[@]}" trainer.logger=[console,tensorboard]
  )
  RUN_SUFFIX=""  # appended to the experiment name (and so the run folder) of a control run
  if [ "${CONTROL:-0}" = 1 ]; then
    RUN_SUFFIX=_control
    COMMON+=(reward.custom_reward_function.path=verl/utils/reward_score/control.py
      reward.custom_reward_function.name=compute_score)
  elif [ "${CONTROL:-0}" != 0 ]; then
    echo "error: CONTROL=${CONTROL}; allowed: 1 (the reward-free control run) or 0 / unset" >&2
    exit 1
  fi
  if [ -n "${EXPERIMENT_NAME:-}" ]; then
    COMMON+=(trainer.experiment_name="${EXPERIMENT_NAME}${RUN_SUFFIX}")
  fi
}

# Runs main_ppo with the given arguments; for the embedded default job, also prints the total wall time
# (preparation + training) after main_ppo's own summary.
run_main_ppo() {
  if [ "$EMBEDDED" != 1 ]; then
    exec "$PY" -m verl.trainer.main_ppo "$@"
  fi
  local rc=0
  "$PY" -m verl.trainer.main_ppo "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    local total=$((SECONDS - LAUNCH_START))
    printf 'main job wall time (prepare + train): %dm%02ds\n' $((total / 60)) $((total % 60))
  fi
  return "$rc"
}
