"""The environment variables a PPO run gives its Ray workers: verl 0.9.1's `PPO_RAY_RUNTIME_ENV` and
`get_ppo_ray_runtime_env(config)`, the `runtime_env` to pass to `ray.init`.
"""

from __future__ import annotations

import json
import logging
import os

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

# Ray sets this in a job's driver; its runtime_env.working_dir, when given, is kept
RAY_JOB_CONFIG_JSON_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"

PPO_RAY_RUNTIME_ENV = {
    "env_vars": {
        "TOKENIZERS_PARALLELISM": "true",
        "NCCL_DEBUG": "WARN",
        "VLLM_LOGGING_LEVEL": "WARN",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
    },
}

# An image may point NVTX injection at libcupti, which then takes CUPTI's only subscriber slot in every process
# that opens an NVTX range, and the torch profiler's traces lose their GPU kernels. With the torch profiler the
# variable is set to a path that does not load (not emptied: a startup hook filling it only when unset would
# restore libcupti). VERL_KEEP_NVTX_INJECTION=1 keeps the inherited value.
NVTX_INJECTION_ENV = "NVTX_INJECTION64_PATH"
_NVTX_INJECTION_DISABLED = "/nonexistent/verl-disabled-nvtx-injection.so"

# forwarded on every call ("0" when unset) / only when set (an empty value breaks vLLM's integer parsing)
_FORWARDED_ALWAYS = ("VERL_FULL_DETERMINISM", "VLLM_BATCH_INVARIANT", "VERL_RL_INSIGHT_ENABLE")
_FORWARDED_IF_SET = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "FLASH_ATTENTION_DETERMINISTIC",
    "NCCL_DETERMINISTIC",
    "NCCL_ALGO",
)


def _uses_torch_profiler(config) -> bool:
    return config is not None and OmegaConf.select(config, "global_profiler.tool", default=None) == "torch"


def get_ppo_ray_runtime_env(config=None) -> dict:
    """`{"env_vars": {...}}` for `ray.init`: the variables of `PPO_RAY_RUNTIME_ENV` not already set in this process
    (the worker inherits those), plus `working_dir: None` outside a Ray job that names one; with
    `global_profiler.tool=torch` NVTX injection disabled (see `NVTX_INJECTION_ENV`); and the determinism
    switches of this process forwarded."""
    job_env = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR, "{}")).get("runtime_env", {})
    env_vars = {k: v for k, v in PPO_RAY_RUNTIME_ENV["env_vars"].items() if os.environ.get(k) is None}
    runtime_env = {"env_vars": env_vars, **({"working_dir": None} if job_env.get("working_dir") is None else {})}
    if _uses_torch_profiler(config) and os.environ.get("VERL_KEEP_NVTX_INJECTION", "0") != "1":
        env_vars[NVTX_INJECTION_ENV] = _NVTX_INJECTION_DISABLED
        logger.warning(
            "global_profiler.tool=torch: %s=%s for all workers so the profiler records GPU kernels "
            "(VERL_KEEP_NVTX_INJECTION=1 keeps the inherited value %s)",
            NVTX_INJECTION_ENV,
            _NVTX_INJECTION_DISABLED,
            os.environ.get(NVTX_INJECTION_ENV) or "unset",
        )
    env_vars.update({key: os.environ.get(key, "0") for key in _FORWARDED_ALWAYS})
    env_vars.update({key: os.environ[key] for key in _FORWARDED_IF_SET if key in os.environ})
    return runtime_env
