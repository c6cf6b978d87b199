"""The benchmark harness (benchmarks/bench_grpo.py) runs its own code path for our trainer end to end, so the
script cannot rot: 2 steps of the bench config through `main_ppo.run_ppo` in a subprocess, figures read back
from the JSON it writes, with the per-phase CPU probe of the worker. TRL, bare HF and the matmul-rate measurement
of the floor are not run here (TRL is a benchmark-only dependency; the FLOP count is tested in test_flops.py)."""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO_ROOT, "benchmarks", "bench_grpo.py")
GSM8K = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gsm8k", "train.jsonl")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs ../shared/data/gsm8k/train.jsonl")
def test_harness_runs_our_trainer_and_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, BENCH, "--runs", "ours", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    cmd += ["--variants", "", "--no-floor", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    ours = figures["summary"]["ours"]
    assert ours["step_s"] > 0 and ours["gen_s"] > 0 and ours["gen_tokens_per_s"] > 0
    assert 0 < ours["peak_rss_work_mb"] <= ours["peak_rss_mb"]
    assert {"gen", "reward", "old_log_prob", "ref", "update_actor"} <= set(ours["phases_s"])
    assert ours["phases_s"]["old_log_prob"] < 0.05 * ours["step_s"]  # reused rollout log-probs: no forward pass
    assert -0.5 < ours["orchestration_share"] < 1
    (run,) = figures["runs"]
    assert len(run["step_s"]) == 2 and all(t > 0 for t in run["gen_tokens"])
    assert "ray orchestration share" in figures["bars"] and "ours/trl step time" not in figures["ratios"]
    step = ours["probe"]["step"]  # CPU seconds of the Ray worker doing the compute, and its priority
    assert step["compute_cpu_s"] > 0 and step["wall_s"] > 0
    assert ours["compute_process"]["nice"] == 0 and ours["compute_process"]["env"]["RAY_worker_niceness"] == "0"
    assert "ours" in proc.stdout and "orch" in proc.stdout  # the printed table
