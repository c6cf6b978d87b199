"""The README's main job, shortened: `bash train_grpo.sh` with no model or data given builds the tiny model, the
synthetic RLLA task and an SFT warm start, then runs GRPO through `main_ppo` (Ray, workers, reward by data_source).

Shortened to SFT_STEPS SFT steps and GRPO_STEPS GRPO steps (fixed seed, offline); the test checks the launcher's
summary (validation reward before and after, sampled and greedy, wall time), that both the sampled and the greedy
validation reward went up, and the plot and TensorBoard files. The full-length job's figures are in the README;
`benchmarks/learn_vs_trl.py` runs it beside its reward-free control and TRL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The full warm start: after 100 SFT steps the greedy answers are still too broken (wrong format) for 12 GRPO steps
# to lift them, while after 300 the greedy answer is the stale (version-1) call that GRPO learns to correct.
SFT_STEPS = 300
# 20 GRPO steps: 12 lifted the sampled reward by +0.07 to +0.14 from warm starts that differ only in float rounding
# (the SFT's kernels, thread counts), too close to the +0.1 checked below; 16 gave +0.17 and +0.25 (2026-11-29), and
# +0.098 in one run of the suite on two workers after the decode kernels changed the generations' rounding (2026-12-02)
GRPO_STEPS = 20
GRPO_LR = 3e-4  # 1.5x the full job's: 20 steps instead of 120
GREEDY_GAIN = 0.1  # of the greedy validation reward (one answer per prompt, do_sample=false)


def test_shortened_main_job_learns_and_draws_its_plot(tmp_path):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "WORK_DIR": str(tmp_path / "default"),
        "SFT_STEPS": str(SFT_STEPS),
        "SEED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("BASE_MODEL", None)
    env.pop("DATA_DIR", None)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [
            "bash",
            "train_grpo.sh",
            f"trainer.total_training_steps={GRPO_STEPS}",
            f"actor_rollout_ref.actor.optim.lr={GRPO_LR}",
            f"trainer.test_freq={GRPO_STEPS}",
            f"trainer.default_local_dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"

    # the three stages of the default job left their outputs
    for sub in ("base_model/config.json", "sft_model/config.json", "data/train.parquet", "data/test.parquet"):
        assert (tmp_path / "default" / sub).is_file(), sub

    # the summary: validation reward before and after, and that it went up by a margin (7 = the reward's range)
    match = re.search(r"validation reward: before (-?[\d.]+) -> after (-?[\d.]+)", out)
    assert match, out[-3000:]
    before, after = float(match.group(1)), float(match.group(2))
    assert after > before + 0.1, (before, after)  # the reward ranges over 7
    greedy = re.search(r"rlla/reward/greedy: before (-?[\d.]+) -> after (-?[\d.]+)", out)
    assert greedy, out[-3000:]
    greedy_before, greedy_after = float(greedy.group(1)), float(greedy.group(2))
    assert greedy_after > greedy_before + GREEDY_GAIN, (greedy_before, greedy_after)  # the model's best answer too
    assert re.search(r"rlla/reward/mean@4: before -?[\d.]+ -> after -?[\d.]+", out)
    assert re.search(r"main job wall time \(prepare \+ train\): \d+m\d\ds", out)

    # one metrics line per step, validation at step 0 and at the end, the plot and TensorBoard events
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    train_steps = sorted({r["step"] for r in rows if "critic/score/mean" in r})
    assert train_steps == list(range(1, GRPO_STEPS + 1))
    val = {r["step"]: r["val/reward/mean"] for r in rows if "val/reward/mean" in r}
    assert val[0] == pytest.approx(before, abs=1e-4) and val[GRPO_STEPS] == pytest.approx(after, abs=1e-4)
    greedy_rows = {r["step"]: r["val-core/rlla/reward/greedy"] for r in rows if "val/reward/greedy" in r}
    assert greedy_rows[0] == pytest.approx(greedy_before, abs=1e-4)
    assert greedy_rows[GRPO_STEPS] == pytest.approx(greedy_after, abs=1e-4)
    plot = run_dir / "logs" / "curves.png"
    assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "logs").rglob("events.out.tfevents.*"))
