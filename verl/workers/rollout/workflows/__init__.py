"""Rollout workflows by name: `actor_rollout_ref.rollout.workflow` picks one, `.workflow_kwargs` configures it.

Built in: `rlvr` (single turn, the trainer's default), `remax` (a sampled and a greedy completion, reward
difference), `multi_turn_tool` (tool calls and `<obs>` turns), `environment` (a verifiers-style
`verl.envs.Environment` through the OpenAI-compatible client), `agent_loop` (verl 0.9.1's agent loops,
`verl.experimental.agent_loop`; the trainer picks it for `rollout.multi_turn.enable=true` or rows with an
`agent_name`). A user workflow is registered with
`@register_workflow("name")` or named by a dotted path (`pkg.module:Class` or `pkg.module.Class`).
Built-ins are imported lazily. Layer 5: must not import Ray.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from verl.utils.registry import LazyRegistry
from verl.workers.rollout.workflows.base import (
    ROLLOUT_FIELDS,
    RolloutWorkflow,
    arollout_batch,
    drop_rejected_rows,
    load_callable,
    prompt_ids_of,
    rollout_batch,
    single_turn_row,
    single_turn_rows,
    trajectory_row,
)

WORKFLOW_REGISTRY = LazyRegistry(
    "rollout workflow",
    "actor_rollout_ref.rollout.workflow",
    {
        "rlvr": "verl.workers.rollout.workflows.rlvr:RLVRWorkflow",
        "remax": "verl.workers.rollout.workflows.remax:ReMaxWorkflow",
        "multi_turn_tool": "verl.workers.rollout.workflows.multi_turn_tool:MultiTurnToolWorkflow",
        "environment": "verl.workers.rollout.workflows.environment:EnvironmentWorkflow",
        "agent_loop": "verl.workers.rollout.workflows.agent_loop:AgentLoopWorkflow",
    },
)

__all__ = [
    "ROLLOUT_FIELDS",
    "RolloutWorkflow",
    "arollout_batch",
    "build_workflow",
    "drop_rejected_rows",
    "get_workflow_class",
    "load_callable",
    "prompt_ids_of",
    "register_workflow",
    "rollout_batch",
    "single_turn_row",
    "single_turn_rows",
    "trajectory_row",
]


def register_workflow(name: str):
    """Class decorator registering a `RolloutWorkflow` under `name` (`rollout.workflow=<name>`)."""
    return WORKFLOW_REGISTRY.register(name)


def get_workflow_class(name: str) -> type[RolloutWorkflow]:
    """The workflow class registered as `name`, or the class at the dotted path `name`."""
    if name in WORKFLOW_REGISTRY:
        return WORKFLOW_REGISTRY.get(name)
    if "." not in name:
        raise ValueError(
            f"unknown rollout workflow {name!r} (actor_rollout_ref.rollout.workflow); allowed: "
            f"{WORKFLOW_REGISTRY.names()} or a dotted path 'pkg.module:Class'"
        )
    try:
        cls = load_callable(name)
    except (ImportError, AttributeError, ValueError, FileNotFoundError) as err:
        raise ValueError(f"rollout.workflow={name!r} cannot be imported ({type(err).__name__}: {err})") from err
    if not (isinstance(cls, type) and issubclass(cls, RolloutWorkflow)):
        raise TypeError(f"rollout.workflow={name!r} is {cls!r}, not a RolloutWorkflow subclass")
    return cls


def build_workflow(rollout_config: Any, tokenizer: Any) -> RolloutWorkflow | None:
    """The workflow `rollout.workflow` with `rollout.workflow_kwargs`; None when `workflow` is null (the
    worker then calls the engine's `generate_sequences` directly)."""
    name = rollout_config.get("workflow", None)
    if not name:
        return None
    kwargs = rollout_config.get("workflow_kwargs", None) or {}
    if OmegaConf.is_config(kwargs):
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    return get_workflow_class(str(name))(rollout_config, tokenizer, **kwargs)
