"""The one-step-off scheduler (verl/trainer/ppo/async_rollout.py) without Ray or models, and its config checks.

A stand-in trainer plays the two worker groups: its rollout stamps each generated token with the version of the
weights it last received, exactly what the real rollout worker does, and sleeps to stand for generation time.
The end-to-end runs on the tiny model are in tests/trainer/test_async_training.py.
"""

import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

import verl.trainer.ppo.async_rollout as async_rollout
from verl.protocol import DataProto
from verl.trainer.ppo.async_rollout import AsyncRollout, resolve_async_config

GEN_S, TRAIN_S = 0.05, 0.1


class FakeGroups:
    """The actor group (weights = number of updates) and the rollout group (stamps the version it holds)."""

    def __init__(self, trainer, ignore_pushes=()):
        self.trainer = trainer
        self.actor_version = 0
        self.rollout_version = None
        self.ignore_pushes = set(ignore_pushes)  # versions the rollout "loses" (to exercise the staleness guard)

    def export_actor_weight_bucket(self):
        """Two buckets of the actor's weights, then [] (the end of the stream), as the FSDP workers' stream."""
        self._exported = getattr(self, "_exported", 0) + 1
        if self._exported == 3:
            self._exported = 0
            return [[], []]
        return [[("version", torch.tensor(self.actor_version)), ("part", torch.tensor(self._exported))], None]

    def begin_rollout_weight_load(self):
        assert getattr(self, "_incoming", None) is None, "a weight stream was left open"
        self._incoming = []

    def load_rollout_weight_bucket(self, bucket):
        self._incoming.append(dict(bucket))

    def finish_rollout_weight_load(self, version):
        incoming, self._incoming = self._incoming, None
        assert [int(b["part"]) for b in incoming] == [1, 2]  # the whole stream, in order, one bucket per call
        assert all(int(b["version"]) == version for b in incoming)  # the weights pushed are the actor's at that version
        if version not in self.ignore_pushes:
            self.rollout_version = version


class FakeTrainer:
    def __init__(self, ignore_pushes=()):
        self.global_steps = 0
        self.groups = FakeGroups(self, ignore_pushes)
        self.actor_rollout_wg = self.rollout_wg = self.groups
        self.generated = []  # (prompt id, global_steps seen, thread name) per generation

    def _rollout_score_and_filter(self, prompts, timing, metrics):
        self.generated.append((prompts.meta_info["id"], self.global_steps, threading.current_thread().name))
        time.sleep(GEN_S)
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        versions = torch.where(mask.bool(), torch.full_like(mask, self.groups.rollout_version), -1)
        timing["gen"] = GEN_S
        metrics["critic/score/mean"] = float(prompts.meta_info["id"])
        batch = DataProto.from_dict(tensors={"response_mask": mask, "rollout_versions": versions})
        batch.meta_info["id"] = prompts.meta_info["id"]
        return batch


def prompt_batches(trainer, count=100):
    for i in range(1, count + 1):
        trainer._data_position = (0, i)  # as the trainer's iterator does: the resume position after this batch
        yield 0, i - 1, DataProto.from_dict(tensors={"x": torch.zeros(2, 1)}, meta_info={"id": i})


def train(max_staleness, total_steps=5, ignore_pushes=()):
    """Run the trainer's loop shape: lookahead, begin_step, 'training', end_step. Returns what was observed."""
    trainer = FakeTrainer(ignore_pushes)
    scheduler = AsyncRollout(trainer, max_staleness, total_steps)
    trained, metrics_per_step, positions = [], [], []
    for _, _, prompts in scheduler.lookahead(prompt_batches(trainer)):
        trainer.global_steps += 1
        step = trainer.global_steps
        timing, metrics = {}, {}
        batch = scheduler.begin_step(prompts, step, timing, metrics)
        assert batch.meta_info["global_steps"] == step
        time.sleep(TRAIN_S)  # the step's log-prob and update phases
        trainer.groups.actor_version += 1
        scheduler.end_step(step, timing)
        trained.append(batch.meta_info["id"])
        metrics_per_step.append({**metrics, **{f"timing/{k}": v for k, v in timing.items()}})
        positions.append(trainer._data_position)
        if step >= total_steps:
            break
    return trainer, scheduler, trained, metrics_per_step, positions


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    monkeypatch.setattr(async_rollout.ray, "put", lambda value: value)  # the fake groups take the dict itself


@pytest.mark.parametrize(
    "max_staleness, expected",
    [(0, [0, 0, 0, 0, 0]), (1, [0, 1, 1, 1, 1]), (2, [0, 1, 2, 2, 2])],
)
def test_staleness_follows_the_schedule_and_never_exceeds_the_bound(max_staleness, expected):
    trainer, _, trained, metrics, positions = train(max_staleness)
    assert trained == [1, 2, 3, 4, 5]  # every step trains its own prompts, in order
    assert [m["rollout/staleness/max"] for m in metrics] == expected
    assert [m["rollout/staleness/mean"] for m in metrics] == expected
    assert all(m["rollout/staleness/max"] <= max_staleness for m in metrics)
    assert [m["critic/score/mean"] for m in metrics] == [1.0, 2.0, 3.0, 4.0, 5.0]  # generation metrics travel along
    assert positions == [(0, i) for i in range(1, 6)]  # resume positions are the trained batch's, not the lookahead's
    # each batch generated once, none beyond the last step, seeded as if at step j - s (all seeds distinct)
    assert [g[0] for g in trainer.generated] == [1, 2, 3, 4, 5]
    assert [g[1] for g in trainer.generated] == [j - max_staleness for j in range(1, 6)]


