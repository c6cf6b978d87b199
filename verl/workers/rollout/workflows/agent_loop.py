"""The `agent_loop` workflow: verl 0.9.1's agent loops (`verl.experimental.agent_loop`) on the rank's engine.

The trainer picks it when `rollout.multi_turn.enable=true`, when rows carry an `agent_name`, or when
`rollout.agent.default_agent_loop` / `agent_loop_config_path` is set (`verl.trainer.main_ppo`). Per row:
- the loop class named by the row's `agent_name` (default `rollout.agent.default_agent_loop`) is built as verl
  builds it: `trainer_config` / `data_config` in `DictConfigWrap`, the server manager, the tokenizer, no
  processor, `RLHFDataset` as `dataset_cls`, the tools of `multi_turn.tool_config_path` / `function_tool_path`
  (loaded once per workflow) in `ToolListWrap`;
- `await loop.run(sampling_params, **fields)` with verl's sampling parameters (`rollout.*`, `val_kwargs` when
  validating, greedy as temperature 0, `logprobs` = `rollout.calculate_log_probs`) and the row's non-tensor
  fields as verl's dataset gives them (`raw_prompt`, `extra_info`, `index`, `tools_kwargs` and
  `interaction_kwargs` taken from `extra_info` when the row has no such column, ...; `agent_name` is not passed);
- the `AgentLoopOutput` becomes the training row: its prompt ids left-padded to the batch's prompt width, its
  response by `trajectory_row` with `response_mask` as the loss mask (tool-result tokens 0, attended) and its
  log-probs as `rollout_log_probs`; non-tensor fields `__num_turns__` (verl's name: `num_turns/*` metrics),
  `tool_rewards` and `turn_scores` (per-row lists: `agent_loop/tool_reward/*` metrics), `reward_score` (used as
  the reward when every row of a batch has one, verl's `rm_scores`), `tool_extra_fields` (the loop's whole
  `extra_fields`, merged into the reward function's `extra_info` as verl does) and `agent_loop_metrics`.

`EngineServerManager` is the server manager a loop gets: `await generate(request_id=..., prompt_ids=...,
sampling_params=...)` -> `TokenOutput`, one `AsyncRolloutEngine.agenerate` request, so the concurrent episodes
of a rank share batched generate calls. It takes verl's sampling keys (`temperature`, `top_p`, `top_k`,
`logprobs`, `max_tokens` / `max_new_tokens` (at most `rollout.response_length`, the default as in verl's
server client), `stop`, `stop_token_ids`, `repetition_penalty` 1.0, `n` 1); another key or value, and any image,
video or audio input, is refused with an error naming it.

workflow_kwargs: `data_config` (the trainer's `data` section; main_ppo passes it). Layer 5: must not import Ray.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import (
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
    build_agent_loop,
)
from verl.experimental.agent_loop.tool_agent_loop import TRUNCATE_SIDES
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.protocol import DataProto
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.async_engine import AsyncRolloutEngine, GenerationHyperparameters, ModelRequest
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.workflows.base import RolloutWorkflow, trajectory_row
from verl.workers.rollout.workflows.environment import with_prompt

__all__ = ["AgentLoopWorkflow", "EngineServerManager", "sampling_params_of"]

PROJECT_ROOT = str(Path(__file__).resolve().parents[4])  # the folder holding the verl package
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "stop",
                 "stop_token_ids", "repetition_penalty", "n")  # fmt: skip


def sampling_params_of(engine: AsyncRolloutEngine) -> dict[str, Any]:
    """verl's per-sample sampling parameters for this call (`AgentLoopWorker.generate_sequences`): the engine's
    sampling (rollout.* or val_kwargs; greedy as temperature 0) and `logprobs` = `rollout.calculate_log_probs`."""
    g = engine.default_gconfig()
    return {
        "temperature": 0.0 if g.greedy else float(g.temperature),
        "top_p": 1.0 if g.greedy else float(g.top_p),
        "top_k": -1 if g.greedy else int(g.top_k),
        "repetition_penalty": 1.0,
        "logprobs": bool(engine.config.get("calculate_log_probs", False)),
    }


class EngineServerManager:
    """verl's server manager for agent loops, over one `AsyncRolloutEngine` (see the module docstring)."""

    def __init__(self, engine: AsyncRolloutEngine):
        self.engine = engine

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:  # fmt: skip
        media = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_output": kwargs.pop("mm_processor_output", None)}  # fmt: skip
        given = sorted(name for name, value in media.items() if value)
        if given:
            raise NotImplementedError(f"server_manager.generate: multi-modal inputs {given} are not supported here")
        kwargs.pop("priority", None)  # verl's scheduling priority: one batched engine call has none
        if kwargs:
            raise TypeError(f"server_manager.generate got unknown arguments {sorted(kwargs)}")
        gconfig, budget = self._gconfig(sampling_params)
        want_log_probs = bool(sampling_params.get("logprobs", False))
        version = self.engine.version
        versions = {"global_steps": version, "min_global_steps": version, "max_global_steps": version}
        if budget < 1:  # nothing left to generate (a budget already spent)
            return TokenOutput(token_ids=[], log_probs=[] if want_log_probs else None, stop_reason="length",
                               extra_fields=versions)  # fmt: skip
        resp = await self.engine.agenerate(ModelRequest([int(t) for t in prompt_ids], gconfig))
        tokens, log_probs, reason = resp.output_tokens, resp.output_logprobs, resp.stop_reason
        stop_ids = {int(t) for t in sampling_params.get("stop_token_ids") or []}
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
        if cut is not None:
            tokens, log_probs, reason = tokens[:cut], log_probs[:cut], "stop"
        made_by = resp.output_versions[: len(tokens)]  # the policy versions of the tokens kept
        if made_by:
            versions.update(min_global_steps=min(made_by), max_global_steps=max(made_by))
        return TokenOutput(
            token_ids=list(tokens),
            log_probs=list(log_probs) if want_log_probs else None,
            stop_reason="completed" if reason == "stop" else "length",
            extra_fields=versions,
        )

    def _gconfig(self, params: dict[str, Any]) -> tuple[GenerationHyperparameters, int]:
        unknown = sorted(set(params) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling_params {unknown} are not supported by this server manager; known: "
                             f"{list(SAMPLING_KEYS)}")  # fmt: skip
        if float(params.get("repetition_penalty", 1.0)) != 1.0:
            raise ValueError(f"sampling_params repetition_penalty={params['repetition_penalty']} is not supported "
                             "(only 1.0)")  # fmt: skip
        if int(params.get("n", 1)) != 1:
            raise ValueError(f"sampling_params n={params['n']} is not supported: a generate call makes one sample")
        limit = params.get("max_tokens", params.get("max_new_tokens"))
        length = self.engine.response_length
        budget = length if limit is None else min(int(limit), length)  # a turn never outgrows the response
        stop = params.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        temperature = float(params.get("temperature", 1.0))
        if temperature <= 0:
            return GenerationHyperparameters(greedy=True, max_new_tokens=max(budget, 1), stop=stop), budget
        top_k = int(params.get("top_k", -1))
        return GenerationHyperparameters(
            temperature=temperature, top_p=float(params.get("top_p", 1.0)), top_k=top_k if top_k > 0 else -1,
            max_new_tokens=max(budget, 1), stop=stop,
        ), budget  # fmt: skip


