"""scripts/launcher_common.sh's CONTROL switch, seen through train_grpo.sh with PYTHON=echo: the overrides the
launcher would pass to `python -m verl.trainer.main_ppo` are printed instead of run (no Python, no training)."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch(tmp_path, **env_vars):
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")  # the launcher checks that both files exist
    env = {k: v for k, v in os.environ.items() if k not in ("CONTROL", "EXPERIMENT_NAME", "WORK_DIR")}
    env.update(PYTHON="echo", BASE_MODEL="some/model", DATA_DIR=str(tmp_path), EXPERIMENT_NAME="exp", **env_vars)
    return subprocess.run(["bash", "train_grpo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_control_scores_training_rows_with_the_constant_reward_in_a_run_folder_of_its_own(tmp_path):
    out = launch(tmp_path, CONTROL="1")
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert "reward.custom_reward_function.path=verl/utils/reward_score/control.py" in args
    assert "reward.custom_reward_function.name=compute_score" in args
    assert "trainer.experiment_name=exp_control" in args
    assert (REPO / "verl" / "utils" / "reward_score" / "control.py").is_file()


def test_without_control_the_real_reward_is_used(tmp_path):
    out = launch(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "custom_reward_function" not in out.stdout and "trainer.experiment_name=exp" in out.stdout.split()


def test_a_bad_control_value_stops_the_launcher(tmp_path):
    out = launch(tmp_path, CONTROL="yes")
    assert out.returncode == 1 and "CONTROL=yes" in out.stderr and out.stdout == ""
