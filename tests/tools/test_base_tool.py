"""Tests of verl/tools/base_tool.py: a stateful BaseTool subclass through its lifecycle, the defaults, and the
schema the constructor needs."""

import asyncio

import pytest

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

GUESS_SCHEMA = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the secret number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}


class GuessTool(BaseTool):
    """Per trajectory: a secret (given at create) and the guesses so far; the reward is 1 once guessed."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.state: dict[str, dict] = {}

    async def create(self, instance_id=None, secret: int = 0, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.state[instance_id] = {"secret": secret, "guesses": []}
        return instance_id, ToolResponse(text="game on")

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.state[instance_id]
        state["guesses"].append(parameters["number"])
        hit = parameters["number"] == state["secret"]
        return ToolResponse(text="yes" if hit else "no"), (1.0 if hit else -0.1), {"guesses": len(state["guesses"])}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.state[instance_id]["secret"] in self.state[instance_id]["guesses"])

    async def release(self, instance_id, **kwargs):
        del self.state[instance_id]


def test_a_subclass_keeps_separate_state_per_trajectory():
    tool = GuessTool({"type": "native", "max_guesses": 3}, OpenAIFunctionToolSchema.model_validate(GUESS_SCHEMA))
    assert tool.name == "guess" and tool.config == {"type": "native", "max_guesses": 3}
    assert tool.get_openai_tool_schema().function.parameters.required == ["number"]

    async def episode():
        a, created = await tool.create(secret=7)
        b, _ = await tool.create("traj-b", secret=2)
        assert created.text == "game on" and b == "traj-b" and a != b
        assert await tool.execute(a, {"number": 3}) == (ToolResponse(text="no"), -0.1, {"guesses": 1})
        assert await tool.execute(a, {"number": 7}) == (ToolResponse(text="yes"), 1.0, {"guesses": 2})
        assert await tool.execute(b, {"number": 7}) == (ToolResponse(text="no"), -0.1, {"guesses": 1})
        rewards = (await tool.calc_reward(a), await tool.calc_reward(b))
        await tool.release(a)
        await tool.release(b)
        return rewards

    assert asyncio.run(episode()) == (1.0, 0.0)
    assert tool.state == {}


def test_the_defaults_are_stateless():
    tool = BaseTool({}, GUESS_SCHEMA)  # a dict schema is validated into the model

    async def run():
        first, response = await tool.create()
        second, _ = await tool.create()
        assert first != second and len(first) == 36 and response.is_empty()  # fresh uuid4 strings
        assert (await tool.create("mine"))[0] == "mine"
        assert await tool.execute(first, {"number": 1}) == (ToolResponse(text="Updated the tool state."), 0.0, {})
        assert await tool.calc_reward(first) == 0.0
        assert await tool.release(first) is None

    asyncio.run(run())
    assert isinstance(tool.tool_schema, OpenAIFunctionToolSchema)


def test_a_class_may_supply_its_own_schema():
    class Clock(BaseTool):
        def get_openai_tool_schema(self):
            return OpenAIFunctionToolSchema.model_validate(
                {"type": "function", "function": {"name": "clock", "description": "The time."}}
            )

    assert Clock({}, None).name == "clock"


def test_no_schema_at_all_is_a_clear_error():
    with pytest.raises(ValueError, match=r"BaseTool has no tool schema \(got None\): give a `tool_schema:`"):
        BaseTool({}, None)
