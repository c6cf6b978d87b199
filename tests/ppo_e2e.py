"""Helpers for end-to-end tests that run `python -m verl.trainer.main_ppo` in a subprocess on the tiny model.

Owns the small GRPO run's arguments, writing its data, running (or starting) the entry point, reading back
step metrics and checkpoint weights, and finding/killing every process a run left behind. Shared by
tests/trainer/test_resume_equivalence.py and tests/reliability/. Not a test module (pytest collects test_*.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file

from tests.cpu_overrides import CPU_OVERRIDES
from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

RUN_TAG_ENV = "VERL_TEST_RUN_TAG"  # set in a run's environment; every process it starts inherits it
NOT_COMPARED_PREFIXES = ("timing_", "perf/", "system/")  # wall-clock and memory metrics differ run to run


def write_data(out: Path, n_train: int, n_val: int = 2) -> Path:
    """Synthetic RLLA train/test parquet files in `out` (seeded, so every call writes the same rows)."""
    records = generate_records(n_train + n_val, seed=5)
    pd.DataFrame(records_to_rows(records[:n_train], "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(records_to_rows(records[n_train:], "test")).to_parquet(out / "test.parquet")
    return out


def grpo_args(model: str, data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny GRPO run on one CPU worker: 4 prompts x 2 samples per step, a checkpoint every step."""
    return [
        f"data.train_files={data_dir}/train.parquet",
        f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=384",
        "data.max_response_length=16",
        "data.train_batch_size=4",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "trainer.val_before_train=false",
        "trainer.save_freq=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.n_gpus_per_node=1",
        "trainer.ray_init.num_cpus=1",
        *extra,
    ]


def run_env(tag: str | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    env.pop("VERL_FULL_ERROR", None)
    env[RUN_TAG_ENV] = tag or uuid.uuid4().hex
    return env


def run_ppo(args: list[str], cwd: Path, check: bool = True, timeout: float = 300, **env: str):
    """Run main_ppo to the end; with `check`, fail the test (showing stderr) unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *args],
        cwd=cwd,
        env=run_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_ppo(args: list[str], cwd: Path, tag: str, log: Path, **env: str) -> subprocess.Popen:
    """Start main_ppo in the background (its own session), output to `log`; `tag` marks all its processes."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *args],
            cwd=cwd,
            env=run_env(tag, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def process_environ(pid: int) -> list[bytes] | None:
    """The `NAME=value` entries a live process started with, None when it is gone or unreadable (a kernel thread)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read().split(b"\0")
    except OSError:
        return None


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment holds RUN_TAG_ENV=tag (the driver, Ray's daemons, workers)."""
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]
    return [pid for pid in pids if needle in (process_environ(pid) or [])]


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), fields[0]


class ProcessTree:
    """Records every descendant of `root_pid` (pid and start time) while it runs, polled from a thread, so that
    what a killed process leaves behind (Ray's daemons and agents, reparented to init) can be killed later."""

    def __init__(self, root_pid: int, interval_s: float = 0.05) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self.seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            parents = {}
            for name in os.listdir("/proc"):
                if name.isdigit() and (stat := _proc_stat(int(name))) is not None:
                    parents[int(name)] = stat
            family = {self.root_pid}
            for pid in sorted(parents, key=lambda p: parents[p][1]):  # parents start before their children
                if parents[pid][0] in family:
                    family.add(pid)
                    self.seen.setdefault(pid, parents[pid][1])
            self._stop.wait(self.interval_s)

    def kill_survivors(self, deadline_s: float = 30.0) -> list[int]:
        """Stop watching, SIGKILL every recorded descendant still alive (same start time); the pids killed."""
        self._stop.set()
        self._thread.join()
        killed: set[int] = set()
        end = time.monotonic() + deadline_s
        while True:
            alive = [p for p, start in self.seen.items() if (st := _proc_stat(p)) and st[1] == start and st[2] != "Z"]
            if not alive:
                return sorted(killed)
            if time.monotonic() > end:
                raise AssertionError(f"descendants of {self.root_pid} survive SIGKILL: {alive}")
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except OSError:
                    pass
            time.sleep(0.1)


def kill_tagged(tag: str, deadline_s: float = 30.0) -> list[int]:
    """SIGKILL every process of the run tagged `tag` until none is left; returns the pids killed."""
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids = [pid for pid in tagged_processes(tag) if not _is_zombie(pid)]
        if not pids:
            return sorted(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes of run {tag} survive SIGKILL: {tagged_processes(tag)}")


def wait_until_gone(tag: str, timeout_s: float = 15.0) -> list[int]:
    """Wait for every process of the run tagged `tag` to exit; the pids still alive after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in tagged_processes(tag) if not _is_zombie(pid)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """{step: metrics} from `<run_dir>/logs/metrics.jsonl`, the last record of each step (a step that was
    logged by a run killed before its checkpoint is logged again by the resumed run). Every line must parse."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["step"] > 0}


def assert_same_step_metrics(expected: dict, seen: dict, step: int) -> None:
    """Every metric of a step equal (exactly), wall-clock ones (timing_*, perf/*) excepted."""
    keys = sorted(k for k in expected[step] if not k.startswith(NOT_COMPARED_PREFIXES))
    assert keys == sorted(k for k in seen[step] if not k.startswith(NOT_COMPARED_PREFIXES)), step
    different = [(k, expected[step][k], seen[step][k]) for k in keys if expected[step][k] != seen[step][k]]
    assert not different, f"step {step}: {different}"


def hf_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    hf_dir = os.path.join(run_dir, f"global_step_{step}", "actor", "huggingface")
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    assert files, f"no safetensors weights in {hf_dir}"
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(hf_dir, name)))
    return weights


def shard_state(run_dir: Path, step: int, part: str = "model") -> dict:
    """Rank 0's saved `model` (or `optim`) shard of a step's actor checkpoint."""
    actor_dir = os.path.join(run_dir, f"global_step_{step}", "actor")
    name = [f for f in os.listdir(actor_dir) if f.startswith(f"{part}_world_size_1_rank_0")][0]
    return torch.load(os.path.join(actor_dir, name), map_location="cpu", weights_only=False)


def assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(_local(a[k]), _local(b[k]))]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def file_snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """{relative path: (bytes, mtime_ns)} of every file under `root`."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()
    }
