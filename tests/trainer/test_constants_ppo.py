"""The Ray runtime env of a PPO run (verl.trainer.constants_ppo)."""

import json
import os
from unittest.mock import patch

from omegaconf import OmegaConf

from verl.trainer.constants_ppo import NVTX_INJECTION_ENV, PPO_RAY_RUNTIME_ENV, get_ppo_ray_runtime_env


def test_defaults_skip_variables_already_set_and_forward_determinism_switches():
    env = {"NCCL_DEBUG": "INFO", "PYTHONHASHSEED": "7", "VERL_FULL_DETERMINISM": "1"}
    with patch.dict(os.environ, env, clear=True):
        runtime_env = get_ppo_ray_runtime_env()
    env_vars = runtime_env["env_vars"]
    assert "NCCL_DEBUG" not in env_vars  # the worker inherits INFO
    assert env_vars["TOKENIZERS_PARALLELISM"] == PPO_RAY_RUNTIME_ENV["env_vars"]["TOKENIZERS_PARALLELISM"]
    assert env_vars["PYTHONHASHSEED"] == "7" and "NCCL_ALGO" not in env_vars
    assert env_vars["VERL_FULL_DETERMINISM"] == "1" and env_vars["VLLM_BATCH_INVARIANT"] == "0"
    assert runtime_env["working_dir"] is None
    assert NVTX_INJECTION_ENV not in env_vars


def test_ray_job_working_dir_is_left_alone():
    job = {"runtime_env": {"working_dir": "/job"}}
    with patch.dict(os.environ, {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}, clear=True):
        assert "working_dir" not in get_ppo_ray_runtime_env()


def test_torch_profiler_disables_nvtx_injection_unless_kept():
    config = OmegaConf.create({"global_profiler": {"tool": "torch"}})
    inherited = {NVTX_INJECTION_ENV: "/usr/lib/libcupti.so"}
    with patch.dict(os.environ, inherited, clear=True):
        value = get_ppo_ray_runtime_env(config)["env_vars"][NVTX_INJECTION_ENV]
    assert value and value != inherited[NVTX_INJECTION_ENV]
    with patch.dict(os.environ, {**inherited, "VERL_KEEP_NVTX_INJECTION": "1"}, clear=True):
        assert NVTX_INJECTION_ENV not in get_ppo_ray_runtime_env(config)["env_vars"]
