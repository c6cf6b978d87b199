"""verl's tool API at verl's module path (verl 0.9.1's names): `schemas` (pydantic tool schemas, parsed calls,
`ToolResponse`), `base_tool` (`BaseTool`), `function_tool` (`@function_tool`) and `tool_registry` (the tool-config
YAML loader). Builds on `verl.envs.tools`. This `__init__` imports nothing, as verl's does.
"""
