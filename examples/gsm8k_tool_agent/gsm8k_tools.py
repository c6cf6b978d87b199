"""Two tools for verl's tool agent loop on GSM8K-style problems, written as verl 0.9.1 `BaseTool` subclasses
(they run unchanged in verl): `CalculatorTool` evaluates arithmetic, `Gsm8kAnswerTool` checks a proposed answer.

`tool_config.yaml` (next to this file) declares them with their schemas; the loop imports them by
`class_name` (`gsm8k_tools.CalculatorTool`), so this folder must be on PYTHONPATH.

- `calculator(expression)`: `+ - * /`, parentheses and numbers only (parsed with `ast`, never `eval`); the
  response is the value, or `error: ...`; step reward 0.0.
- `calc_gsm8k_reward(answer)` (verl's GSM8K tool): `create` takes the sample's ground truth from
  `tools_kwargs["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"]`; `execute` scores the answer with the GSM8K
  rule (`calc_reward`: 1.0 when the number matches) and answers with the parsed answer and that score; its step
  reward is verl's shaping, 0.0 for an answer that scores better than the instance's previous one, else -0.05.
  verl's agent loop makes one instance per call, so this is 0.0 for a right answer and -0.05 for a wrong one.
  The trainer reports it as `agent_loop/tool_reward/*`.
"""

from __future__ import annotations

import ast
import operator
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse
from verl.utils.reward_score import gsm8k

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, `+ - * /`, unary minus and parentheses."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, got {ast.unparse(node)!r}")

    return value(ast.parse(expression.replace(",", ""), mode="eval").body)


def format_number(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:.6g}"


class CalculatorTool(BaseTool):
    """`calculator(expression)` (see the module docstring); keeps no state."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = str(parameters.get("expression", ""))
        try:
            return ToolResponse(text=format_number(evaluate(expression))), 0.0, {}
        except (SyntaxError, ValueError, ZeroDivisionError) as err:
            return ToolResponse(text=f"error: {err}"), 0.0, {}


class Gsm8kAnswerTool(BaseTool):
    """`calc_gsm8k_reward(answer)` (see the module docstring): one state per instance."""

    def __init__(self, config: dict, tool_schema: Any):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"answer": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        state = self._instances[instance_id]
        state["answer"] = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["answer"], str(state["ground_truth"]), method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
