"""Tests of verl/envs/environment.py and verl/envs/gsm8k.py: the weighted rubric by hand, a single-turn
environment through the in-process client on the tiny model, and the multi-turn `ToolEnv` loop (tool
results, errors, completion and the turn limit) driven by a client that replays fixed answers."""

import asyncio

import pytest

from verl.envs.environment import MultiTurnEnv, Rubric, SingleTurnEnv, ToolEnv
from verl.envs.gsm8k import GSM8KEnv, answer_format, correct_answer
from verl.envs.openai_client import OpenAIClient
from verl.envs.tools import ToolRegistry

PROMPT = [{"role": "user", "content": "Janet has 16 eggs and eats 3. How many are left?"}]


def test_rubric_weights_and_arguments():
    def exact(completion, answer):
        return float(completion[-1]["content"] == answer)

    async def long_enough(completion, state):
        return float(len(completion[-1]["content"]) >= state["min_len"])

    def anything(**kwargs):
        return float(sorted(kwargs) == ["answer", "completion", "info", "prompt", "state"])

    rubric = Rubric([exact, long_enough, anything], [2.0, 0.5, -1.0])
    reward, metrics = asyncio.run(rubric.score(PROMPT, [{"role": "assistant", "content": "13"}], "13", {"min_len": 3}))
    assert metrics == {"exact": 1.0, "long_enough": 0.0, "anything": 1.0}
    assert reward == 2.0 * 1.0 + 0.5 * 0.0 - 1.0 * 1.0
    with pytest.raises(ValueError, match="2 functions and 1 weights"):
        Rubric([exact, anything], [1.0])
    with pytest.raises(TypeError, match="takes none of"):
        Rubric([lambda x: 1.0])


def test_gsm8k_reward_functions():
    done = [{"role": "assistant", "content": "16 - 3 = 13\n#### 13"}]
    assert correct_answer(done, "13") == 1.0 and correct_answer(done, "12") == 0.0 and answer_format(done) == 1.0
    assert answer_format([{"role": "assistant", "content": "thirteen"}]) == 0.0
    reward, metrics = asyncio.run(GSM8KEnv(format_weight=0.25).rubric.score(PROMPT, done, "12", {}))
    assert reward == 0.25 and metrics == {"correct_answer": 0.0, "answer_format": 1.0}


def test_single_turn_env_through_the_in_process_client(engine, tokenizer):
    client = OpenAIClient(engine)
    env = GSM8KEnv(sampling_args={"max_tokens": 6, "temperature": 0})
    result = asyncio.run(env.run(client, PROMPT, "13"))
    assert (
        len(client.records) == 1
        and result.state["responses"][0].choices[0].message.content == result.completion[0]["content"]
    )
    assert result.completion[0]["content"] == tokenizer.decode(
        client.records[0].completion_ids, skip_special_tokens=True
    )
    assert result.reward == correct_answer(result.completion, "13") + 0.1 * answer_format(result.completion)
    assert set(result.metrics) == {"correct_answer", "answer_format"}


class ReplayClient:
    """An OpenAI-shaped client answering with fixed texts, recording the messages it was sent."""

    def __init__(self, answers):
        self.answers, self.sent = list(answers), []
        self.chat = type("Chat", (), {"completions": type("Completions", (), {"create": self._create})()})()

    async def _create(self, model, messages, **kwargs):
        self.sent.append([dict(m) for m in messages])
        content = self.answers.pop(0)
        message = type("Message", (), {"content": content})()
        return type("Response", (), {"choices": [type("Choice", (), {"message": message})()]})()


def tool_env(**kwargs):
    registry = ToolRegistry()

    @registry.register
    def div(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    return ToolEnv(registry=registry, **kwargs)


def test_tool_env_runs_calls_until_an_answer():
    client = ReplayClient([
        '<tool_call>{"name": "div", "arguments": {"a": 1, "b": 0}}</tool_call>',
        '<tool_call>{"name": "div",</tool_call>',
        '<tool_call>{"name": "div", "arguments": {"a": 26, "b": 2}}</tool_call>',
        "<response> 13 </response>",
    ])  # fmt: skip
    completion, state = asyncio.run(tool_env(max_turns=6).rollout(client, PROMPT, "13"))
    assert [m["role"] for m in completion] == ["assistant", "user"] * 3 + ["assistant"]
    assert completion[1]["content"] == "<obs> error: tool 'div' raised ZeroDivisionError: division by zero </obs>"
    assert completion[3]["content"].startswith("<obs> error: the tool call is not valid JSON")
    assert completion[5]["content"] == "<obs> 13.0 </obs>" and state["tool_errors"] == 2 and state["turn"] == 4
    assert client.sent[-1] == PROMPT + completion[:-1]  # every request carried the whole conversation


def test_multi_turn_env_stops_at_max_turns():
    client = ReplayClient(['<tool_call>{"name": "div", "arguments": {"a": 4, "b": 2}}</tool_call>'] * 5)
    completion, state = asyncio.run(tool_env(max_turns=2).rollout(client, PROMPT, None))
    assert state["turn"] == 2 and [m["role"] for m in completion] == ["assistant", "user", "assistant"]
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        MultiTurnEnv(max_turns=0)
    assert isinstance(GSM8KEnv(), SingleTurnEnv)
