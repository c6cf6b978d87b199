"""Resume is exact: a GRPO run (in one process, `trainer.single_process=true`) stopped after a step and resumed
in a fresh process ends with the same actor weights (bit for bit, CPU) and logs the same step metrics as the run
that was never stopped, whether it stopped mid-epoch or exactly on an epoch boundary (it then goes on into the next
epoch)."""

import os

import pytest
import torch

from tests.ppo_e2e import assert_same_weights, grpo_args, hf_weights, run_ppo, shard_state, step_metrics, write_data

pytestmark = pytest.mark.slow

COMPARED_METRICS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


def _args(model, data_dir, run_dir, *extra):
    # in one process (trainer.single_process=true): the checkpoint and resume code is the same as under Ray
    # (test_single_process.py shows both give the same run), at ~12 CPU-s less per run; the Ray path's resume is
    # checked by tests/reliability/test_kill_resume.py and test_main_ppo_e2e.py
    single = "trainer.single_process=true"
    return grpo_args(model, data_dir, run_dir, f"data.val_files={data_dir}/test.parquet", single, *extra)


def _assert_same_step(m_full, m_resumed, step):
    for key in COMPARED_METRICS:
        assert m_full[step][key] == m_resumed[step][key], (key, m_full[step][key], m_resumed[step][key])


def test_resumes_at_an_epoch_boundary_and_mid_epoch_match_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """8 prompts, 2 steps per epoch, 2 epochs. The split run stops after step 2 (the epoch boundary), resumes and
    stops after step 3 (mid-epoch), then resumes to the end; every step and the final weights match the full run."""
    data_dir = write_data(tmp_path, n_train=8)
    full, split = tmp_path / "full", tmp_path / "split"
    run_ppo(_args(tiny_model_dir, data_dir, full, "trainer.total_epochs=2"), tmp_path)
    run_ppo(
        _args(tiny_model_dir, data_dir, split, "trainer.total_epochs=2", "trainer.total_training_steps=2"), tmp_path
    )
    assert not os.path.exists(split / "global_step_3")
    for extra, resumed_from in ((["trainer.total_training_steps=3"], "global_step_2"), ([], "global_step_3")):
        proc = run_ppo(_args(tiny_model_dir, data_dir, split, "trainer.total_epochs=2", *extra), tmp_path)
        assert "resuming from" in proc.stdout and resumed_from in proc.stdout
    m_full, m_split = step_metrics(full), step_metrics(split)
    assert sorted(m_full) == sorted(m_split) == [1, 2, 3, 4]
    assert [m_split[s]["training/epoch"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]  # went on into the next epoch
    for step in (1, 2, 3, 4):
        _assert_same_step(m_full, m_split, step)
    for step in (3, 4):
        assert_same_weights(hf_weights(full, step), hf_weights(split, step))
        assert_same_weights(shard_state(full, step), shard_state(split, step))
    # the run learns: the step-4 weights are not the step-3 weights, so the comparison above can fail
    w3, w4 = hf_weights(full, 3), hf_weights(full, 4)
    assert any(not torch.equal(w3[k], w4[k]) for k in w4)
