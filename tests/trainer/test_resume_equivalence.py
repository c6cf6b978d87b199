"""Resume is exact: a GRPO run stopped after a step and resumed in a fresh process ends with the same actor
weights (bit for bit, CPU) and logs the same step metrics as the run that was never stopped; a resume
that falls exactly on an epoch boundary goes on into the next epoch."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

pytestmark = pytest.mark.slow

COMPARED_METRICS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


def _write_data(out, n_train):
    records = generate_records(n_train + 2, seed=5)
    pd.DataFrame(records_to_rows(records[:n_train], "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(records_to_rows(records[n_train:], "test")).to_parquet(out / "test.parquet")
    return out


def _args(model, data_dir, run_dir, *extra):
    return [
        f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/test.parquet",
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


def _run(args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _step_metrics(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["step"] > 0}


def _hf_weights(run_dir, step):
    hf_dir = os.path.join(run_dir, f"global_step_{step}", "actor", "huggingface")
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    assert files, f"no safetensors weights in {hf_dir}"
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(hf_dir, name)))
    return weights


def _shard_state(run_dir, step):
    actor_dir = os.path.join(run_dir, f"global_step_{step}", "actor")
    name = [f for f in os.listdir(actor_dir) if f.startswith("model_world_size_1_rank_0")][0]
    return torch.load(os.path.join(actor_dir, name), map_location="cpu", weights_only=False)


def _assert_same_weights(a, b):
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(_local(a[k]), _local(b[k]))]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_same_step(m_full, m_resumed, step):
    for key in COMPARED_METRICS:
        assert m_full[step][key] == m_resumed[step][key], (key, m_full[step][key], m_resumed[step][key])


def test_resume_mid_epoch_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    data_dir = _write_data(tmp_path, n_train=16)
    full, split = tmp_path / "full", tmp_path / "split"
    _run(_args(tiny_model_dir, data_dir, full, "trainer.total_training_steps=3"), tmp_path)
    _run(_args(tiny_model_dir, data_dir, split, "trainer.total_training_steps=2"), tmp_path)
    assert not os.path.exists(split / "global_step_3")
    proc = _run(_args(tiny_model_dir, data_dir, split, "trainer.total_training_steps=3"), tmp_path)
    assert "resuming from" in proc.stdout and "global_step_2" in proc.stdout

    m_full, m_split = _step_metrics(full), _step_metrics(split)
    assert sorted(m_full) == sorted(m_split) == [1, 2, 3]
    for step in (1, 2, 3):
        _assert_same_step(m_full, m_split, step)
    _assert_same_weights(_hf_weights(full, 3), _hf_weights(split, 3))
    _assert_same_weights(_shard_state(full, 3), _shard_state(split, 3))
    # the run learns: the step-3 weights are not the step-2 weights, so the comparison above can fail
    w2, w3 = _hf_weights(full, 2), _hf_weights(full, 3)
    assert any(not torch.equal(w2[k], w3[k]) for k in w3)


def test_resume_at_epoch_boundary_continues_into_next_epoch(tiny_model_dir, tmp_path):
    data_dir = _write_data(tmp_path, n_train=8)  # 2 steps per epoch
    full, split = tmp_path / "full", tmp_path / "split"
    _run(_args(tiny_model_dir, data_dir, full, "trainer.total_epochs=2"), tmp_path)
    _run(_args(tiny_model_dir, data_dir, split, "trainer.total_epochs=2", "trainer.total_training_steps=2"), tmp_path)
    proc = _run(_args(tiny_model_dir, data_dir, split, "trainer.total_epochs=2"), tmp_path)
    assert "resuming from" in proc.stdout

    m_full, m_split = _step_metrics(full), _step_metrics(split)
    assert sorted(m_split) == sorted(m_full) == [1, 2, 3, 4]
    assert [m_split[s]["training/epoch"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    for step in (3, 4):
        _assert_same_step(m_full, m_split, step)
    _assert_same_weights(_hf_weights(full, 4), _hf_weights(split, 4))
