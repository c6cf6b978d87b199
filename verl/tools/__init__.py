"""verl's tool API, at verl's module path: tools a multi-turn rollout offers the model, in verl 0.9.1's names.

- `verl.tools.schemas`: the OpenAI tool schema as pydantic models (`OpenAIFunctionToolSchema` and its parts),
  parsed calls (`OpenAIFunctionParsedSchema`, `OpenAIFunctionCallSchema`, `OpenAIFunctionToolCall`) and
  `ToolResponse`;
- `verl.tools.base_tool`: `BaseTool`, a stateful tool with a per-trajectory lifecycle
  (`create` -> `execute`... -> `calc_reward` -> `release`);
- `verl.tools.function_tool`: `FunctionTool` and the `@function_tool` decorator (a plain Python function as a
  stateless tool; its schema comes from `verl.envs.tools`' annotation schema builder plus the docstring);
- `verl.tools.tool_registry`: the tool-config YAML loader (`initialize_tools_from_config`) and `load_all_tools`.

The `<tool_call>` parser and the `@tool` registry of the `multi_turn_tool` workflow stay in `verl.envs.tools`;
this package builds on them instead of repeating them.

Layer 1 (utilities): the standard library, pydantic, omegaconf and `verl.envs.tools`; never torch or Ray
directly. This `__init__` imports nothing, as verl's does.
"""
