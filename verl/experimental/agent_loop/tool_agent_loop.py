"""verl's `ToolAgentLoop` ("tool_agent"): the model calls tools, reads their results, and goes on, turn by turn.

One episode is a small state machine over an `AgentData` (the episode's messages, token stream and counters):

    PENDING           the prompt: chat template over `raw_prompt` with the tools' schemas, generation prompt
    GENERATING        one model turn (mask 1); then stop when the response reached `rollout.response_length`,
                      after `multi_turn.max_assistant_turns` model turns or `max_user_turns` tool turns, or when
                      the turn has no tool call (read by the `ToolParser` named by `multi_turn.format`)
    PROCESSING_TOOLS  the turn's first `multi_turn.max_parallel_calls` calls run concurrently; each result becomes a
                      `tool` message (its text cut to `max_tool_response_length` characters on the
                      `tool_response_truncate_side`: left, right or middle) and the messages' template tokens are
                      appended with mask 0; a result that would fill the response budget ends the episode instead
    TERMINATED

Tools come from `rollout.multi_turn.tool_config_path` / `function_tool_path` (`verl.tools.tool_registry`), handed
in as `tools=ToolListWrap([...])`. A `BaseTool` call runs its whole lifecycle: `create(create_kwargs=...)` with
the sample's `tools_kwargs[name]["create_kwargs"]`, `execute(instance_id, arguments, agent_data=...)`, and
`release(instance_id)` in a `finally`; a `FunctionTool` is called directly. The reward `execute` returns (a
tool's `calc_reward` is its own business, as in verl) is collected in `tool_rewards`. Unknown tools, arguments
that are not JSON and exceptions become the tool message's text: model output never ends an episode. A sample's
`extra_info["tool_selection"]` (a list of names) narrows the tools it is offered.

Output: prompt and response split off the token stream, `num_turns` = tool turns + model turns + 1,
`extra_fields` with `turn_scores` (always empty here) and `tool_rewards`. Tools returning images or videos are
refused (NotImplementedError).

Layer 1 (utilities): `verl.experimental.agent_loop` (agent_loop, tool_parser) and `verl.tools`; the server
manager is passed in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from enum import Enum
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    MULTI_MODAL_UNSUPPORTED,
    AgentLoopBase,
    AgentLoopOutput,
    ToolListWrap,
    register,
    timed,
)
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import FunctionTool, normalize_function_tool_return
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema, ToolResponse

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = ["AgentData", "AgentState", "ToolAgentLoop", "truncate_tool_response"]

TRUNCATE_SIDES = ("left", "right", "middle")


class AgentState(Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


class AgentData:
    """One episode's state. Tools receive it (`execute(..., agent_data=...)`) and may keep their own data in
    `extra_fields`."""

    def __init__(self, messages: list[dict[str, Any]], image_data: Any, video_data: Any, audio_data: Any,
                 mm_processor_kwargs: dict[str, Any] | None, metrics: dict[str, Any], request_id: str,
                 tools_kwargs: dict[str, Any]):  # fmt: skip
        self.messages = messages
        self.image_data, self.video_data, self.audio_data = image_data, video_data, audio_data
        self.mm_processor_kwargs = mm_processor_kwargs or {}
        self.mm_processor_output = None
        self.metrics = metrics
        self.request_id = request_id
        self.tools_kwargs = tools_kwargs
        self.prompt_ids: list[int] = []  # the whole token stream: prompt, then every turn
        self.response_ids: list[int] = []  # the last model turn's tokens
        self.response_mask: list[int] = []  # one per token after the prompt
        self.response_logprobs: list[float] = []
        self.turn_scores: list[float] = []
        self.tool_rewards: list[float] = []
        self.user_turns = 0
        self.assistant_turns = 0
        self.tool_calls: list[FunctionCall] = []
        self.routed_experts = None
        self.extra_fields: dict[str, Any] = {}


def truncate_tool_response(text: str | None, max_length: int | None, side: str) -> str | None:
    """`text` cut to `max_length` characters with a "(truncated)" marker: its end kept (`left`), its start
    (`right`), or both halves (`middle`, the default for any other side)."""
    if not text or max_length is None or len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - max_length :]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """The ReAct-style tool loop (see the module docstring)."""

    def __init__(self, *args: Any, tools: ToolListWrap | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        multi_turn = self.rollout_config.multi_turn
        self.max_user_turns = multi_turn.max_user_turns
        self.max_assistant_turns = multi_turn.max_assistant_turns
        self.max_parallel_calls = multi_turn.max_parallel_calls
        self.max_tool_response_length = multi_turn.max_tool_response_length
        self.tool_response_truncate_side = multi_turn.tool_response_truncate_side
        tool_list = tools.tools if tools else []
        self.tools = {tool.name: tool for tool in tool_list}
        self.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tool_list]
        self.tool_parser_name = multi_turn.format
        self.tool_parser = ToolParser.get_tool_parser(multi_turn.format, self.tokenizer)
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length

    @staticmethod
    def _make_request_id(priority: int, full_determinism: bool) -> str:
        return f"det-{priority}" if full_determinism else uuid4().hex

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        await self.process_multi_modal_info(messages)  # refuses image/video/audio parts
        full_determinism = bool(self.rollout_config.get("full_determinism", False))
        agent_data = AgentData(messages=messages, image_data=None, video_data=None, audio_data=None,
                               mm_processor_kwargs={}, metrics={},
                               request_id=self._make_request_id(int(priority), full_determinism),
                               tools_kwargs=kwargs.get("tools_kwargs") or {})  # fmt: skip
        extra_info = kwargs.get("extra_info") or {}
        selection = extra_info.get("tool_selection") if isinstance(extra_info, dict) else None
        if selection and self.tools:  # this sample is offered only the tools it names
            agent_data._active_tools = {name: self.tools[name] for name in selection if name in self.tools}
            agent_data._active_tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                                               for tool in agent_data._active_tools.values()]  # fmt: skip
        else:
            agent_data._active_tools, agent_data._active_tool_schemas = self.tools, self.tool_schemas

        state = AgentState.PENDING
        while state != AgentState.TERMINATED:
            if state == AgentState.PENDING:
                state = await self._handle_pending_state(agent_data, sampling_params)
            elif state == AgentState.GENERATING:
                state = await self._handle_generating_state(agent_data, sampling_params)
            else:
                state = await self._handle_processing_tools_state(agent_data)

        n = len(agent_data.response_mask)
        ids, limit = agent_data.prompt_ids, self.response_length
        output = AgentLoopOutput(
            prompt_ids=ids[: len(ids) - n],
            response_ids=ids[len(ids) - n :][:limit],
            response_mask=agent_data.response_mask[:limit],
            response_logprobs=agent_data.response_logprobs[:limit] if agent_data.response_logprobs else None,
            multi_modal_data={},
            num_turns=agent_data.user_turns + agent_data.assistant_turns + 1,
            metrics=agent_data.metrics,
            extra_fields=agent_data.extra_fields,
        )
        output.extra_fields.update({"turn_scores": agent_data.turn_scores, "tool_rewards": agent_data.tool_rewards})
        return output

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        schemas = getattr(agent_data, "_active_tool_schemas", self.tool_schemas)
        agent_data.prompt_ids = await self.ct_build_initial_tokens(agent_data.messages, tools=schemas)
        return AgentState.GENERATING

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        stop_ids = self.tool_parser.stop_token_ids  # a format whose calls do not end the turn stops here
        if stop_ids:
            merged_stops = sorted(set(list(sampling_params.get("stop_token_ids") or []) + list(stop_ids)))
            sampling_params = {**sampling_params, "stop_token_ids": merged_stops}
        with timed("generate_sequences", agent_data.metrics):
            output = await self.server_manager.generate(
                request_id=agent_data.request_id,
                prompt_ids=agent_data.prompt_ids,
                sampling_params=sampling_params,
                image_data=agent_data.image_data,
            )
        preempted = output.num_preempted if output.num_preempted is not None else -1
        if agent_data.metrics.get("num_preempted") is None:
            agent_data.metrics["num_preempted"] = preempted
        else:
            agent_data.metrics["num_preempted"] += max(preempted, 0)
        if not agent_data.extra_fields:
            agent_data.extra_fields.update(output.extra_fields)
        elif output.extra_fields.get("max_global_steps"):  # later turns: only the newest policy version
            agent_data.extra_fields["max_global_steps"] = output.extra_fields["max_global_steps"]

        agent_data.assistant_turns += 1
        agent_data.response_ids = list(output.token_ids)
        keep_log_probs = bool(agent_data.response_logprobs or output.log_probs)
        merged, agent_data.response_mask, log_probs = await self.ct_merge_assistant_token(
            agent_data.prompt_ids, agent_data.response_ids, agent_data.response_mask,
            agent_data.response_logprobs if keep_log_probs else None,
            assistant_logprobs=output.log_probs if output.log_probs else None,
        )  # fmt: skip
        agent_data.prompt_ids = merged.token_ids
        if log_probs is not None:
            agent_data.response_logprobs = log_probs
        if output.routed_experts is not None:
            agent_data.routed_experts = output.routed_experts

        if not ignore_termination and len(agent_data.response_mask) >= self.response_length:
            return AgentState.TERMINATED
        if self.max_assistant_turns and agent_data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and agent_data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED

        active = getattr(agent_data, "_active_tools", self.tools)
        content, agent_data.tool_calls = await self.tool_parser.extract_tool_calls(
            agent_data.response_ids, [tool.tool_schema for tool in active.values()]
        )
        agent_data.messages.append(self._build_assistant_message(content, agent_data))
        return AgentState.PROCESSING_TOOLS if agent_data.tool_calls else AgentState.TERMINATED

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        previous_messages = list(agent_data.messages)
        calls = agent_data.tool_calls[: self.max_parallel_calls]
        with timed("tool_calls", agent_data.metrics):
            results = await asyncio.gather(*(self._call_tool(c, agent_data.tools_kwargs, agent_data) for c in calls))
        for call, (response, reward, _) in zip(calls, results):
            if response.image or response.video:
                raise NotImplementedError(MULTI_MODAL_UNSUPPORTED.format(what=f"tool {call.name!r} returned media"))
            message = {"role": "tool", "content": response.text or ""}
            if call.tool_call_id is not None:
                message["tool_call_id"] = call.tool_call_id
            agent_data.messages.append(message)
            if reward is not None:
                agent_data.tool_rewards.append(reward)

        schemas = getattr(agent_data, "_active_tool_schemas", self.tool_schemas)
        merged, response_mask, log_probs = await self.ct_merge_context_msg(
            previous_messages, agent_data.messages, agent_data.prompt_ids, agent_data.response_mask,
            agent_data.response_logprobs if agent_data.response_logprobs else None, tools=schemas,
        )  # fmt: skip
        if len(response_mask) >= self.response_length:  # no room left for the results and another turn
            return AgentState.TERMINATED
        agent_data.prompt_ids, agent_data.response_mask = merged.token_ids, response_mask
        if agent_data.response_logprobs:
            agent_data.response_logprobs = log_probs or []
        agent_data.user_turns += 1
        return AgentState.GENERATING

    def _build_assistant_message(self, content: str, agent_data: AgentData) -> dict[str, Any]:
        """The assistant message of a turn: its text, and the calls that will run as OpenAI `tool_calls`
        (arguments decoded; undecodable ones kept as written)."""
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if not agent_data.tool_calls:
            return message
        tool_calls = []
        for call in agent_data.tool_calls[: self.max_parallel_calls]:
            decoded, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
                OpenAIFunctionParsedSchema(name=call.name, arguments=call.arguments)
            )
            if bad:
                logger.warning(f"tool call of {call.name!r}: arguments {call.arguments!r} are not a JSON object; "
                               "the assistant message keeps them as written")  # fmt: skip
            function = {"name": call.name, "arguments": call.arguments} if bad else decoded.model_dump()
            entry: dict[str, Any] = {"type": "function", "function": function}
            if call.tool_call_id is not None:
                entry["id"] = call.tool_call_id
            tool_calls.append(entry)
        message["tool_calls"] = tool_calls
        return message

    async def _call_tool(
        self, tool_call: FunctionCall, tools_kwargs: dict[str, Any], agent_data: AgentData
    ) -> tuple[ToolResponse, float, dict]:
        """(response, reward, tool metrics) of one call; every failure is a response text with reward 0.0."""
        active = getattr(agent_data, "_active_tools", self.tools)
        name = tool_call.name
        if name not in active:
            return ToolResponse(text=f"Unknown function '{name}'. Available tools: {list(active)}"), 0.0, {}
        try:
            arguments = json.loads(tool_call.arguments)
        except (json.JSONDecodeError, TypeError) as err:
            return ToolResponse(text=f"Invalid JSON in arguments for '{name}': {err}"), 0.0, {}
        tool, instance_id = active[name], None
        try:
            if isinstance(tool, FunctionTool):  # stateless: no lifecycle, no tools_kwargs
                response, reward, metrics = normalize_function_tool_return(await tool.call(arguments))
            else:
                create_kwargs = ((tools_kwargs or {}).get(name) or {}).get("create_kwargs") or {}
                instance_id, _ = await tool.create(create_kwargs=create_kwargs)
                response, reward, metrics = await tool.execute(instance_id, arguments, agent_data=agent_data)
        except Exception as err:
            logger.warning(f"tool {name!r} failed: {err}")
            return ToolResponse(text=f"Error executing tool '{name}': {err}"), 0.0, {}
        finally:
            if instance_id is not None and not isinstance(tool, FunctionTool):
                await tool.release(instance_id)
        text = truncate_tool_response(response.text, self.max_tool_response_length, self.tool_response_truncate_side)
        media = {key: getattr(response, key) for key in ("image", "video") if getattr(response, key, None) is not None}
        return ToolResponse(text=text, **media), reward, metrics
