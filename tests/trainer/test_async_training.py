"""One-step-off async training (`trainer.rollout_mode=async`) on the tiny Qwen2 model, for real: a separate rollout
process generates step k+1's batch while the actor process trains step k, weights travel through Ray's object
store after every update, every token carries its policy version, and staleness stays within the bound.

A first run of 3 steps goes through main_ppo's `build_trainer` in this process (so the trainer can be inspected):
generation overlaps training in wall-clock time, staleness follows the bound, validation runs, and at the end the
rollout holds the actor's trained weights. `python -m verl.trainer.main_ppo` then resumes it in a new process for
a 4th step, whose batch is generated from the restored weights.
"""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import verl
from tests.cpu_overrides import CPU_OVERRIDES, cpu_config
from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

pytestmark = [pytest.mark.slow, pytest.mark.ray]
CONFIG_YAML = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "ppo_trainer.yaml")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_data")
    records = generate_records(18, seed=4)
    pd.DataFrame(records_to_rows(records[:16], "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(records_to_rows(records[16:], "test")).to_parquet(out / "test.parquet")
    return out


def overrides(model, data_dir, run_dir, *extra):
    return [
        *CPU_OVERRIDES,
        f"data.train_files={data_dir}/train.parquet",
        f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=384",
        "data.max_response_length=12",
        "data.train_batch_size=4",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true",  # the actor group then also holds the reference (role actor_ref)
        "trainer.rollout_mode=async",
        "async_training.max_staleness=1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.n_gpus_per_node=1",
        "trainer.cpus_per_worker=1",
        *extra,
    ]


def step_metrics(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"))]
    return {r["step"]: r for r in rows if r["step"] > 0}


@pytest.fixture(scope="module")
def first_run(ray_session, tiny_model_dir, data_dir, tmp_path_factory):
    """Three async steps in this process via main_ppo's `build_trainer` (config merged in struct mode, as Hydra does),
    checkpointing at the end; returns what the tests inspect, with the workers gone again."""
    from verl.trainer.main_ppo import build_trainer

    run_dir = tmp_path_factory.mktemp("async_run") / "run"
    cfg = cpu_config()
    OmegaConf.set_struct(cfg, True)  # an unknown key (e.g. a misspelt async key) raises, as on the command line
    extra = (f"data.val_files={data_dir}/test.parquet", "trainer.total_training_steps=3", "trainer.save_freq=3")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides(tiny_model_dir, data_dir, run_dir, *extra)))
    OmegaConf.resolve(cfg)
    trainer = build_trainer(cfg)
    try:
        assert trainer.rollout_wg is not trainer.actor_rollout_wg
        trainer.fit()
        # after the last update the rollout holds version 3, the actor's weights: sample fresh responses now
        fresh = trainer._generate(trainer._batch_from_rows([0, 1], trainer.train_dataset), validate=False, seed=123)
        actor_log_probs = trainer.actor_rollout_wg.compute_log_prob(fresh).batch["old_log_probs"]
        buckets = iter(lambda: trainer.actor_rollout_wg.export_actor_weight_bucket()[0], [])
        final_weights = dict(pair for bucket in buckets for pair in bucket)
        timeline = list(trainer.async_rollout.timeline)
    finally:
        for pool in trainer.resource_pool_manager.resource_pool_dict.values():
            pool.remove_placement_groups()
    return {
        "run_dir": run_dir,
        "timeline": timeline,
        "fresh": fresh,
        "actor_log_probs": actor_log_probs,
        "final_weights": final_weights,
    }


def test_generation_overlaps_training_and_staleness_stays_in_bound(first_run):
    metrics = step_metrics(first_run["run_dir"])
    assert sorted(metrics) == [1, 2, 3]
    assert [metrics[s]["rollout/staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [metrics[s]["rollout/staleness/mean"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for key in ("timing_s/gen", "timing_s/weight_sync", "actor/pg_loss", "val/reward/mean"):
        assert key in metrics[3], key
    # step 1 samples from the weights the actor started with (pushed at the start): rollout and actor agree
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-5
    # wall clock: the batch of step k+1 was generated in the rollout process while step k trained
    spans = {(e["kind"], e["step"]): (e["start"], e["end"]) for e in first_run["timeline"]}
    for step in (2, 3):
        gen_start, gen_end = spans[("gen", step)]
        train_start, train_end = spans[("train", step - 1)]
        overlap = min(gen_end, train_end) - max(gen_start, train_start)
        assert overlap > 0.5 * (gen_end - gen_start), (step, spans)


def test_the_rollout_ends_with_the_actors_trained_weights(first_run, tiny_model_dir):
    fresh = first_run["fresh"]
    mask = fresh.batch["response_mask"].bool()
    assert set(fresh.batch["rollout_versions"][mask].tolist()) == {3}
    assert (first_run["actor_log_probs"] - fresh.batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    final = first_run["final_weights"]
    assert any(not torch.equal(initial[k], final[k]) for k in initial if k in final)  # they are trained ones


def test_main_ppo_resumes_an_async_run_from_fresh_weights(first_run, tiny_model_dir, data_dir, tmp_path):
    """A new process through the command line continues the run: nothing in flight survives the restart, so step 4's
    batch is generated from the restored version-3 weights (fresh) and the rollout agrees with the restored actor."""
    run_dir = first_run["run_dir"]
    args = overrides(tiny_model_dir, data_dir, run_dir, f"data.val_files={data_dir}/test.parquet",
                     "trainer.total_training_steps=4", "trainer.ray_init.num_cpus=2")  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "global_step_3" in proc.stdout
    metrics = step_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3, 4]
    assert metrics[4]["rollout/staleness/max"] == 0
    assert metrics[4]["training/rollout_probs_diff_max"] < 1e-5
    assert "val/reward/mean" in metrics[4]
