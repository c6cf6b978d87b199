"""Rollout engines by name: `hf` (HF `generate`, CPU and GPU, the default) and `vllm` (GPU only).

Owns the registry `get_rollout_class(name)` and `register_rollout(name)` for user engines. Engines are imported
lazily so that asking for `hf` never imports vLLM. Layer 5: must not import Ray or verl.single_controller.
"""

from __future__ import annotations

from verl.utils.registry import LazyRegistry
from verl.workers.rollout.base import BaseRollout

# name -> "module:ClassName"; imported on first use.
ROLLOUT_REGISTRY = LazyRegistry(
    "rollout engine",
    "actor_rollout_ref.rollout.name",
    {
        "hf": "verl.workers.rollout.hf_rollout:HFRollout",
        "vllm": "verl.workers.rollout.vllm_rollout:VLLMRollout",
    },
)

__all__ = ["BaseRollout", "get_rollout_class", "register_rollout"]


def register_rollout(name: str):
    """Class decorator registering a rollout engine under `name` (`actor_rollout_ref.rollout.name=<name>`).

    A registered engine is built by the worker like `hf`: `cls(module, config, tokenizer)` with an un-sharded
    copy of the policy as `module`.
    """
    return ROLLOUT_REGISTRY.register(name)


def get_rollout_class(name: str) -> type[BaseRollout]:
    """The rollout engine class registered as `name`; ValueError listing the known names otherwise."""
    return ROLLOUT_REGISTRY.get(name)
