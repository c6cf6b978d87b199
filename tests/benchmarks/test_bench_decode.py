"""The decode benchmark (benchmarks/bench_decode.py): its KV-read count by hand, and a short run printing a row per
path and length (the shared-prompt rows reading less of the cache than the per-row ones), and a bad path refused."""

import os
import subprocess
import sys

from transformers import Qwen2Config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import bench_decode  # noqa: E402


def test_kv_bytes_per_step_by_hand():
    config = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    # per position and layer: keys + values, 2 KV heads x 64 dims x 4 bytes = 1024 bytes; 4 layers
    per_row = bench_decode.kv_bytes_per_step(config, prompt_tokens=100, response_pos=10, shared=False)
    assert per_row == 4 * 1024 * (128 * 100 + 128 * 10)
    shared = bench_decode.kv_bytes_per_step(config, prompt_tokens=100, response_pos=10, shared=True)
    assert shared == 4 * 1024 * (16 * 100 + 128 * 10)


def test_a_short_run_prints_every_path():
    cmd = [
        sys.executable,
        os.path.join(REPO_ROOT, "benchmarks", "bench_decode.py"),
        "--lengths",
        "4,8",
        "--repeats",
        "1",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = bench_decode.PATHS
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in paths]
    assert [(r[0], int(r[1])) for r in rows] == [(path, tokens) for path in paths for tokens in (4, 8)]
    kv_mb = {(r[0], int(r[1])): float(r[5]) for r in rows}
    assert kv_mb[("cpu-shared", 8)] < kv_mb[("cpu-per_row", 8)] == kv_mb[("generic", 8)]
    assert "memory read bandwidth" in proc.stdout
    bad = subprocess.run([*cmd[:2], "--paths", "gpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--paths: unknown ['gpu']" in bad.stderr
