"""verl 0.9.1's agent-loop API (`verl.experimental.agent_loop.agent_loop`): the base class of agent loops, their
registry, and what a loop returns.

Owns:
- `AgentLoopBase(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)`:
  subclass it and implement `async run(sampling_params, **kwargs) -> AgentLoopOutput` (kwargs: the sample's
  dataset fields, `raw_prompt`, `tools_kwargs`, `extra_info`, ...). `trainer_config` and `data_config` come
  wrapped in `DictConfigWrap`; `self.rollout_config` is `actor_rollout_ref.rollout`. The loop talks to the model
  through `await self.server_manager.generate(request_id=..., prompt_ids=..., sampling_params=...)`, which
  returns a `verl.workers.rollout.replica.TokenOutput`, and builds its token stream with the `ct_*` helpers
  (`chat_tokens.ChatTokenBuilder`: the chat template and its deltas, no re-tokenisation of model output);
- `register(name)` and `_agent_loop_registry` (name -> `{"_target_": "module.Class", ...kwargs}`, as verl keeps
  it); `build_agent_loop(name, **kwargs)` constructs one: a class `@register` made directly, any other entry (an
  `agent_loop_config_path` YAML's) with `hydra.utils.instantiate` as verl does;
- `AgentLoopOutput` / `AgentLoopMetrics` (verl's fields), `_InternalAgentLoopOutput` (one episode padded to the
  rollout's widths, as tensors), `DictConfigWrap`, `ToolListWrap`, `get_trajectory_info`, and
  `rollout_trace_attr` (verl's per-episode trace context: here a DEBUG log line of the episode and its seconds);
- `AgentLoopWorker` (verl's worker turning a batch into episodes and their outputs into a batch), re-exported
  from `agent_loop_worker` on first use so that this module stays free of the data protocol.

Loops run inside each rollout worker, one per sample, through the `agent_loop` rollout workflow
(`verl.workers.rollout.workflows.agent_loop`), which runs each row through an `AgentLoopWorker` over a server
manager on the rank's engine. verl's Ray `AgentLoopManager`, trace backends, reward-loop workers, teacher
log-probs (distillation) and multi-modal inputs are not provided: a loop given images, videos or audio stops with
a NotImplementedError naming them.

Layer 1 (utilities): the standard library, pydantic, torch, hydra and `chat_tokens`; never Ray or an engine (the
server manager is passed in).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hydra
import torch
from pydantic import BaseModel, ConfigDict

from verl.experimental.agent_loop.chat_tokens import ChatTokenBuilder, MergeResult

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = [
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "DictConfigWrap",
    "ToolListWrap",
    "build_agent_loop",
    "get_trajectory_info",
    "register",
    "rollout_trace_attr",
    "timed",
]

MULTI_MODAL_UNSUPPORTED = (
    "multi-modal agent-loop inputs ({what}) are not supported here: text prompts and text tool responses only"
)


class AgentLoopMetrics(BaseModel):
    """Seconds spent generating and calling tools in one episode, and preemptions (-1: not known)."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    """One episode. `response_ids` holds the model's tokens and the tokens inserted between its turns (tool
    results); `response_mask` is 1 on the model's tokens and 0 on the inserted ones (the loss mask);
    `response_logprobs` one per response token (0.0 on inserted ones) or None; `reward_score` a score the loop
    computed itself (then the trainer's reward function is not asked, when every sample has one); `num_turns`
    counts the chat turns (user, assistant and tool); `extra_fields` anything else (verl's loops put
    `turn_scores` and `tool_rewards` there)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_output: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as verl's tensor names: `prompts`, `responses`, `response_mask` (int64), `rollout_log_probs`
        (float32), `rm_scores` (the reward score at the last response token) and `extra_fields` (with
        `teacher_ids` / `teacher_logprobs` moved out of it to the top level)."""
        out = self.model_dump(exclude_unset=True)
        out["prompts"] = torch.tensor(out.pop("prompt_ids"), dtype=torch.int64)
        out["responses"] = torch.tensor(out.pop("response_ids"), dtype=torch.int64)
        out["response_mask"] = torch.tensor(out.pop("response_mask"), dtype=torch.int64)
        log_probs = out.pop("response_logprobs", None)
        if log_probs is not None:
            out["rollout_log_probs"] = torch.tensor(log_probs, dtype=torch.float32)
        score = out.pop("reward_score", None)
        if score is not None:
            rm_scores = torch.zeros(out["response_mask"].shape, dtype=torch.float32)
            rm_scores[-1] = score
            out["rm_scores"] = rm_scores
        extra = dict(self.extra_fields)  # a mutated default dict is not in model_dump(exclude_unset=True)
        for key in ("teacher_ids", "teacher_logprobs"):
            if key in extra:
                out[key] = extra.pop(key)
        out["extra_fields"] = extra
        return out


class _InternalAgentLoopOutput(AgentLoopOutput):
    """One episode padded for the batch, each tensor with a leading batch dimension of 1: `prompt_ids` left-padded
    to `rollout.prompt_length`, `response_ids` / `response_mask` / `response_logprobs` right-padded to
    `rollout.response_length`, `input_ids` / `attention_mask` / `position_ids` / `routed_experts` over both."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor
    response_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    multi_modal_inputs: dict[str, torch.Tensor] | None = None
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    """A config handed to an agent loop, wrapped (verl: so hydra.utils.instantiate does not resolve it)."""

    def __init__(self, config: Any):
        self.config = config


class ToolListWrap:
    """The tool list handed to an agent loop, wrapped (verl: so hydra does not turn the tools into configs)."""

    def __init__(self, tools: list):
        self.tools = tools


@contextmanager
def timed(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time in seconds to `metrics[name]` (verl's `simple_timer`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[name] = metrics.get(name, 0.0) + time.perf_counter() - start


@contextmanager
def rollout_trace_attr(sample_index: Any = None, step: Any = None, rollout_n: Any = None, name: str = "rollout_trace",
                       validate: bool = False, trace: bool = True) -> Iterator[None]:  # fmt: skip
    """verl tags one episode's trace with these attributes (weave / mlflow backends, not provided here); here, when
    `trace`, the episode ends with a DEBUG log line of them and its seconds."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if trace:
            logger.debug("%s step=%s sample_index=%s rollout_n=%s validate=%s: %.3f s", name, step, sample_index,
                         rollout_n, validate, time.perf_counter() - start)  # fmt: skip


def _has_media(messages: list[dict]) -> bool:
    """Whether any message's content is a list with a part that is not text (an image, video or audio part)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)):
            if any(isinstance(part, dict) and part.get("type", "text") != "text" for part in content):
                return True
    return False


class AgentLoopBase(ABC):
    """An agent loop: takes one sample's chat, talks to the model through `server_manager` and to its
    environment (tools), and returns an `AgentLoopOutput` (see the module docstring for the arguments)."""

    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: type,
        data_config: DictConfigWrap,
        hf_model_type: str | None = None,
        **kwargs: Any,
    ):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config
        self.hf_model_type = hf_model_type
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs", None) or {})
        self.mm_processor_kwargs = dict(self.data_config.get("mm_processor_kwargs", None) or {})
        self.continuous_token_builder = ChatTokenBuilder(tokenizer, self.apply_chat_template_kwargs)

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode. sampling_params: the server's sampling knobs (temperature, top_p, top_k, logprobs, ...);
        kwargs: the sample's dataset fields."""
        raise NotImplementedError

    # ------------------------------------------------------------------ multi-modal (refused)
    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        if has_multi_modal:
            raise NotImplementedError(MULTI_MODAL_UNSUPPORTED.format(what="images, videos or audio"))

    def _get_mm_processor_kwargs(self, audio_data: Any = None) -> dict[str, Any]:
        return dict(self.mm_processor_kwargs)

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        """verl extracts images, videos and audio here; text chats give {} and anything else is refused."""
        if _has_media(messages):
            raise NotImplementedError(MULTI_MODAL_UNSUPPORTED.format(what="image/video/audio parts in the prompt"))
        return {}

    async def process_vision_info(self, messages: list[dict]) -> dict:
        return await self.process_multi_modal_info(messages)

    # ------------------------------------------------------------------ the token stream
    async def ct_build_initial_tokens(self, messages: list[dict], tools: list | None = None, images: Any = None,
                                      videos: Any = None, audios: Any = None, mm_inputs_out: Any = None) -> list[int]:  # fmt: skip
        """The prompt's token ids (chat template with the generation prompt), cut on the left to
        `rollout.prompt_length` as verl does."""
        self._assert_mm_supported(bool(images or videos or audios))
        ids = self.continuous_token_builder.initial_tokens(messages, tools=tools)
        return self._cap_text_prompt_length(ids)

    async def ct_merge_context_msg(
        self,
        previous_messages: list[dict],
        updated_messages: list[dict],
        runtime_token_ids: list[int],
        response_mask: list[int],
        response_logprobs: list[float] | None = None,
        tools: list | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append the messages added since `previous_messages` (tool results): mask and log-prob 0 on them."""
        merged = self.continuous_token_builder.merge_context(previous_messages, updated_messages, runtime_token_ids,
                                                             tools=tools)  # fmt: skip
        added = len(merged.inserted_token_ids) + merged.appended_token_count
        mask = list(response_mask) + [0] * added
        log_probs = None if response_logprobs is None else list(response_logprobs) + [0.0] * added
        return merged, mask, log_probs

    async def ct_merge_assistant_token(
        self,
        runtime_token_ids: list[int],
        assistant_token_ids: list[int],
        response_mask: list[int],
        response_logprobs: list[float] | None = None,
        assistant_logprobs: list[float] | None = None,
    ) -> tuple[MergeResult, list[int], list[float] | None]:
        """Append the model's tokens: mask 1 and their log-probs (required when `response_logprobs` is kept)."""
        merged = self.continuous_token_builder.merge_assistant(runtime_token_ids, assistant_token_ids)
        mask = list(response_mask) + [1] * merged.appended_token_count
        if response_logprobs is None:
            if assistant_logprobs is not None:
                raise ValueError("ct_merge_assistant_token: assistant_logprobs given without response_logprobs")
            return merged, mask, None
        assistant_logprobs = list(assistant_logprobs or [])
        if len(assistant_logprobs) != merged.appended_token_count:
            raise ValueError(
                f"ct_merge_assistant_token: {len(assistant_logprobs)} log-probs for "
                f"{merged.appended_token_count} assistant tokens"
            )
        return merged, mask, list(response_logprobs) + assistant_logprobs

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        limit = int(self.rollout_config.prompt_length)
        if len(prompt_ids) > limit:
            logger.warning("prompt of %d tokens exceeds rollout.prompt_length=%d; cut on the left", len(prompt_ids),
                           limit)  # fmt: skip
            return prompt_ids[-limit:]
        return prompt_ids


# ---------------------------------------------------------------------------------------------- registry
_agent_loop_registry: dict[str, dict] = {}
_registered_classes: dict[str, type] = {}  # "module.Class" -> class, also those a module import cannot reach


def register(agent_name: str):
    """Class decorator: make an `AgentLoopBase` subclass the loop of rows whose `agent_name` is `agent_name`."""

    def decorator(subclass: type[AgentLoopBase]) -> type[AgentLoopBase]:
        target = f"{subclass.__module__}.{subclass.__qualname__}"
        _agent_loop_registry[agent_name] = {"_target_": target}
        _registered_classes[target] = subclass
        return subclass

    return decorator


def build_agent_loop(agent_name: str, **kwargs: Any) -> AgentLoopBase:
    """The loop registered as `agent_name`, constructed with its registry entry's keyword arguments plus `kwargs`:
    a `@register`ed class directly, another entry by `hydra.utils.instantiate(config=entry, **kwargs)` (verl's way,
    which imports its `_target_`). The package's import registered the built-in loops."""
    if agent_name not in _agent_loop_registry:
        raise ValueError(
            f"agent loop {agent_name!r} is not registered; registered: {sorted(_agent_loop_registry)} (register a "
            "class with @verl.experimental.agent_loop.register(name), or list it in "
            "actor_rollout_ref.rollout.agent.agent_loop_config_path)"
        )
    entry = {key: value for key, value in _agent_loop_registry[agent_name].items() if key != "name"}
    target = entry.get("_target_")
    if not target:
        raise ValueError(f"agent loop {agent_name!r}: its registry entry has no _target_ class path")
    if target in _registered_classes:
        entry.pop("_target_")
        return _registered_classes[target](**entry, **kwargs)
    return hydra.utils.instantiate(config=entry, **kwargs)


async def get_trajectory_info(step: int, index: list, validate: bool) -> list[dict[str, Any]]:
    """Per sample: the step, its dataset index, which of the index's consecutive repeats it is, and `validate`."""
    info, repeat = [], 0
    for i, sample_index in enumerate(index):
        repeat = repeat + 1 if i > 0 and index[i - 1] == sample_index else 0
        info.append({"step": step, "sample_index": sample_index, "rollout_n": repeat, "validate": validate})
    return info


def __getattr__(name: str) -> Any:
    if name == "AgentLoopWorker":  # imported on first use: it needs the data protocol, which this module does not
        from verl.experimental.agent_loop.agent_loop_worker import AgentLoopWorker

        return AgentLoopWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
