"""verl 0.9.1's `AgentLoopWorker`: a batch of samples -> one agent-loop episode each -> one padded training batch.

`AgentLoopWorker(config, llm_client, teacher_client=None, reward_loop_worker_handles=None, *, tokenizer=None,
hf_model_type=None)`: `config` is the whole trainer config (`actor_rollout_ref.rollout`, `data`, and
`actor_rollout_ref.model.path` for the tokenizer when none is given); `llm_client` the server manager the loops
generate through. Building it loads the tools of `multi_turn.tool_config_path` / `function_tool_path` (once), adds
the entries of `agent.agent_loop_config_path` to the registry, and checks `multi_turn.format`,
`tool_response_truncate_side` and `agent.default_agent_loop`. Then, as in verl:
- `await generate_sequences(batch)`: verl's sampling parameters (`rollout.*`, `val_kwargs` when
  `meta_info["validate"]`, greedy for a REMAX row whose `__do_sample__` is false), `agent_name` defaulting to
  `agent.default_agent_loop`, every row's episode run concurrently, the outputs batched by `_postprocess`;
- `_run_agent_loop(sampling_params, trajectory, *, agent_name, trace=True, **row_fields)`: one episode, inside
  `rollout_trace_attr`, the loop built by `build_agent_loop` with verl's constructor arguments;
- `_agent_loop_postprocess(output, validate, **row_fields)`: the episode padded (`_pad_token_ids`; prompt on the
  left to `rollout.prompt_length`, response on the right to `rollout.response_length`), its `position_ids`
  (cumsum of the attention mask), `routed_experts` placed at the prompt's first token (int16), `raw_prompt` added
  to its `extra_fields`;
- `_postprocess(inputs, input_non_tensor_batch, validate)`: the `DataProto`: tensors `prompts`, `responses`,
  `response_mask`, `input_ids`, `attention_mask`, `position_ids` (+ `rollout_log_probs`, `routed_experts`, and
  `rm_scores` (the score at the last response token) when every episode has a `reward_score`); non-tensors
  `__num_turns__`, the input's columns, one column per extra field, always including `STABLE_EXTRA_FIELDS` (None
  where a loop did not set it) so that batches of different loops concatenate; meta_info `metrics`.

Teacher clients (on-policy distillation), reward-loop workers and multi-modal processors are not provided: given
one, the worker stops with a NotImplementedError; rows are scored by the trainer's reward function after rollout.

Layer 4 (with the datasets): layer 1, the data protocol and `RLHFDataset`; never Ray or an engine.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

import verl.experimental.agent_loop.agent_loop as agent_loop_api
from verl.experimental.agent_loop.agent_loop import (
    MULTI_MODAL_UNSUPPORTED,
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
    _InternalAgentLoopOutput,
    build_agent_loop,
    get_trajectory_info,
)
from verl.experimental.agent_loop.tool_agent_loop import TRUNCATE_SIDES
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.protocol import DataProto
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer import hf_tokenizer
from verl.utils.torch_functional import compute_position_id_with_mask

__all__ = ["STABLE_EXTRA_FIELDS", "AgentLoopWorker", "object_column"]

PROJECT_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding the verl package
STABLE_EXTRA_FIELDS = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras")


def object_column(values: list) -> np.ndarray:
    """A 1-D object array holding each value as it is (a list stays one element)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def config_file(path: Any, key: str) -> str | None:
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


def _routed_experts_at(experts: Any, start: int, total: int) -> torch.Tensor:
    """(1, total, layers, top_k) int16 zeros with `experts` (tokens, layers, top_k) from position `start` on."""
    if isinstance(experts, np.ndarray):
        experts = torch.from_numpy(experts if experts.flags.writeable else experts.copy())
    elif not isinstance(experts, torch.Tensor):
        raise TypeError(f"routed_experts must be a numpy array or a torch tensor, got {type(experts).__name__}")
    experts = experts.to(torch.int16)
    aligned = torch.zeros((1, total, *experts.shape[1:]), dtype=torch.int16)
    end = min(start + experts.shape[0], total)
    aligned[0, start:end] = experts[: end - start]
    return aligned


