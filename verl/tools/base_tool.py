"""`BaseTool`: verl's stateful tool, with one instance of state per trajectory.

A rollout drives a tool through this lifecycle (every method async, ids are strings):

    instance_id, creation_response = await tool.create(instance_id=None, **kwargs)   # per trajectory
    response, step_reward, metrics = await tool.execute(instance_id, parameters)     # per call, repeatable
    reward = await tool.calc_reward(instance_id)                                     # optional, at the end
    await tool.release(instance_id)                                                  # always, in `finally`

`parameters` is the decoded arguments dict of the model's call; `response` is a `ToolResponse`. The defaults
keep no state: `create` hands back the given id (or a fresh uuid4), `execute` answers a fixed text with reward
0.0, `calc_reward` is 0.0 and `release` does nothing. A subclass overrides what it needs and keeps the
constructor signature `(config, tool_schema)`, which the tool-config YAML loader
(`verl.tools.tool_registry.initialize_tools_from_config`) calls with the entry's `config` dict and its parsed
`tool_schema` (None when the YAML gives none: the subclass's `get_openai_tool_schema()` supplies it then).

Differences from verl 0.9.1: the schema is logged (at INFO), not printed, and `execute` is not wrapped in
verl's rollout tracer.

Layer 1 (utilities): the standard library and `verl.tools.schemas` (pydantic).
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import uuid4

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool"]

logger = logging.getLogger(__name__)


class BaseTool:
    """Base class of stateful tools: override `execute` (and `create`/`calc_reward`/`release` where the tool
    keeps per-trajectory state). `self.config` is the YAML entry's `config`, `self.name` the schema's name."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = config
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if not isinstance(self.tool_schema, OpenAIFunctionToolSchema):
            raise ValueError(
                f"{type(self).__name__} has no tool schema (got {self.tool_schema!r}): give a `tool_schema:` in its "
                f"tool config entry, or override get_openai_tool_schema() to return an OpenAIFunctionToolSchema"
            )
        self.name = self.tool_schema.function.name
        logger.info("tool %r (%s): %s", self.name, type(self).__name__,
                    self.tool_schema.model_dump_json(exclude_unset=True, exclude_none=True))  # fmt: skip

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema offered to the model. A subclass with a built-in schema overrides this; the base returns
        what the constructor was given (None while there is none)."""
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start the state of one trajectory: (its instance id, a response shown on creation, empty here)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call with the model's decoded `parameters`: (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The tool's reward for this trajectory's state (0.0 here)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Free this trajectory's state (nothing to free here)."""
