# Sourced by examples/grpo_trainer/run_grpo.sh and examples/ppo_trainer/run_ppo.sh (from the repository root):
# makes GSM8K parquet in DATA_DIR (default data/gsm8k) from GSM8K_RAW (default ../shared/data/gsm8k) when missing,
# and, without BASE_MODEL, builds a tiny random Qwen2 whose tokenizer is trained on GSM8K's text.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
GSM8K_RAW=${GSM8K_RAW:-../shared/data/gsm8k}
export DATA_DIR=${DATA_DIR:-data/gsm8k}
if [ ! -f "$DATA_DIR/train.parquet" ]; then
  "$PY" examples/data_preprocess/gsm8k.py --input_dir "$GSM8K_RAW" --local_dir "$DATA_DIR"
fi
if [ -z "${BASE_MODEL:-}" ]; then
  export BASE_MODEL=outputs/tiny_gsm8k
  if [ ! -f "$BASE_MODEL/config.json" ]; then
    "$PY" -m verl.models.tiny --out "$BASE_MODEL" --size xs --corpus "$GSM8K_RAW/train.jsonl"
  fi
fi