def test_generation_of_a_later_step_overlaps_this_steps_training():
    trainer, scheduler, _, metrics, _ = train(max_staleness=1)
    background = [g for g in trainer.generated if g[2].startswith("verl-async-rollout")]
    assert [g[0] for g in background] == [2, 3, 4, 5]
    spans = {(e["kind"], e["step"]): (e["start"], e["end"]) for e in scheduler.timeline}
    for step in range(2, 6):  # batch `step` was generated while step - 1 trained
        gen_start, gen_end = spans[("gen", step)]
        train_start, train_end = spans[("train", step - 1)]
        assert gen_start < train_end and train_start < gen_end
        overlap = min(gen_end, train_end) - max(gen_start, train_start)
        assert overlap > 0.5 * GEN_S
    assert all(m["timing/gen_wait"] < GEN_S for m in metrics[:-1])  # hidden behind training (TRAIN_S > GEN_S)
    assert "timing/gen_wait" not in metrics[-1]  # nothing generated after the last step


def test_a_batch_over_the_bound_is_generated_again_with_fresh_weights(capsys):
    # the rollout misses the push of version 2, so step 4's batch (made during step 3) would be 2 versions old
    trainer, _, trained, metrics, _ = train(max_staleness=1, ignore_pushes={2})
    assert trained == [1, 2, 3, 4, 5]
    assert all(m["rollout/staleness/max"] <= 1 for m in metrics)
    assert "generating it again with fresh weights" in capsys.readouterr().out
    assert [g[0] for g in trainer.generated].count(4) == 2


def test_begin_step_refuses_prompts_out_of_order():
    trainer = FakeTrainer()
    scheduler = AsyncRollout(trainer, 1, 5)
    next(scheduler.lookahead(prompt_batches(trainer)))
    stranger = DataProto.from_dict(tensors={"x": torch.zeros(2, 1)}, meta_info={"id": 99})
    with pytest.raises(RuntimeError, match="did not yield next"):
        scheduler.begin_step(stranger, 1, {}, {})


# ------------------------------------------------------------------------------------------------ config
def config(**overrides):
    cfg = OmegaConf.create(
        {
            "trainer": {"rollout_mode": "sync"},
            "async_training": {"max_staleness": 1, "rollout_nnodes": 1, "rollout_n_gpus_per_node": 1},
            "algorithm": {},
            "data": {},
            "actor_rollout_ref": {
                "actor": {"tis_imp_ratio_cap": -1, "use_decoupled_loss": None, "behav_imp_weight_cap": 5.0},
                "rollout": {"calculate_log_probs": False},
            },
        }
    )
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_sync_default_is_unchanged_and_async_turns_on_the_decoupled_loss():
    sync = config()
    resolve_async_config(sync)
    assert sync.actor_rollout_ref.actor.use_decoupled_loss is False
    assert sync.actor_rollout_ref.rollout.calculate_log_probs is False
    assert async_rollout.rollout_pool_spec(sync) == {} and async_rollout.actor_role(sync, True) == "actor_rollout_ref"

    cfg = config(**{"trainer.rollout_mode": "async", "async_training.rollout_n_gpus_per_node": 2})
    resolve_async_config(cfg)
    assert cfg.actor_rollout_ref.actor.use_decoupled_loss is True
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert async_rollout.rollout_pool_spec(cfg) == {"rollout_pool": [2]}
    assert async_rollout.actor_role(cfg, True) == "actor_ref" and async_rollout.actor_role(cfg, False) == "actor"

    tis = config(**{"trainer.rollout_mode": "async", "actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0})
    resolve_async_config(tis)  # TIS chosen instead: no decoupled loss, but the behaviour log-probs are needed
    assert tis.actor_rollout_ref.actor.use_decoupled_loss is False
    assert tis.actor_rollout_ref.rollout.calculate_log_probs is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"trainer.rollout_mode": "asynch"}, r"trainer.rollout_mode='asynch'; allowed: sync, async"),
        ({"async_training.max_staleness": -1}, r"async_training.max_staleness must be an int >= 0, got -1"),
        (
            {"trainer.rollout_mode": "async", "async_training.rollout_n_gpus_per_node": 0},
            r"async_training.rollout_n_gpus_per_node must be an int >= 1, got 0",
        ),
        (
            {"actor_rollout_ref.actor.use_decoupled_loss": True, "actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0},
            r"use_decoupled_loss=true and tis_imp_ratio_cap=2.0.*set only one",
        ),
        ({"actor_rollout_ref.actor.behav_imp_weight_cap": 0.5}, r"behav_imp_weight_cap=0.5; allowed: a number > 1"),
        ({"actor_rollout_ref.actor.use_decoupled_loss": "yes"}, r"use_decoupled_loss='yes'; allowed: true, false"),
        (
            {"trainer.rollout_mode": "async", "algorithm.filter_groups": {"enable": True}},
            r"async does not support algorithm.filter_groups.enable=true",
        ),
        ({"trainer.rollout_mode": "async", "data.domains": {"math": {}}}, r"async does not support data.domains"),
    ],
)
def test_bad_async_settings_are_rejected_with_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_async_config(config(**overrides))


@pytest.mark.slow  # a subprocess importing the trainer: ~15-30 s
def test_main_ppo_rejects_a_bad_rollout_mode_with_one_line_before_ray_starts(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    import pandas as pd

    from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

    pd.DataFrame(records_to_rows(generate_records(4, seed=1), "train")).to_parquet(tmp_path / "train.parquet")
    from tests.cpu_overrides import CPU_OVERRIDES

    args = [
        *CPU_OVERRIDES,
        f"data.train_files={tmp_path}/train.parquet",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.max_prompt_length=384",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.rollout_mode=one_step_off",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1
    assert "trainer.rollout_mode='one_step_off'; allowed: sync, async" in proc.stderr
    assert "Traceback" not in proc.stderr
