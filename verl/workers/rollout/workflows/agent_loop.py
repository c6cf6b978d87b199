"""The `agent_loop` workflow: verl 0.9.1's agent loops (`verl.experimental.agent_loop`) on the rank's engine.

The trainer picks it when `rollout.multi_turn.enable=true`, when rows carry an `agent_name`, or when
`rollout.agent.default_agent_loop` / `agent_loop_config_path` is set (`verl.trainer.main_ppo`). The workflow
holds one `AgentLoopWorker` (built with the trainer config `{actor_rollout_ref: {rollout}, data}` and the policy's
tokenizer: it loads the tools once and checks the agent settings), and each row is one episode through it:
- the row's non-tensor fields as verl's dataset gives them (`tools_kwargs` and `interaction_kwargs` taken from
  `extra_info` when the row has no such column, `index` likewise; `agent_name`, default
  `rollout.agent.default_agent_loop`, picks the loop and is not passed to it) and verl's sampling parameters for
  this call (`rollout.*`, `val_kwargs` when validating, greedy as temperature 0, `logprobs` =
  `rollout.calculate_log_probs`) go to `AgentLoopWorker._run_agent_loop`, with a server manager over the engine;
- the episode is batched by `AgentLoopWorker._postprocess`, verl's post-processing, and the training row is its
  rollout fields (`prompts` padded to `rollout.prompt_length`, which must be the batch's prompt width;
  `response_mask` the loss mask: tool-result tokens 0 and attended; `rollout_log_probs` with
  `rollout.calculate_log_probs`), the input row's non-tensor fields, and `__num_turns__` (verl's `num_turns/*`
  metrics), the stable extra fields (`turn_scores`, `tool_rewards`: `agent_loop/tool_reward/*` metrics,
  `min_global_steps`, `max_global_steps`, `extras`), `reward_score` (the loop's own score: the reward when every row
  of a batch has one, verl's `rm_scores`), `tool_extra_fields` (the loop's whole `extra_fields`, merged into the
  reward function's `extra_info` as verl's reward loop does) and `agent_loop_metrics`.

`EngineServerManager` is the server manager a loop gets: `await generate(request_id=..., prompt_ids=...,
sampling_params=...)` -> `TokenOutput`, one `AsyncRolloutEngine.agenerate` request, so the concurrent episodes
of a rank share batched generate calls. It takes verl's sampling keys (`temperature`, `top_p`, `top_k`,
`logprobs`, `max_tokens` / `max_new_tokens` (at most `rollout.response_length`, the default as in verl's
server client), `stop`, `stop_token_ids`, `repetition_penalty` 1.0, `n` 1); another key or value, and any image,
video or audio input, is refused with an error naming it.

workflow_kwargs: `data_config` (the trainer's `data` section; main_ppo passes it). Layer 5: must not import Ray.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import get_trajectory_info
from verl.experimental.agent_loop.agent_loop_worker import STABLE_EXTRA_FIELDS, AgentLoopWorker, object_column
from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, GenerationHyperparameters, ModelRequest
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.workflows.base import ROLLOUT_FIELDS, RolloutWorkflow

__all__ = ["AgentLoopWorkflow", "EngineServerManager", "sampling_params_of"]

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "stop",
                 "stop_token_ids", "repetition_penalty", "n")  # fmt: skip


def sampling_params_of(engine: AsyncRolloutEngine) -> dict[str, Any]:
    """The keys `AgentLoopWorker.generate_sequences` sends, from the engine's sampling for this call (rollout.* or
    val_kwargs, greedy as temperature 0, also when meta_info["do_sample"] is false) and `logprobs` =
    `rollout.calculate_log_probs`."""
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


class AgentLoopWorkflow(RolloutWorkflow):
    """verl's agent loops as a rollout workflow (see the module docstring)."""

    extra_output_keys = {
        key: "object"
        for key in ("__num_turns__", *STABLE_EXTRA_FIELDS, "reward_score", "tool_extra_fields", "agent_loop_metrics")
    }

    def __init__(self, config: Any, tokenizer: Any, data_config: Any = None):
        super().__init__(config, tokenizer)
        data = OmegaConf.to_container(data_config, resolve=True) if OmegaConf.is_config(data_config) else data_config
        trainer_config = OmegaConf.create({"actor_rollout_ref": {"rollout": config}, "data": dict(data or {})})
        self.worker = AgentLoopWorker(trainer_config, llm_client=None, tokenizer=tokenizer)

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        fields = {key: values[0] for key, values in data.non_tensor_batch.items()}
        agent_name = str(fields.pop("agent_name", None) or self.worker.default_agent_loop)
        if "raw_prompt" not in fields:
            raise KeyError("verl's agent loops read the chat `raw_prompt`: set data.return_raw_chat=true")
        extra_info = fields.get("extra_info") if isinstance(fields.get("extra_info"), dict) else {}
        for key in ("tools_kwargs", "interaction_kwargs"):  # verl's dataset lifts them out of extra_info
            if fields.get(key) is None:
                fields[key] = extra_info.get(key) or {}
        fields.setdefault("index", extra_info.get("index", 0))
        worker = copy.copy(self.worker)  # this engine's server manager and model type, the rest shared
        worker.llm_client = EngineServerManager(engine)
        worker.hf_model_type = getattr(getattr(getattr(engine.rollout, "module", None), "config", None), "model_type",
                                       None)  # fmt: skip
        validate = bool(data.meta_info.get("validate", False))
        [trajectory] = await get_trajectory_info(data.meta_info.get("global_steps", -1), [fields["index"]], validate)
        episode = await worker._run_agent_loop(sampling_params_of(engine), trajectory, agent_name=agent_name,
                                               **fields)  # fmt: skip
        batch = worker._postprocess([episode], input_non_tensor_batch=dict(data.non_tensor_batch), validate=validate)
        return self._training_row(engine, data, batch, episode.reward_score, episode.extra_fields)

    def _training_row(self, engine: AsyncRolloutEngine, data: DataProto, batch: DataProto, reward_score: Any,
                      extra_fields: dict) -> DataProto:  # fmt: skip
        """The row of the workflow contract out of `_postprocess`'s one-episode batch (see the module docstring)."""
        width = data.batch["input_ids"].shape[-1]
        if batch.batch["prompts"].shape[-1] != width:
            raise ValueError(f"actor_rollout_ref.rollout.prompt_length={self.config.prompt_length} differs from the "
                             f"batch's prompt width {width}: set it to data.max_prompt_length")  # fmt: skip
        tensors = {key: batch.batch[key] for key in ROLLOUT_FIELDS}
        if engine.config.get("calculate_log_probs", False):
            zeros = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
            tensors["rollout_log_probs"] = batch.batch.get("rollout_log_probs", zeros)
        columns = batch.non_tensor_batch
        non_tensors = {key: columns[key] for key in (*data.non_tensor_batch, "__num_turns__", *STABLE_EXTRA_FIELDS)}
        non_tensors.update(
            reward_score=object_column([reward_score]),
            tool_extra_fields=object_column([dict(extra_fields)]),
            agent_loop_metrics=object_column(batch.meta_info["metrics"]),
        )
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