class AgentLoopWorker:
    """Runs a batch's agent-loop episodes and batches their outputs (see the module docstring)."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None, reward_loop_worker_handles: Any = None,
                 *, tokenizer: Any = None, hf_model_type: str | None = None):  # fmt: skip
        if teacher_client is not None or reward_loop_worker_handles is not None:
            raise NotImplementedError(
                "AgentLoopWorker: teacher clients (on-policy distillation) and reward-loop workers are not provided "
                "here; rows are scored by the trainer's reward function after rollout"
            )
        self.config, self.llm_client = config, llm_client
        self.teacher_client = self.reward_loop_worker_handles = None
        self.distillation_enabled = False
        self.rollout_config = config.actor_rollout_ref.rollout
        self.tokenizer = tokenizer if tokenizer is not None else hf_tokenizer(config.actor_rollout_ref.model.path)
        self.processor, self.hf_model_type, self.dataset_cls = None, hf_model_type, RLHFDataset
        self.mm_processor_kwargs = dict(config.data.get("mm_processor_kwargs", None) or {})
        multi_turn = self.rollout_config.get("multi_turn", None) or {}
        side = multi_turn.get("tool_response_truncate_side", "middle")
        if side not in TRUNCATE_SIDES:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={side!r} is not "
                             f"supported: verl's tool agent loop truncates at {list(TRUNCATE_SIDES)}")  # fmt: skip
        fmt = multi_turn.get("format", "hermes")
        try:
            ToolParser.get_tool_parser(fmt, self.tokenizer)
        except ValueError as err:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={fmt!r}: {err}") from None
        self.tools = load_all_tools(
            config_file(multi_turn.get("tool_config_path", None), "multi_turn.tool_config_path"),
            config_file(multi_turn.get("function_tool_path", None), "multi_turn.function_tool_path"),
        )
        agent = self.rollout_config.get("agent", None) or {}
        loops_file = config_file(agent.get("agent_loop_config_path", None), "agent.agent_loop_config_path")
        if loops_file:  # verl: a YAML list of {name, _target_, ...constructor arguments}
            for entry in OmegaConf.to_container(OmegaConf.load(loops_file), resolve=True):
                _agent_loop_registry[entry["name"]] = dict(entry)
        self.default_agent_loop = str(agent.get("default_agent_loop", None) or "single_turn_agent")
        if self.default_agent_loop not in _agent_loop_registry:
            raise ValueError(f"actor_rollout_ref.rollout.agent.default_agent_loop={self.default_agent_loop!r} is not a "
                             f"registered agent loop; registered: {sorted(_agent_loop_registry)}")  # fmt: skip

    def _get_mm_processor_kwargs(self, audio_data: Any = None) -> dict[str, Any]:
        return dict(self.mm_processor_kwargs or {})

    async def generate_sequences(self, batch: DataProto) -> DataProto:
        """Every row's episode (its non-tensor fields as the loop's keyword arguments), batched (module docstring)."""
        config, validate = self.rollout_config, bool(batch.meta_info.get("validate", False))
        sampling = config.val_kwargs if validate else config
        sampling_params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                           "repetition_penalty": 1.0, "logprobs": bool(config.get("calculate_log_probs", False))}  # fmt: skip
        columns = batch.non_tensor_batch
        if "agent_name" not in columns:
            columns["agent_name"] = object_column([self.default_agent_loop] * len(batch))
        index = columns["index"] if "index" in columns else np.arange(len(batch))
        trajectories = await get_trajectory_info(batch.meta_info.get("global_steps", -1), list(index), validate)
        do_sample = columns.get("__do_sample__")  # REMAX's per-row greedy baseline; not a loop argument
        episodes = []
        for i, trajectory in enumerate(trajectories):
            params = dict(sampling_params)
            if not validate and do_sample is not None and not bool(do_sample[i]):
                params.update(temperature=0, top_p=1.0, top_k=-1)
            fields = {key: values[i] for key, values in columns.items() if key != "__do_sample__"}
            episodes.append(self._run_agent_loop(params, trajectory, **fields))
        outputs = await asyncio.gather(*episodes)
        return self._postprocess(list(outputs), input_non_tensor_batch=columns, validate=validate)

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], *, agent_name: str,
                              trace: bool = True, **kwargs: Any) -> _InternalAgentLoopOutput:  # fmt: skip
        with agent_loop_api.rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                               rollout_n=trajectory["rollout_n"], validate=trajectory["validate"],
                                               name="agent_loop", trace=trace):  # fmt: skip
            loop = build_agent_loop(
                agent_name,
                trainer_config=DictConfigWrap(self.config),
                server_manager=self.llm_client,
                tokenizer=self.tokenizer,
                processor=self.processor,
                hf_model_type=self.hf_model_type,
                dataset_cls=self.dataset_cls,
                data_config=DictConfigWrap(self.config.data),
                tools=ToolListWrap(self.tools),
            )
            output = await loop.run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    def _pad_token_ids(self, tokens: list[int], *, max_length: int, padding_side: str,
                       return_attention_mask: bool) -> dict[str, torch.Tensor]:  # fmt: skip
        """`tokens` padded to a (1, max_length) `input_ids` (and `attention_mask`) by the tokenizer; an empty list is
        all the tokenizer's pad id (0 when it has none)."""
        if len(tokens) > max_length:
            raise ValueError(f"an agent loop returned {len(tokens)} token ids where at most {max_length} fit "
                             "(rollout.prompt_length / rollout.response_length)")  # fmt: skip
        if not tokens:
            pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            padded = {"input_ids": torch.full((1, max_length), pad_id, dtype=torch.long)}
            if return_attention_mask:
                padded["attention_mask"] = torch.zeros((1, max_length), dtype=torch.long)
            return padded
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, padding_side
        try:
            padded = self.tokenizer.pad({"input_ids": list(tokens)}, padding="max_length", max_length=max_length,
                                        return_tensors="pt", return_attention_mask=return_attention_mask)  # fmt: skip
        finally:
            self.tokenizer.padding_side = side
        return {key: value if value.dim() == 2 else value.unsqueeze(0) for key, value in padded.items()}

    async def _agent_loop_postprocess(self, output: AgentLoopOutput, validate: bool,
                                      **kwargs: Any) -> _InternalAgentLoopOutput:  # fmt: skip
        """One episode padded for the batch (see the module docstring)."""
        output.extra_fields["raw_prompt"] = kwargs["raw_prompt"]
        prompt_length, response_length = self.rollout_config.prompt_length, self.rollout_config.response_length
        prompt = self._pad_token_ids(output.prompt_ids, max_length=prompt_length, padding_side="left",
                                     return_attention_mask=True)  # fmt: skip
        response = self._pad_token_ids(output.response_ids, max_length=response_length, padding_side="right",
                                       return_attention_mask=True)  # fmt: skip
        mask = self._pad_token_ids(output.response_mask, max_length=response_length, padding_side="right",
                                   return_attention_mask=False)  # fmt: skip
        log_probs = output.response_logprobs
        if log_probs is not None:
            log_probs = torch.tensor(list(log_probs) + [0.0] * (response_length - len(log_probs))).unsqueeze(0)
        attention_mask = torch.cat([prompt["attention_mask"], response["attention_mask"]], dim=1)
        input_ids = torch.cat([prompt["input_ids"], response["input_ids"]], dim=1)
        routed_experts = None
        if output.routed_experts is not None:
            start = prompt["input_ids"].shape[1] - len(output.prompt_ids)
            routed_experts = _routed_experts_at(output.routed_experts, start, input_ids.shape[1])
        multi_modal_inputs = self._compute_multi_modal_inputs(output, input_ids)
        mm_kwargs = output.mm_processor_kwargs
        position_ids = self._compute_position_ids(input_ids, attention_mask, multi_modal_inputs,
                                                  self._get_mm_processor_kwargs() if mm_kwargs is None else mm_kwargs)  # fmt: skip
        await self._compute_score([output], kwargs=kwargs)
        await self._compute_teacher_logprobs(output, prompt_ids=output.prompt_ids, response_ids=output.response_ids,
                                             validate=validate, sample_kwargs=kwargs)  # fmt: skip
        return _InternalAgentLoopOutput(
            prompt_ids=prompt["input_ids"],
            response_ids=response["input_ids"],
            input_ids=input_ids,
            position_ids=position_ids,
            response_mask=mask["input_ids"] * response["attention_mask"],
            attention_mask=attention_mask,
            response_logprobs=log_probs,
            routed_experts=routed_experts,
            multi_modal_inputs=multi_modal_inputs,
            multi_modal_data=output.multi_modal_data,
            mm_processor_kwargs=output.mm_processor_kwargs,
            reward_score=output.reward_score,
            num_turns=output.num_turns,
            metrics=output.metrics,
            extra_fields=output.extra_fields,
        )

    def _compute_multi_modal_inputs(self, output: AgentLoopOutput, input_ids: torch.Tensor) -> dict[str, Any]:
        """verl runs the multi-modal processor over the episode here; text episodes give {}, others are refused."""
        if self.processor is not None or output.multi_modal_data:
            raise NotImplementedError(MULTI_MODAL_UNSUPPORTED.format(what="an episode's images, videos or audio"))
        return {}

    def _compute_position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              multi_modal_inputs: dict[str, Any], mm_processor_kwargs: Any = None) -> torch.Tensor:  # fmt: skip
        """Text position ids: the cumulative attention mask minus one, 0 on left padding (verl's M-RoPE ids of a
        multi-modal processor are not provided)."""
        return compute_position_id_with_mask(attention_mask)

    async def _compute_score(self, outputs: list[AgentLoopOutput], kwargs: dict) -> None:
        """verl scores the episode here through its reward-loop workers, which are not provided (the constructor
        refuses them): the trainer's reward function scores the rows, and a loop's own `reward_score` is kept."""
        if self.reward_loop_worker_handles is not None:
            raise NotImplementedError("AgentLoopWorker: reward-loop workers are not provided here")

    async def _compute_teacher_logprobs(self, output: AgentLoopOutput, prompt_ids: list[int], response_ids: list[int],
                                        validate: bool, sample_kwargs: dict | None = None) -> None:  # fmt: skip
        """verl asks its teacher servers here under on-policy distillation, which is not provided."""
        if self.distillation_enabled and not validate:
            raise NotImplementedError("AgentLoopWorker: teacher log-probs (on-policy distillation) are not provided")

    def _postprocess(self, inputs: list[_InternalAgentLoopOutput], input_non_tensor_batch: dict | None = None,
                     validate: bool = False) -> DataProto:  # fmt: skip
        """The padded episodes as one `DataProto` (see the module docstring)."""

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(item, name) for item in inputs], dim=0)

        tensors = {"prompts": cat("prompt_ids"), "responses": cat("response_ids"), "response_mask": cat("response_mask"),
                   "input_ids": cat("input_ids"), "attention_mask": cat("attention_mask"),
                   "position_ids": cat("position_ids")}  # fmt: skip
        first = inputs[0]
        if first.response_logprobs is not None:
            tensors["rollout_log_probs"] = cat("response_logprobs")
        if first.routed_experts is not None:
            tensors["routed_experts"] = cat("routed_experts")
        if first.teacher_logprobs is not None and first.teacher_ids is not None:
            tensors.update(teacher_logprobs=cat("teacher_logprobs"), teacher_ids=cat("teacher_ids"))
        scores = [item.reward_score for item in inputs]
        if all(score is not None for score in scores):
            last = tensors["attention_mask"][:, tensors["prompts"].shape[1] :].sum(dim=1) - 1
            rm_scores = torch.zeros(tensors["response_mask"].shape, dtype=torch.float32)
            rm_scores[torch.arange(len(inputs)), last] = torch.tensor(scores, dtype=torch.float32)
            tensors["rm_scores"] = rm_scores

        non_tensors = {"__num_turns__": np.array([item.num_turns for item in inputs], dtype=np.int32)}
        if self.reward_loop_worker_handles is None and input_non_tensor_batch:
            non_tensors.update(input_non_tensor_batch)
        reward_infos = [item.extra_fields.get("reward_extra_info", {}) for item in inputs]
        reward_extra_keys = list(reward_infos[0])
        for key in reward_extra_keys:
            non_tensors[key] = np.array([info[key] for info in reward_infos])
        if any(item.multi_modal_inputs is not None for item in inputs):
            non_tensors["multi_modal_inputs"] = object_column([item.multi_modal_inputs for item in inputs])
        for key in {key for item in inputs for key in item.extra_fields} | set(STABLE_EXTRA_FIELDS):
            non_tensors[key] = object_column([item.extra_fields.get(key) for item in inputs])

        meta_info: dict[str, Any] = {"metrics": [item.metrics.model_dump() for item in inputs]}
        if "rm_scores" in tensors:  # the keys travel with the scores (the trainer merges them with its own)
            meta_info["reward_extra_keys"] = reward_extra_keys
        batch = TensorDict(tensors, batch_size=len(inputs))
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)
