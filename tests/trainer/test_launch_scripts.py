"""verl's and ToolRL's own launch command lines train here on CPU, unchanged.

The command lines are in tests/fixtures/launch/ (ToolRL's examples/grpo_trainer/run_grpo.sh and
examples/ppo_trainer/run_ppo.sh, verl's quickstart PPO command), each with "$@" appended. Only BASE_MODEL,
DATA_DIR, N_GPUS (and ROLLOUT_TP_SIZE, EXPERIMENT_NAME, which the scripts read) are set; the test appends
overrides for batch sizes, lengths and step counts (the last word wins) plus the run folder. They name
`rollout.name=vllm`, wandb and GPU offload: on this CPU machine the run says so in notices and trains.
The data is parquet made by `python dataset/rlla_4k_raw/rlla.py` from the real RLLA records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.workers.rollout import engine_device

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "tests" / "fixtures" / "launch"
REAL_RLLA = REPO.parent / "shared" / "data" / "rlla" / "rlla_sft.json"

# sizes for a 2-core CPU: the scripts' own values are for 8 GPUs; the last word wins
SMALL = [
    "data.train_batch_size=4",
    "data.val_batch_size=4",
    "data.max_prompt_length=1024",
    "data.max_response_length=16",
    "data.dataloader_num_workers=0",
    "data.filter_overlong_prompts=true",
    "data.val_max_samples=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.n=2",
    "critic.ppo_mini_batch_size=4",
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.val_before_train=false",
]


@pytest.fixture(scope="module")
def rlla_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rlla_parquet")
    source = ["--input", str(REAL_RLLA)] if REAL_RLLA.is_file() else ["--synthetic", "60"]
    subprocess.run([sys.executable, str(REPO / "dataset/rlla_4k_raw/rlla.py"), *source, "--local_dir", str(out)],
                   check=True, capture_output=True, cwd=REPO)  # fmt: skip
    return out


def _launch(
    script: str, model: str, data: Path, run_dir: Path, *extra: str
) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable,
           "BASE_MODEL": model, "DATA_DIR": str(data), "N_GPUS": "1", "ROLLOUT_TP_SIZE": "1",
           "EXPERIMENT_NAME": run_dir.name, "WANDB_MODE": "offline", "WANDB_DIR": str(run_dir)}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    args = [*SMALL, f"trainer.default_local_dir={run_dir}", "ray_kwargs.ray_init.num_cpus=2", *extra]
    proc = subprocess.run(["bash", str(LAUNCH / script), *args], cwd=run_dir.parent, env=env, capture_output=True,
                          text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = {}
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics.setdefault(record.get("step"), {}).update(record)
    return proc, metrics


def test_toolrl_run_grpo_trains_on_cpu(tiny_model_dir, rlla_data, tmp_path):
    proc, metrics = _launch("toolrl_run_grpo.sh", tiny_model_dir, rlla_data, tmp_path / "toolrl_grpo")
    # what ToolRL's script sets that cannot run here is said, not silently dropped: vllm where it is not installed
    # (the hf engine runs instead), or what vllm on CPU runs without
    if engine_device("vllm") == "cpu":
        assert "notice: vllm on CPU runs without actor_rollout_ref.rollout.{free_cache_engine=true" in proc.stderr
    else:
        assert "actor_rollout_ref.rollout.name=vllm" in proc.stderr and "hf engine" in proc.stderr
    assert "grad_offload" in proc.stderr and "param_offload" in proc.stderr
    assert {1, 2} <= set(metrics)
    assert "actor/pg_loss" in metrics[2] and "critic/score/mean" in metrics[2]
    assert not any(k.startswith("critic/vf_loss") for k in metrics[2])  # GRPO: no critic


def test_toolrl_run_ppo_trains_a_critic_on_cpu(tiny_model_dir, rlla_data, tmp_path):
    proc, metrics = _launch("toolrl_run_ppo.sh", tiny_model_dir, rlla_data, tmp_path / "toolrl_ppo")
    # ToolRL's global micro-batch sizes become per-worker sizes, its critic offload keys move, as verl did
    assert "ppo_micro_batch_size_per_gpu" in proc.stderr and "critic.fsdp.param_offload" in proc.stderr
    assert {1, 2} <= set(metrics)
    assert "critic/vf_loss" in metrics[2] and "critic/values/mean" in metrics[2]  # adv_estimator unset: gae


def test_verl_quickstart_ppo_trains_a_critic_on_cpu(tiny_model_dir, rlla_data, tmp_path):
    _, metrics = _launch("verl_quickstart_ppo.sh", tiny_model_dir, rlla_data, tmp_path / "quickstart")
    assert {1, 2} <= set(metrics)
    assert "critic/vf_loss" in metrics[2] and "actor/pg_loss" in metrics[2]