def _one(value: Any) -> np.ndarray:
    """A one-row object column holding `value` as it is (a list stays one object)."""
    column = np.empty(1, dtype=object)
    column[0] = value
    return column


class AgentLoopWorkflow(RolloutWorkflow):
    """verl's agent loops as a rollout workflow (see the module docstring)."""

    extra_output_keys = {
        "__num_turns__": "object",
        "reward_score": "object",
        "tool_rewards": "object",
        "turn_scores": "object",
        "tool_extra_fields": "object",
        "agent_loop_metrics": "object",
    }

    def __init__(self, config: Any, tokenizer: Any, data_config: Any = None):
        super().__init__(config, tokenizer)
        data = OmegaConf.to_container(data_config, resolve=True) if OmegaConf.is_config(data_config) else data_config
        self.data_config = OmegaConf.create(dict(data or {}))
        self.trainer_config = OmegaConf.create({"actor_rollout_ref": {"rollout": config}, "data": self.data_config})
        multi_turn = config.get("multi_turn", None) or {}
        side = multi_turn.get("tool_response_truncate_side", "middle")
        if side not in TRUNCATE_SIDES:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={side!r} is not "
                             f"supported: verl's tool agent loop truncates at {list(TRUNCATE_SIDES)}")  # fmt: skip
        fmt = multi_turn.get("format", "hermes")
        try:
            ToolParser.get_tool_parser(fmt, tokenizer)
        except ValueError as err:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={fmt!r}: {err}") from None
        self.tools = load_all_tools(
            _existing(multi_turn.get("tool_config_path", None), "multi_turn.tool_config_path"),
            _existing(multi_turn.get("function_tool_path", None), "multi_turn.function_tool_path"),
        )
        agent = config.get("agent", None) or {}
        config_path = _existing(agent.get("agent_loop_config_path", None), "agent.agent_loop_config_path")
        if config_path:  # verl: a YAML list of {name, _target_, ...constructor arguments}
            for entry in OmegaConf.to_container(OmegaConf.load(config_path), resolve=True):
                _agent_loop_registry[entry["name"]] = dict(entry)
        self.default_agent_loop = str(agent.get("default_agent_loop", None) or "single_turn_agent")
        if self.default_agent_loop not in _agent_loop_registry:
            raise ValueError(f"actor_rollout_ref.rollout.agent.default_agent_loop={self.default_agent_loop!r} is not a "
                             f"registered agent loop; registered: {sorted(_agent_loop_registry)}")  # fmt: skip

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        fields = {key: values[0] for key, values in data.non_tensor_batch.items()}
        agent_name = str(fields.pop("agent_name", None) or self.default_agent_loop)
        if "raw_prompt" not in fields:
            raise KeyError("verl's agent loops read the chat `raw_prompt`: set data.return_raw_chat=true")
        extra_info = fields.get("extra_info") if isinstance(fields.get("extra_info"), dict) else {}
        for key in ("tools_kwargs", "interaction_kwargs"):  # verl's dataset lifts them out of extra_info
            if fields.get(key) is None:
                fields[key] = extra_info.get(key) or {}
        fields.setdefault("index", extra_info.get("index", 0))
        module = getattr(engine.rollout, "module", None)
        loop = build_agent_loop(
            agent_name,
            trainer_config=DictConfigWrap(self.trainer_config),
            server_manager=EngineServerManager(engine),
            tokenizer=self.tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(self.data_config),
            hf_model_type=getattr(getattr(module, "config", None), "model_type", None),
            tools=ToolListWrap(self.tools),
        )
        output = await loop.run(sampling_params_of(engine), **fields)
        if output.multi_modal_data:
            raise NotImplementedError(f"agent loop {agent_name!r} returned multi-modal data, not supported here")
        prompt = with_prompt(data, list(output.prompt_ids), engine.pad_token_id)
        row = trajectory_row(engine, prompt, list(output.response_ids), list(output.response_mask),
                             None if output.response_logprobs is None else list(output.response_logprobs))  # fmt: skip
        extra = dict(output.extra_fields)
        row.non_tensor_batch.update(
            {
                "__num_turns__": _one(int(output.num_turns)),
                "reward_score": _one(output.reward_score),
                "tool_rewards": _one([float(r) for r in extra.get("tool_rewards") or []]),
                "turn_scores": _one(list(extra.get("turn_scores") or [])),
                "tool_extra_fields": _one(extra),
                "agent_loop_metrics": _one(output.metrics.model_dump()),
            }
        )
        return row


def _existing(path: Any, key: str) -> str | None:
    """`path` as an absolute file path: as given, else under the working directory, else under the project root
    (verl's `resolve_config_path`: a Ray worker's working directory may not be the driver's)."""
    if not path:
        return None
    path = str(path)
    candidates = [path] if os.path.isabs(path) else [os.path.join(os.getcwd(), path), os.path.join(PROJECT_ROOT, path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"actor_rollout_ref.rollout.{key}={path!r} is not a file")
