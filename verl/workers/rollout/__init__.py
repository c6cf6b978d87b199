"""Rollout engines by name: `hf` (HF `generate`, CPU and GPU, the default) and `vllm` (GPU only).

Owns the registry `get_rollout_class(name)` and `register_rollout(name)` for user engines. Engines are imported
lazily so that asking for `hf` never imports vLLM. Layer 5: must not import Ray or verl.single_controller.
"""

from __future__ import annotations

import importlib

from verl.workers.rollout.base import BaseRollout

# name -> "module:ClassName"; imported on first use.
_BUILTIN_ROLLOUTS: dict[str, str] = {
    "hf": "verl.workers.rollout.hf_rollout:HFRollout",
    "vllm": "verl.workers.rollout.vllm_rollout:VLLMRollout",
}
_REGISTERED: dict[str, type[BaseRollout]] = {}

__all__ = ["BaseRollout", "get_rollout_class", "register_rollout"]


def register_rollout(name: str):
    """Class decorator registering a rollout engine under `name` (`actor_rollout_ref.rollout.name=<name>`).

    A registered engine is built by the worker like `hf`: `cls(module, config, tokenizer)` with an un-sharded
    copy of the policy as `module`.
    """

    def decorator(cls: type[BaseRollout]) -> type[BaseRollout]:
        if name in _BUILTIN_ROLLOUTS or name in _REGISTERED:
            raise ValueError(f"rollout engine {name!r} is already registered")
        _REGISTERED[name] = cls
        return cls

    return decorator


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The rollout engine class registered as `name`; ValueError listing the known names otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN_ROLLOUTS:
        known = sorted(set(_BUILTIN_ROLLOUTS) | set(_REGISTERED))
        raise ValueError(f"unknown rollout engine {name!r} (actor_rollout_ref.rollout.name); allowed: {known}")
    module_name, class_name = _BUILTIN_ROLLOUTS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
