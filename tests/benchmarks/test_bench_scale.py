"""The scale benchmark (benchmarks/bench_scale.py) in its quick mode: a small model (size xs), 2 prompts x 2
samples, 16 new tokens, one GRPO step with 2 worker processes through `main_ppo.run_ppo`; the figures it prints
and writes (s/step, tokens/s, per-process peak RSS, per-rank memory during the weight sync) must be there.
The 0.5B-shape run itself takes hours on 2 cores (see benchmarks/README.md)."""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO_ROOT, "benchmarks", "bench_scale.py")
GSM8K = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gsm8k", "train.jsonl")

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs ../shared/data/gsm8k/train.jsonl")
def test_quick_mode_prints_and_writes_every_figure(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, BENCH, "--quick", "--workers", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["setting"]["size"] == "xs" and figures["setting"]["response_length"] == 16
    (summary,) = figures["summaries"]
    assert summary["workers"] == 2 and summary["steps"] == 1 and not summary["timed_out"]
    assert summary["step_s"] > 0 and summary["gen_tokens_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert {"gen", "ref", "update_actor"} <= set(summary["phases_s"])
    names = [p["name"] for p in summary["processes"]]
    assert names[0] == "driver" and {"worker 0", "worker 1"} <= set(names) and "raylet" in names
    assert all(p["peak_rss_mb"] > 0 for p in summary["processes"])
    assert set(summary["weight_sync"]) == {"0", "1"}  # JSON keys: one entry per rank
    for rank in summary["weight_sync"].values():
        assert 0 < rank["rss_before_mb"] <= rank["peak_rss_mb"]
    sizes = summary["sizes"]
    assert 0 < sizes["largest_tensor_mb"] < sizes["shard_mb"] < sizes["rollout_copy_mb"]
    for text in ("s/step", "gen tok/s", "worker 1", "rank 1 weight sync", "one bucket"):
        assert text in proc.stdout
