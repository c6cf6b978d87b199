"""trainer.single_process=true: the worker runs inside the driver, without Ray. A GRPO run gives the same
step metrics and the same weights as the same run on Ray, starts no other process, PPO with a critic (a
second fused role) trains too, and what one process cannot run is refused with a message saying why."""

import time

import pytest

from tests.ppo_e2e import (
    assert_same_step_metrics,
    assert_same_weights,
    grpo_args,
    hf_weights,
    run_ppo,
    start_ppo,
    step_metrics,
    tagged_processes,
    write_data,
)

pytestmark = pytest.mark.slow


def _args(model, data_dir, run_dir, *extra):
    return grpo_args(model, data_dir, run_dir, "trainer.total_training_steps=2", "trainer.save_freq=2", *extra)


def test_single_process_run_equals_ray_run_and_starts_no_process(tiny_model_dir, tmp_path):
    data_dir = write_data(tmp_path, n_train=8)
    on_ray, single = tmp_path / "ray", tmp_path / "single"
    run_ppo(_args(tiny_model_dir, data_dir, on_ray), tmp_path)

    tag = "single-process-run"
    proc = start_ppo(_args(tiny_model_dir, data_dir, single, "trainer.single_process=true"), tmp_path, tag,
                     tmp_path / "single.log")  # fmt: skip
    most = 0
    while proc.poll() is None:
        most = max(most, len(tagged_processes(tag)))
        time.sleep(0.2)
    log = (tmp_path / "single.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert most == 1, f"{most} processes ran with the run's tag; single_process must not start Ray or workers"

    m_ray, m_single = step_metrics(on_ray), step_metrics(single)
    assert sorted(m_ray) == sorted(m_single) == [1, 2]
    for step in (1, 2):
        assert_same_step_metrics(m_ray, m_single, step)
    assert_same_weights(hf_weights(on_ray, 2), hf_weights(single, 2))


def test_single_process_trains_ppo_with_a_critic(tiny_model_dir, tmp_path):
    data_dir = write_data(tmp_path, n_train=8)
    run_dir = tmp_path / "gae"
    args = _args(tiny_model_dir, data_dir, run_dir, "trainer.single_process=true", "algorithm.adv_estimator=gae")
    run_ppo(args, tmp_path)
    steps = step_metrics(run_dir)
    assert sorted(steps) == [1, 2]
    assert "critic/vf_loss" in steps[2]
    assert steps[2]["critic/values/mean"] != steps[1]["critic/values/mean"]  # the critic was updated
    assert (run_dir / "global_step_2" / "critic").is_dir()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["trainer.n_gpus_per_node=2"], "trainer.nnodes * trainer.n_gpus_per_node = 2"),
        (["trainer.rollout_mode=async"], "cannot run trainer.rollout_mode=async"),
    ],
)
def test_single_process_refuses_what_needs_more_processes(tiny_model_dir, tmp_path, extra, message):
    data_dir = write_data(tmp_path, n_train=8)
    run_dir = tmp_path / "run"
    args = _args(tiny_model_dir, data_dir, run_dir, "trainer.single_process=true", *extra)
    proc = run_ppo(args, tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists() or not any(run_dir.glob("global_step_*"))
