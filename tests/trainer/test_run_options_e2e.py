"""The driver-loop keys in one small run (single process, PPO with a critic): DataLoader workers, rollout and
validation dumps, a checkpoint callback, critic retention apart from the actor's, then `val_only` on the resumed run.
(Actor retention and crash safety are tested on files in tests/trainer/ppo/test_checkpoint_dirs.py.)"""

import json

import pytest

from tests.ppo_e2e import grpo_args, run_ppo, step_metrics, write_data

pytestmark = pytest.mark.slow

CALLBACK = """
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback


class Record(CheckpointCallback):
    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        with open(self.config.trainer.default_local_dir + "/../saves.txt", "a") as f:
            f.write(f"{global_step} {checkpoint_dir} {trainer.global_steps}\\n")
"""


def _rows(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_dumps_callback_retention_workers_then_val_only(tiny_model_dir, tmp_path):
    data_dir = write_data(tmp_path, n_train=8)
    (tmp_path / "ckpt_hooks.py").write_text(CALLBACK)
    run_dir = tmp_path / "run"
    common = [
        f"data.val_files={data_dir}/test.parquet",
        "trainer.single_process=true",
        "algorithm.adv_estimator=gae",
        "trainer.total_training_steps=2",
        "++data.dataloader_num_workers=2",
        "++trainer.max_critic_ckpt_to_keep=1",
    ]
    run_ppo(
        grpo_args(tiny_model_dir, data_dir, run_dir, *common,
                  f"++trainer.rollout_data_dir={tmp_path}/rollouts",
                  f"++trainer.validation_data_dir={tmp_path}/val",
                  "++trainer.checkpoint_callback_class=ckpt_hooks.Record"),
        tmp_path, PYTHONPATH=str(tmp_path),
    )  # fmt: skip
    rollouts = {n: _rows(tmp_path / "rollouts" / f"{n}.jsonl") for n in (1, 2)}
    for step, rows in rollouts.items():
        assert len(rows) == 8  # 4 prompts x rollout.n=2
        assert {"input", "output", "gts", "score", "step", "uid"} <= set(rows[0]) and rows[0]["step"] == step
        assert all(isinstance(row["score"], float) and row["gts"] is not None for row in rows)
    assert rollouts[1][0]["input"] != rollouts[2][0]["input"] or rollouts[1][2]["input"] != rollouts[2][2]["input"]
    (val,) = [p.name for p in (tmp_path / "val").iterdir()]
    assert val == "2.jsonl" and {"reward", "score", "gts"} <= set(_rows(tmp_path / "val" / val)[0])
    saves = (tmp_path / "saves.txt").read_text().split("\n")[:-1]
    assert saves == [f"{s} {run_dir}/global_step_{s} {s}" for s in (1, 2)]
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert not (run_dir / "global_step_1" / "critic").exists() and (run_dir / "global_step_1" / "actor").is_dir()
    assert (run_dir / "global_step_2" / "critic").is_dir()

    proc = run_ppo(
        grpo_args(tiny_model_dir, data_dir, run_dir, *common, "trainer.val_before_train=true",
                  "++trainer.val_only=true", f"++trainer.validation_data_dir={tmp_path}/val_only"),
        tmp_path,
    )  # fmt: skip
    assert "resuming from" in proc.stdout and "global_step_2" in proc.stdout
    assert [p.name for p in (tmp_path / "val_only").iterdir()] == ["2.jsonl"]
    metrics = step_metrics(run_dir)  # the last record of step 2 is val_only's: validation metrics, no training
    assert sorted(metrics) == [1, 2] and "val/reward/mean" in metrics[2] and "actor/pg_loss" not in metrics[2]
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1", "global_step_2"]
