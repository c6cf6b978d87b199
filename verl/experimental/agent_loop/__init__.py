"""verl's `verl.experimental.agent_loop` package: the agent loops and their tool-call parsers.

Exports what is built so far: `FunctionCall` and `ToolParser` (`tool_parser`, verl's parsers over the shared
text readers of `verl.envs.tool_formats`). Keep this light: nothing here may import torch, Ray or an engine.

Layer 1: standard library and `verl.envs.tool_formats` only.
"""

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

__all__ = ["FunctionCall", "ToolParser"]
