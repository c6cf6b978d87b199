"""`main_ppo.cores_left_to_workers`: while Ray workers compute on the CPU, the driver runs `fit` with one torch
thread and gets its own count back afterwards; with `trainer.single_process=true` (the worker computes in the
driver) or GPU workers the driver's count is left alone."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.main_ppo import cores_left_to_workers


def _config(single_process: bool, device: str):
    return OmegaConf.create({"trainer": {"single_process": single_process}, "actor_rollout_ref": {"device": device}})


def test_ray_cpu_workers_leave_the_driver_one_thread_then_restore_it(two_threads):
    with cores_left_to_workers(_config(single_process=False, device="cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_fit_raises(two_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with cores_left_to_workers(_config(single_process=False, device="cpu")):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("single_process, device", [(True, "cpu"), (False, "cuda")])
def test_in_process_or_gpu_workers_keep_the_drivers_threads(two_threads, single_process, device):
    with cores_left_to_workers(_config(single_process, device)):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2
