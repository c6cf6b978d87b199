"""Tests of verl's agent loops (verl/experimental/agent_loop/): `ToolAgentLoop` and `SingleTurnAgentLoop` on a
scripted server manager (it answers each generate call with the next scripted model turn) and the tiny model's
real tokenizer and chat template, with real `BaseTool` / `FunctionTool` tools.

Checked: the token stream is the chat template of the conversation (tool results appended as its delta, the
template's `\\n` after the model's `<|im_end|>`), tool-result tokens have response_mask 0 and log-prob 0, the
turn limits (`max_assistant_turns`, `max_user_turns`), the response budget, `max_parallel_calls` (run
concurrently, the rest dropped), truncation sides, tool errors as messages, the BaseTool lifecycle with the row's
`create_kwargs` (`release` always), tool rewards, `tool_selection`, the registry and `agent_loop_config` entries,
and multi-modal input refused.
"""

from __future__ import annotations

import asyncio

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from verl.experimental.agent_loop import agent_loop as agent_loop_module
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    build_agent_loop,
    register,
)
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop, truncate_tool_response
from verl.tools.base_tool import BaseTool
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

QUESTION = [{"role": "user", "content": "What is 6 / 3?"}]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedServer:
    """A server manager answering the i-th generate call with turns[i] (the last one repeated), log-prob -0.5 per
    token when asked; it records every call and how many calls were in flight at once."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, **kwargs) -> TokenOutput:
        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        text = self.turns[min(len(self.calls), len(self.turns)) - 1]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids) if sampling_params.get("logprobs") else None,
                           stop_reason="completed", extra_fields={"global_steps": 7, "max_global_steps": 7})  # fmt: skip


def schema(name: str, **properties: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
                       "required": list(properties)}}})  # fmt: skip


class Divider(BaseTool):
    """div(a, b) = a / b; records its lifecycle; reward 0.5 per call. `gate` (an asyncio.Event) holds execute."""

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        self.events, self.running, self.most_running, self.gate = [], 0, 0, None

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.events.append(("create", instance_id, kwargs))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        self.events.append(("execute", instance_id, parameters, type(kwargs.get("agent_data")).__name__))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 0.2)  # released only if every call runs at once
            return ToolResponse(text=str(parameters["a"] / parameters["b"])), 0.5, {}
        finally:
            self.running -= 1

    async def release(self, instance_id, **kwargs):
        self.events.append(("release", instance_id))


def make_loop(tokenizer, server, tools=(), cls=ToolAgentLoop, data=None, **multi_turn) -> AgentLoopBase:
    settings = dict(format="hermes", max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                    max_tool_response_length=256, tool_response_truncate_side="middle")  # fmt: skip
    settings.update(multi_turn)
    response_length = settings.pop("response_length", 256)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 64, "response_length": response_length,
                                                                 "multi_turn": settings}}, "data": data or {}})  # fmt: skip
    return cls(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer, processor=None,
               dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data), tools=ToolListWrap(list(tools)))  # fmt: skip


def run(loop, messages=QUESTION, logprobs=True, **fields) -> AgentLoopOutput:
    return asyncio.run(loop.run({"temperature": 1.0, "logprobs": logprobs}, raw_prompt=list(messages), **fields))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_ids(tokenizer, messages, generation_prompt=False) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)["input_ids"]
    )


# ----------------------------------------------------------------------------------------------- the tool loop
def test_tool_results_are_appended_as_the_templates_delta_with_mask_zero(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = [call("div", '{"a": 6, "b": 3}'), "So it is 2.<|im_end|>"]
    server, divider = ScriptedServer(tok, turns), Divider({}, schema("div", a="number", b="number"))
    kwargs = {"div": {"create_kwargs": {"seed": 5}}}
    out = run(make_loop(tok, server, [divider]), tools_kwargs=kwargs)

    prompt = template_ids(tok, QUESTION, generation_prompt=True)
    assert out.prompt_ids == prompt
    # the whole stream is the template of the conversation (it ends at the model's <|im_end|>, not the "\n" after)
    conversation = QUESTION + [{"role": "assistant", "content": turns[0][: -len("<|im_end|>")]},
                               {"role": "tool", "content": "2.0"}, {"role": "assistant", "content": "So it is 2."}]  # fmt: skip
    assert out.prompt_ids + out.response_ids == template_ids(tok, conversation)[:-1]
    first, second = ids_of(tok, turns[0]), ids_of(tok, turns[1])
    inserted = len(out.response_ids) - len(first) - len(second)
    assert (
        tok.decode(out.response_ids[len(first) : len(first) + inserted])
        == "\n<|im_start|>tool\n2.0<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.response_mask == [1] * len(first) + [0] * inserted + [1] * len(second)
    assert out.response_logprobs == [-0.5] * len(first) + [0.0] * inserted + [-0.5] * len(second)
    # the second turn was generated on the whole stream so far
    assert server.calls[1]["prompt_ids"] == prompt + out.response_ids[: len(first) + inserted]
    assert out.num_turns == 4 and out.extra_fields["tool_rewards"] == [0.5] and out.extra_fields["turn_scores"] == []
    assert out.extra_fields["max_global_steps"] == 7 and out.reward_score is None
    assert out.metrics.generate_sequences > 0 and out.metrics.tool_calls > 0
    (_, created, create_kwargs), (_, executed, args, agent_data), (_, released) = divider.events
    assert created == executed == released and create_kwargs == {"create_kwargs": {"seed": 5}}
    assert args == {"a": 6, "b": 3} and agent_data == "AgentData"


def test_parallel_calls_run_at_once_up_to_max_parallel_calls(tiny_tokenizer):
    tok = tiny_tokenizer
    three = "".join(call("div", f'{{"a": {a}, "b": 2}}')[: -len("<|im_end|>")] for a in (2, 4, 6)) + "<|im_end|>"
    server, divider = ScriptedServer(tok, [three, "done<|im_end|>"]), Divider({}, schema("div", a="number", b="number"))

    async def episode():
        divider.gate = asyncio.Event()
        loop = make_loop(tok, server, [divider], max_parallel_calls=2)
        task = asyncio.ensure_future(loop.run({"logprobs": False}, raw_prompt=list(QUESTION)))
        while divider.running < 2 and not task.done():
            await asyncio.sleep(0.001)
        divider.gate.set()  # both calls are running before either may finish
        return await task

    out = asyncio.run(episode())
    assert divider.most_running == 2 and out.extra_fields["tool_rewards"] == [0.5, 0.5]
    text = tok.decode(out.response_ids)
    assert "<|im_start|>tool\n1.0<|im_end|>\n<|im_start|>tool\n2.0<|im_end|>\n<|im_start|>assistant\n" in text
    assert "3.0" not in text and out.response_logprobs is None  # the third call was dropped


@pytest.mark.parametrize("limits, model_turns, tool_turns", [({"max_assistant_turns": 2}, 2, 1),
                                                            ({"max_user_turns": 1}, 2, 1),
                                                            ({"max_assistant_turns": 1}, 1, 0)])  # fmt: skip
def test_turn_limits_end_the_episode(tiny_tokenizer, limits, model_turns, tool_turns):
    tok = tiny_tokenizer
    server, divider = (
        ScriptedServer(tok, [call("div", '{"a": 1, "b": 1}')]),
        Divider({}, schema("div", a="number", b="number")),
    )
    out = run(make_loop(tok, server, [divider], **limits))
    assert len(server.calls) == model_turns and len(divider.events) == 3 * tool_turns
    assert out.num_turns == model_turns + tool_turns + 1
    assert (
        sum(1 for i, m in enumerate(out.response_mask) if m and (i == 0 or not out.response_mask[i - 1])) == model_turns
    )


def test_the_response_budget_ends_the_episode_and_drops_a_result_that_does_not_fit(tiny_tokenizer):
    tok = tiny_tokenizer
    turn = call("div", '{"a": 1, "b": 1}')
    n = len(ids_of(tok, turn))
    server, divider = ScriptedServer(tok, [turn]), Divider({}, schema("div", a="number", b="number"))
    out = run(make_loop(tok, server, [divider], response_length=n + 5))  # the result's 10 tokens do not fit
    assert len(server.calls) == 1 and out.response_mask == [1] * n and out.extra_fields["tool_rewards"] == [0.5]
    out = run(make_loop(tok, ScriptedServer(tok, [turn]), [divider], response_length=n - 4))  # cut inside the turn
    assert out.response_ids == ids_of(tok, turn)[: n - 4] and out.response_mask == [1] * (n - 4)


@pytest.mark.parametrize("side, expected", [("left", "(truncated)...6789"), ("right", "0123...(truncated)"),
                                            ("middle", "01...(truncated)...89")])  # fmt: skip
def test_long_tool_responses_are_cut_on_the_configured_side(tiny_tokenizer, side, expected):
    assert truncate_tool_response("0123456789", 4, side) == expected
    assert truncate_tool_response("0123", 4, side) == "0123" and truncate_tool_response(None, 4, side) is None

    def digits() -> str:
        """Ten digits."""
        return "0123456789"

    tool = FunctionTool(name="digits", fn=digits, tool_schema=schema("digits"))
    server = ScriptedServer(tiny_tokenizer, [call("digits", "{}"), "ok<|im_end|>"])
    run(make_loop(tiny_tokenizer, server, [tool], max_tool_response_length=4, tool_response_truncate_side=side))
    assert f"<|im_start|>tool\n{expected}<|im_end|>" in tiny_tokenizer.decode(server.calls[1]["prompt_ids"])


class Failing(Divider):
    async def execute(self, instance_id, parameters, **kwargs):
        self.events.append(("execute", instance_id))
        raise RuntimeError("disk full")


def test_tool_errors_become_the_tool_message_and_release_always_runs(tiny_tokenizer):
    tok = tiny_tokenizer
    failing = Failing({}, schema("div", a="number", b="number"))
    turns = [call("nope", "{}"), call("div", '{"a": 1, "b": 1}'), "end<|im_end|>"]
    server = ScriptedServer(tok, turns)
    out = run(make_loop(tok, server, [failing]))
    text = tok.decode(out.response_ids)
    assert "<|im_start|>tool\nUnknown function 'nope'. Available tools: ['div']<|im_end|>" in text
    assert "<|im_start|>tool\nError executing tool 'div': disk full<|im_end|>" in text
    assert [e[0] for e in failing.events] == ["create", "execute", "release"]
    assert out.extra_fields["tool_rewards"] == [0.0, 0.0] and len(server.calls) == 3


def test_tool_selection_narrows_the_tools_of_a_sample(tiny_tokenizer):
    tok = tiny_tokenizer
    divider = Divider({}, schema("div", a="number", b="number"))
    other = Divider({}, schema("mul", a="number", b="number"))
    server = ScriptedServer(tok, [call("div", '{"a": 1, "b": 1}'), "end<|im_end|>"])
    out = run(make_loop(tok, server, [divider, other]), extra_info={"tool_selection": ["mul"]})
    assert "Unknown function 'div'. Available tools: ['mul']" in tok.decode(out.response_ids) and not divider.events


def test_the_single_turn_loop_is_one_generation(tiny_tokenizer):
    tok = tiny_tokenizer
    server = ScriptedServer(tok, ["Two.<|im_end|>"])
    out = run(make_loop(tok, server, cls=SingleTurnAgentLoop))
    assert out.prompt_ids == template_ids(tok, QUESTION, generation_prompt=True)
    assert out.response_ids == ids_of(tok, "Two.<|im_end|>") and out.response_mask == [1] * len(out.response_ids)
    assert out.num_turns == 2 and out.extra_fields["tool_rewards"] == [] and out.extra_fields["turn_scores"] == []
    assert out.response_logprobs == [-0.5] * len(out.response_ids)


def test_chat_template_arguments_and_the_prompt_limit(tiny_tokenizer):
    tok = tiny_tokenizer
    long_question = [{"role": "user", "content": "word " * 200}]
    server = ScriptedServer(tok, ["ok<|im_end|>"])
    out = run(make_loop(tok, server, cls=SingleTurnAgentLoop), messages=long_question)
    assert out.prompt_ids == template_ids(tok, long_question, generation_prompt=True)[-64:]  # cut on the left


def test_multi_modal_inputs_are_refused(tiny_tokenizer):
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(NotImplementedError, match="multi-modal"):
        run(make_loop(tiny_tokenizer, ScriptedServer(tiny_tokenizer, ["x"]), cls=SingleTurnAgentLoop), messages=image)


# ----------------------------------------------------------------------------------------------- the registry
def test_register_and_build_a_loop_by_name_with_its_config_entry(tiny_tokenizer):
    registry = agent_loop_module._agent_loop_registry
    try:

        @register("echo_agent")
        class EchoLoop(AgentLoopBase):
            def __init__(self, *args, greeting="hi", **kwargs):
                super().__init__(*args, **kwargs)
                self.greeting = greeting

            async def run(self, sampling_params, **kwargs):
                ids = self.tokenizer(self.greeting, add_special_tokens=False)["input_ids"]
                return AgentLoopOutput(prompt_ids=[1], response_ids=ids, response_mask=[1] * len(ids), metrics={})

        target = registry["echo_agent"]["_target_"]
        assert target.endswith("EchoLoop") and {"single_turn_agent", "tool_agent"} <= set(registry)
        registry["loud_echo"] = {
            "name": "loud_echo",
            "_target_": target,
            "greeting": "HELLO",
        }  # an agent_loop_config entry
        loop = make_loop(tiny_tokenizer, None, cls=lambda **kw: build_agent_loop("loud_echo", **kw))
        assert isinstance(loop, EchoLoop) and loop.greeting == "HELLO"
        assert run(loop).response_ids == ids_of(tiny_tokenizer, "HELLO")
        with pytest.raises(ValueError, match="agent loop 'missing' is not registered; registered: .*echo_agent"):
            build_agent_loop("missing")
    finally:
        registry.pop("echo_agent", None)
        registry.pop("loud_echo", None)
