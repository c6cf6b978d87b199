"""The decode benchmark (benchmarks/bench_decode.py): its KV-read count by hand, and a short run printing a row per
cache layout, lane count and length (the shared-prompt rows reading less of the cache than the per-row ones)."""

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


def test_a_short_run_prints_both_layouts():
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
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["shared"], ["per-row"])]
    assert [(r[0], int(r[1]), int(r[2])) for r in rows] == [
        (layout, lanes, tokens) for layout in ("shared", "per-row") for lanes in (1, 2) for tokens in (4, 8)
    ]  # one decode lane and two (the default --lanes 1,2)
    kv_mb = {(r[0], int(r[1]), int(r[2])): float(r[6]) for r in rows}
    assert kv_mb[("shared", 1, 8)] < kv_mb[("per-row", 1, 8)]
    assert "memory read bandwidth" in proc.stdout
