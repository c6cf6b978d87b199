"""examples/remax_reinforce: the run script trains the tiny model with the `remax` workflow, the `remax` estimator
and the `reinforce` loss through the real entry point; the advantages it trains on are r(sample) - r(greedy),
computed in the rollout workflow (the trainer runs no greedy pass of its own and does not re-score)."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "remax_reinforce", "run_remax_reinforce.sh")


@pytest.mark.slow
@pytest.mark.ray
def test_example_trains_with_remax_workflow_and_reinforce_loss(tiny_model_dir, tmp_path):
    records = generate_records(10, seed=7)
    pd.DataFrame(records_to_rows(records[:8], "train")).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(records_to_rows(records[8:], "test")).to_parquet(tmp_path / "test.parquet")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "BASE_MODEL": tiny_model_dir,
           "DATA_DIR": str(tmp_path), "PYTHON": sys.executable}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    args = [
        "data.max_response_length=12", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "data.val_max_samples=2", "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}", "trainer.ray_init.num_cpus=2",
    ]  # fmt: skip
    proc = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training finished" in proc.stdout
    steps = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    steps = [s for s in steps if s["step"] > 0]
    assert [s["step"] for s in steps] == [1, 2]
    for metrics in steps:
        assert metrics["rollout/rejected_samples"] == 0.0
        assert "timing_s/gen_max" not in metrics and "timing_s/reward" not in metrics  # the workflow did both
        assert metrics["actor/pg_clipfrac"] == 0.0  # reinforce: no ratio, no clipping
        assert "critic/score/mean" in metrics and "critic/advantages/mean" in metrics
