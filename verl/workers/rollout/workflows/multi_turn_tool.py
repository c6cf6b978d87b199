"""The `multi_turn_tool` workflow: the model calls Python tools in `<tool_call>` JSON and reads `<obs>` turns.

Token-level episode: prompt | model turn (stops after "</tool_call>") | "<obs> result </obs>" | model turn | ... A
turn without a tool call, `max_turns` or the `response_length` budget ends it; tool failures become `error: ...`
observations. `response_mask` is 0 on observation tokens (which stay in `attention_mask`); `num_turns` counts model
turns. Config (`rollout.multi_turn`): `format`, `max_turns`, `tool_modules`, `tools`, `tool_timeout_s`,
`max_tool_response_length`; `registry=` in Python. Layer 5: must not import Ray.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.envs.tools import (
    DEFAULT_REGISTRY,
    ToolRegistry,
    format_observations,
    get_tool_call_format,
    import_tool_modules,
    run_tool_calls,
)
from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest
from verl.workers.rollout.workflows.base import RolloutWorkflow, prompt_ids_of, trajectory_row


class MultiTurnToolWorkflow(RolloutWorkflow):
    extra_output_keys = {"num_turns": "object"}

    def __init__(self, config: Any, tokenizer: Any, registry: ToolRegistry | None = None):
        super().__init__(config, tokenizer)
        multi_turn = config.get("multi_turn", None) or {}
        self.tool_call_format = get_tool_call_format(multi_turn.get("format", "hermes"))
        self.max_turns = int(multi_turn.get("max_turns", 4))
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns must be >= 1, got {self.max_turns}")
        timeout = multi_turn.get("tool_timeout_s", 30)
        self.tool_timeout_s = None if timeout is None else float(timeout)
        max_chars = multi_turn.get("max_tool_response_length", 512)
        self.max_tool_response_length = None if max_chars is None else int(max_chars)
        import_tool_modules(list(multi_turn.get("tool_modules", None) or []))
        registry = registry or DEFAULT_REGISTRY
        names = multi_turn.get("tools", None)
        self.registry = registry.subset(list(names)) if names else registry
        if not self.registry.names():
            raise ValueError(
                "the multi_turn_tool workflow has no tools: register functions with @verl.envs.tools.tool in a "
                "module listed in rollout.multi_turn.tool_modules"
            )
        self.tool_schemas = self.registry.schemas()  # typed values and ids for the qwen3_coder and kimi formats

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        prompt = prompt_ids_of(data)
        base = engine.default_gconfig().new(stop=(self.tool_call_format.stop,))
        response: list[int] = []
        loss_mask: list[int] = []
        log_probs: list[float] = []
        turns = 0
        while turns < self.max_turns and len(response) < engine.response_length:
            budget = engine.response_length - len(response)
            resp = await engine.agenerate(ModelRequest(prompt + response, base.new(max_new_tokens=budget)))
            turns += 1
            response += resp.output_tokens
            loss_mask += [1] * resp.output_len
            log_probs += resp.output_logprobs
            if resp.stop_reason == "length" or turns >= self.max_turns:
                break
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=False)
            calls = self.tool_call_format.parse(text, self.tool_schemas)
            if not calls or "<response>" in text:
                break
            observations = await run_tool_calls(self.registry, calls, self.tool_timeout_s)
            obs_text = format_observations(observations, self.max_tool_response_length)
            obs_ids = self.tokenizer.encode(obs_text, add_special_tokens=False)[
                : engine.response_length - len(response)
            ]
            response += obs_ids
            loss_mask += [0] * len(obs_ids)
            log_probs += [0.0] * len(obs_ids)
        row = trajectory_row(engine, data, response, loss_mask, log_probs)
        row.non_tensor_batch["num_turns"] = np.array([turns], dtype=object)
        return row
