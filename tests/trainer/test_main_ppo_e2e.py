"""End to end through the real entry point `python -m verl.trainer.main_ppo` on a tiny random model:
GRPO and PPO (GAE + critic) runs finish, log verl's metrics, write a plot and a checkpoint, resume from
it, and configuration mistakes exit non-zero with one line naming the bad value."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.cpu_overrides import CPU_OVERRIDES
from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_data")
    records = generate_records(24, seed=3)
    pd.DataFrame(records_to_rows(records[:20], "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(records_to_rows(records[20:], "test")).to_parquet(out / "test.parquet")
    return out


def _run(args, cwd, timeout=420):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _common(model, data_dir, run_dir):
    return [
        f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/test.parquet",
        f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=384",
        "data.max_response_length=16",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.logger=[console,tensorboard]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.ray_init.num_cpus=2",
    ]


def _metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"))]


def test_grpo_runs_checkpoints_and_resumes(tiny_model_dir, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _common(tiny_model_dir, data_dir, run_dir) + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.log_val_generations=2",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=1",
    ]
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training finished" in proc.stdout and "validation reward: before" in proc.stdout
    rows = _metrics(run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "timing_s/gen",
        "response_length/mean",
        "perf/throughput",
        "perf/mfu/actor",
        "training/rollout_probs_diff_max",
    ):
        assert key in steps[0], key
    assert 0 < steps[0]["perf/mfu/actor"] < 1
    assert steps[0]["training/rollout_probs_diff_max"] < 1e-3  # rollout engine holds the actor's weights
    assert steps[1]["training/rollout_probs_diff_max"] < 1e-3  # ... also after the first update
    assert "val/reward/mean" in rows[0] and "val/reward/mean" in steps[-1]
    source = "rlla"  # the data_source of records_to_rows
    for key in ("reward/mean@2", "reward/best@2/mean", "reward/maj@2/mean"):
        assert f"val-core/{source}/{key}" in rows[0], key
    assert rows[0][f"val-core/{source}/reward/best@2/mean"] >= rows[0][f"val-core/{source}/reward/mean@2"]
    generations = [json.loads(line) for line in open(run_dir / "logs" / "val_generations.jsonl")]
    assert [g["step"] for g in generations] == [0, 0, 2, 2] and set(generations[0]) == {
        "step",
        "input",
        "output",
        "score",
    }
    assert os.path.isfile(run_dir / "logs" / "curves.png")
    assert sorted(os.listdir(run_dir)) == ["global_step_2", "latest_checkpointed_iteration.txt", "logs"]
    # resume: one more step continues from step 2
    proc = _run(args[:-3] + ["trainer.total_training_steps=3", "trainer.save_freq=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    assert [r["step"] for r in _metrics(run_dir) if r["step"] > 0] == [1, 2, 3]


@pytest.mark.parametrize("ranks", [1, 2])
def test_ppo_with_critic_runs(tiny_model_dir, data_dir, tmp_path, ranks):
    run_dir = tmp_path / "run"
    args = _common(tiny_model_dir, data_dir, run_dir) + [
        "algorithm.adv_estimator=gae",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
    ]
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {r["step"]: r for r in _metrics(run_dir) if r["step"] > 0}
    assert sorted(steps) == [1, 2]
    for key in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "actor/pg_loss", "critic/lr"):
        assert key in steps[1], key
    assert steps[2]["critic/values/mean"] != steps[1]["critic/values/mean"]  # the critic was updated
    for role in ("actor", "critic"):
        shards = sorted(f for f in os.listdir(run_dir / "global_step_2" / role) if f.startswith("model_world_size"))
        assert shards == [f"model_world_size_{ranks}_rank_{r}.pt" for r in range(ranks)]


def test_grpo_two_ranks_trains(tiny_model_dir, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = _common(tiny_model_dir, data_dir, run_dir) + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
    ]
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {r["step"]: r for r in _metrics(run_dir) if r["step"] > 0}
    assert sorted(steps) == [1, 2]
    # both ranks' rollout engines hold the actor's weights, before and after an update
    assert max(steps[1]["training/rollout_probs_diff_max"], steps[2]["training/rollout_probs_diff_max"]) < 1e-3
    assert steps[2]["actor/kl_loss"] > 0  # the actor moved away from the reference


def test_ctrl_c_stops_workers_and_ray(tiny_model_dir, data_dir, tmp_path):
    """SIGINT during training: exit code 130, one line on stderr, and no Ray process of the run left behind."""
    # Ray puts its session (and every process's --session-dir) under RAY_TMPDIR; short: socket paths are capped
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    args = _common(tiny_model_dir, data_dir, tmp_path / "run") + [
        "trainer.total_training_steps=200",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    # A job started in the background by a shell without job control inherits SIGINT as ignored, and Python then
    # never raises KeyboardInterrupt; the child gets the default disposition so the test holds however pytest runs.
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        for line in proc.stdout:  # wait until a training step has been logged
            if line.startswith("step 1"):
                break
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert _ray_processes(ray_tmp), "no Ray process found under RAY_TMPDIR: the check below would prove nothing"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted: workers and Ray stopped"
    deadline = time.time() + 20
    while _ray_processes(ray_tmp) and time.time() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _ray_processes(ray_tmp) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(ray_tmp) in cmdline:
            found.append(cmdline[:200])
    return found


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.adv_estimator=nope", "nope"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=nope", "nope"),
        ("data.train_batch_size=3", "divisible"),
        ("data.train_batch_size=0", "positive"),
        ("actor_rollout_ref.model.path=/no/such/model", "/no/such/model"),
        ("data.train_files=/no/such.parquet", "/no/such.parquet"),
        ("trainer.resume_mode=sometimes", "sometimes"),
    ],
)
def test_bad_config_exits_with_one_line(tiny_model_dir, data_dir, tmp_path, override, message):
    run_dir = tmp_path / "run"
    args = _common(tiny_model_dir, data_dir, run_dir) + ["trainer.total_training_steps=1", override]
    proc = _run(args, tmp_path, timeout=240)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert not os.path.exists(run_dir / "global_step_1")
