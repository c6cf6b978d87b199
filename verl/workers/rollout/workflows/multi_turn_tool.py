"""The `multi_turn_tool` workflow: the model calls Python tools in `<tool_call>` JSON and reads `<obs>` turns.

One episode, on the token level (no re-tokenisation of what the model wrote):

    prompt | turn 1 (model, stops after "</tool_call>") | "<obs> result </obs>" (tools) | turn 2 (model) | ...

A turn with `<tool_call>` blocks runs every call (`verl.envs.tools`: registered typed functions) and
appends their observations; a turn without one (a `<response>`, or text ended by eos) ends the episode, as
do `rollout.multi_turn.max_turns` model turns (no observation is appended after the last allowed turn) and
the `rollout.response_length` token budget shared by all turns. Bad JSON, unknown tools, wrong arguments,
exceptions and timeouts become `error: ...` observations: the episode never crashes on model output.

Training fields: `response_mask` is the loss mask (1 on model tokens, 0 on observation tokens, which stay
in `attention_mask`); `rollout_log_probs` are 0 on observation tokens. The trainer's reward function scores
the whole response (model turns and `<obs>` lines) after the episode. Non-tensor `num_turns` counts the
model turns of each row.

Config (`actor_rollout_ref.rollout.multi_turn`): `format` (verl's tool-call format: `hermes`, i.e.
`<tool_call>{json}</tool_call>`; `verl.envs.tools.TOOL_CALL_FORMATS`), `max_turns`, `tool_modules` (modules or .py files whose
`@tool` functions register), `tools` (names offered; null = all registered), `tool_timeout_s`,
`max_tool_response_length` (characters per observation). `registry=` (a `ToolRegistry`) may be passed
when building the workflow in Python.

Layer 5: must not import Ray.
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
