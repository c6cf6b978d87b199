"""verl's `verl.experimental.agent_loop` package: the agent loops and their tool-call parsers.

Exports verl's names: `AgentLoopBase`, `AgentLoopOutput`, `AgentLoopMetrics`, `DictConfigWrap`, `ToolListWrap`,
`register`, `get_trajectory_info` (`agent_loop`), `SingleTurnAgentLoop` ("single_turn_agent") and `ToolAgentLoop`
("tool_agent"), imported here so that importing the package registers both (as in verl), and `FunctionCall` /
`ToolParser` (`tool_parser`), and `AgentLoopWorker` (`agent_loop_worker`, imported on first use). verl's Ray
`AgentLoopManager` is not provided (asking for it says why): loops run inside each rollout worker through the
`agent_loop` rollout workflow, which runs each row through an `AgentLoopWorker`.

Layer 1: its modules (the standard library, pydantic, torch, hydra, `verl.tools` and `verl.envs.tool_formats`), but
`agent_loop_worker`, layer 4 (the data protocol and the datasets), which only a function here imports.
"""

from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    build_agent_loop,
    get_trajectory_info,
    register,
)
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

__all__ = [
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "DictConfigWrap",
    "FunctionCall",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "ToolListWrap",
    "ToolParser",
    "build_agent_loop",
    "get_trajectory_info",
    "register",
]


def __getattr__(name: str):
    if name == "AgentLoopWorker":  # imported on first use: it needs the data protocol and the datasets
        from verl.experimental.agent_loop.agent_loop_worker import AgentLoopWorker

        return AgentLoopWorker
    if name == "AgentLoopManager":
        raise AttributeError(
            "verl's AgentLoopManager (Ray agent-loop workers) is not provided here: agent loops run inside each "
            "rollout worker through the agent_loop rollout workflow (actor_rollout_ref.rollout.multi_turn.enable=true)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
