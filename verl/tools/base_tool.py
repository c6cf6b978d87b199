"""`BaseTool`: verl's stateful tool, with one instance of state per trajectory.

Lifecycle (all async): `create(instance_id=None, **kwargs)` -> (instance_id, ToolResponse) per trajectory,
`execute(instance_id, parameters)` -> (ToolResponse, step_reward, metrics) per call, `calc_reward(instance_id)`,
`release(instance_id)` in `finally`. Subclasses keep the constructor `(config, tool_schema)`, which
`verl.tools.tool_registry.initialize_tools_from_config` calls. Unlike verl 0.9.1 the schema is logged, not
printed. Layer 1: the standard library and `verl.tools.schemas`.
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
