"""Kill and resume: the driver of a tiny GRPO run is SIGKILLed at several moments, then the same command is
run again (`trainer.resume_mode=auto`, the default). The second run must continue from the last complete
checkpoint and end with the reference run's final weights, optimizer state and every per-step metric, bit
for bit (CPU kernels are deterministic here; wall-clock and memory metrics `timing_*`, `perf/*`, `system/*` are not compared).

Moments: mid-step (the reward of step 3 SIGKILLs the driver: after generation, before the update), while
the actor of step 2 is being written into its staging folder (a file watch fires the kill), right after the
checkpoint of step 2 is committed and before step 2's metrics are logged (a checkpoint callback fires the kill;
the resumed run logs them from the checkpoint), and a random
moment within about 3.5 steps after the first checkpoint (seeded; the seed is printed, KILL_SEED=<seed>
replays it). At the moment of the kill the test checks
that a half-written checkpoint is not taken as the latest and that the older checkpoint survived retention
(`max_actor_ckpt_to_keep=1`). Every process the killed driver left (Ray's daemons, agents and workers,
found by watching its process tree and by an environment tag) is killed before the resume.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.ppo_e2e import (
    ProcessTree,
    assert_same_step_metrics,
    assert_same_weights,
    hf_weights,
    kill_tagged,
    run_ppo,
    shard_state,
    start_ppo,
    step_metrics,
    tagged_processes,
    wait_until_gone,
)
from verl.trainer.ppo import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MOMENTS = ("mid_step_3", "checkpoint_write_step_2", "after_commit_step_2", "random_moment")


def _wait_for(proc, fire, timeout_s: float = 300.0) -> bool:
    """Poll `fire()` every 2 ms until it is true (True) or `proc` exits or the time is up (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        if fire():
            return True
        time.sleep(0.002)
    return False


def _kill_when(proc, fire) -> bool:
    """SIGKILL `proc` as soon as `fire()` is true; False if it exited first."""
    if _wait_for(proc, fire):
        os.kill(proc.pid, signal.SIGKILL)
        return True
    return False


def _start_and_kill(moment: str, ref, run_dir: Path, tmp_path: Path, tag: str) -> tuple[int | None, list[int]]:
    """Start the run, kill its driver at `moment` and then every process it left behind. Returns the step whose
    checkpoint must be the latest afterwards (None when the moment is random) and the pids killed after it."""
    args, log = ref.args(run_dir), tmp_path / "killed_run.log"
    env = {"KILL_DRIVER_AT_STEP": "3"} if moment == "mid_step_3" else {}
    if moment == "after_commit_step_2":  # the checkpoint callback kills the driver before the step is logged
        args = ref.args(run_dir, "trainer.checkpoint_callback_class=fault_rewards.KillDriverAfterSave")
        reliability = str(Path(__file__).resolve().parent)
        env = {
            "KILL_DRIVER_AFTER_SAVE_STEP": "2",
            "PYTHONPATH": os.pathsep.join(filter(None, [reliability, os.environ.get("PYTHONPATH")])),
        }
    proc = start_ppo(args, tmp_path, tag, log, **env)
    tree = ProcessTree(proc.pid)
    expected_latest = {"mid_step_3": 2, "checkpoint_write_step_2": 1, "after_commit_step_2": 2}.get(moment)
    if moment == "checkpoint_write_step_2":
        actor_dir = Path(ckpt.staging_dir(str(run_dir), 2)) / "actor"
        assert _kill_when(proc, lambda: actor_dir.is_dir() and any(actor_dir.iterdir())), log.read_text()[-3000:]
    elif moment == "random_moment":  # after the first checkpoint, within about the next 3.5 steps
        seed = int(os.environ.get("KILL_SEED", time.time_ns() % 10**6))
        step_s = sum(m["timing_s/step"] + m.get("timing_s/save_checkpoint", 0) for m in ref.metrics.values())
        delay = random.Random(seed).uniform(0, 3.5) * step_s / len(ref.metrics)
        print(f"random kill: KILL_SEED={seed} -> SIGKILL {delay:.2f} s after the first checkpoint")
        first = Path(ckpt.step_dir(str(run_dir), 1))
        _wait_for(proc, lambda: ckpt.is_complete(str(first)))
        start = time.monotonic()
        _kill_when(proc, lambda: time.monotonic() - start >= delay)
    code = proc.wait(timeout=300)
    assert code == -signal.SIGKILL or moment == "random_moment", log.read_text()[-3000:]
    left_behind = sorted(set(tree.kill_survivors()) | set(kill_tagged(tag)))
    return expected_latest, left_behind


def _assert_same_tree(a, b, where: str = "optim") -> None:
    """Nested dicts/lists of tensors and numbers, equal exactly."""
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            _assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigkill_then_resume_matches_uninterrupted_run(moment, reference_run, tmp_path):
    ref, run_dir = reference_run, tmp_path / "run"
    tag = uuid.uuid4().hex
    expected_latest, left_behind = _start_and_kill(moment, ref, run_dir, tmp_path, tag)
    assert tagged_processes(tag) == []  # Ray's daemons and agents outlive a SIGKILLed driver: all killed now

    # what the crash left: only complete folders count, the older one survived retention
    latest = ckpt.find_latest_checkpoint(str(run_dir))
    for folder in run_dir.glob("global_step_*"):
        assert ckpt.is_complete(str(folder)), f"{folder} was renamed into place without its marker"
    if expected_latest is not None:
        assert latest == ckpt.step_dir(str(run_dir), expected_latest)
        assert ckpt.complete_steps(str(run_dir)) == [expected_latest]
    if moment == "checkpoint_write_step_2":
        staging = ckpt.staging_dir(str(run_dir), 2)
        assert os.path.isdir(staging) and not ckpt.is_complete(staging)
    if moment == "after_commit_step_2":  # the log lacks step 2: the resumed run must write it from the checkpoint
        assert sorted(step_metrics(run_dir)) == [1]

    resume_tag = uuid.uuid4().hex
    proc = run_ppo(ref.args(run_dir), cwd=tmp_path, tag=resume_tag)
    if latest is not None:
        assert f"resuming from {latest}" in proc.stdout
    metrics = step_metrics(run_dir)
    assert sorted(metrics) == sorted(ref.metrics), f"steps logged: {sorted(metrics)}"
    for step in sorted(ref.metrics):
        assert_same_step_metrics(ref.metrics, metrics, step)
    final = max(ref.metrics)
    assert_same_weights(hf_weights(ref.run_dir, final), hf_weights(run_dir, final))
    assert_same_weights(shard_state(ref.run_dir, final), shard_state(run_dir, final))
    _assert_same_tree(shard_state(ref.run_dir, final, "optim"), shard_state(run_dir, final, "optim"))
    assert ckpt.complete_steps(str(run_dir)) == [final]
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".incomplete_")]
    assert wait_until_gone(resume_tag) == [], "a finished run left processes behind"
    print(f"{moment}: resumed from {latest}; killed {len(left_behind)} orphaned processes of the crashed run")
