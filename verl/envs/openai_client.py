"""An in-process OpenAI-compatible client over a rollout engine, recording what training needs.

`OpenAIClient` answers `chat.completions.create` / `completions.create` (the `openai.AsyncOpenAI` call shapes)
with an engine's `agenerate`; responses have openai's attributes plus `prompt_token_ids` and per choice
`token_ids`. Unset sampling knobs take the trainer's rollout settings; an unknown argument is an error. With
`record=True` each choice becomes a `CompletionRecord`; chat prompts that extend an earlier request and its answer
are tokenised incrementally, so `trajectory()` yields one token sequence with a loss mask on the model's tokens.
Layer 5: must not import Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from verl.envs.tools import parse_tool_calls
from verl.workers.rollout.async_engine import GenerationHyperparameters, ModelRequest, ModelResponse

__all__ = ["CompletionRecord", "OpenAIClient", "Trajectory"]

_UNSUPPORTED_IF_SET = ("frequency_penalty", "presence_penalty", "logit_bias", "top_logprobs")
_IGNORED = ("seed", "user", "tool_choice", "parallel_tool_calls", "metadata", "store", "service_tier", "timeout")


# ----------------------------------------------------------------------------------------------- response objects
class _Obj:
    def model_dump(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Usage(_Obj):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletionMessage(_Obj):
    content: str
    role: str = "assistant"
    tool_calls: list[dict] | None = None


@dataclass
class ChatChoice(_Obj):
    index: int
    message: ChatCompletionMessage
    finish_reason: str
    logprobs: dict | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class ChatCompletion(_Obj):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]
    created: int = field(default_factory=lambda: int(time.time()))
    object: str = "chat.completion"


@dataclass
class CompletionChoice(_Obj):
    index: int
    text: str
    finish_reason: str
    logprobs: dict | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Completion(_Obj):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int]
    created: int = field(default_factory=lambda: int(time.time()))
    object: str = "text_completion"


# ----------------------------------------------------------------------------------------------- records
@dataclass
class CompletionRecord:
    """One recorded completion. `parent` is the record this chat prompt extends (its prompt ids start with
    the parent's prompt + completion ids), or None."""

    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    content: str
    messages: list[dict] | None = None
    prompt_text: str | None = None
    parent: int | None = None


@dataclass
class Trajectory:
    """A token sequence for training: `prompt_ids`, then `response_ids` with `loss_mask` 1 on the model's
    tokens and 0 on the tokens between its turns; `logprobs`/`versions` per response token (0.0 / -1 on the
    tokens between turns)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    num_completions: int


# ----------------------------------------------------------------------------------------------- the client
class _Namespace:
    def __init__(self, **items: Any):
        self.__dict__.update(items)


class OpenAIClient:
    """OpenAI-shaped async client over `engine` (see the module docstring).

    engine: an `AsyncRolloutEngine` (what workflows get) or a `BaseRollout`.
    tokenizer: the policy's tokenizer with a chat template (default: the engine's).
    model: the name reported in responses (any `model=` argument is accepted).
    """

    def __init__(self, engine: Any, tokenizer: Any = None, model: str = "verl-policy", record: bool = True):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("OpenAIClient needs a tokenizer (the engine has none)")
        self.model = model
        self.record = record
        self.records: list[CompletionRecord] = []
        self.chat = _Namespace(completions=_Namespace(create=self._create_chat))
        self.completions = _Namespace(create=self._create_completion)

    # ------------------------------------------------------------------ sampling arguments
    def _default_gconfig(self) -> GenerationHyperparameters:
        if hasattr(self.engine, "default_gconfig"):
            return self.engine.default_gconfig()
        from verl.workers.rollout.async_engine import get_async_engine

        return get_async_engine(self.engine).default_gconfig()

    def _gconfig(self, kwargs: dict) -> tuple[GenerationHyperparameters, int, bool]:
        """(gconfig, n, want logprobs) from OpenAI sampling arguments; ValueError/TypeError on bad ones."""
        kwargs = dict(kwargs)
        extra = kwargs.pop("extra_body", None) or {}
        kwargs.update({k: v for k, v in extra.items() if k not in kwargs})
        for key in _IGNORED:
            kwargs.pop(key, None)
        if kwargs.pop("stream", False):
            raise ValueError("stream=True is not supported by this server/client; use stream=False")
        for key in _UNSUPPORTED_IF_SET:
            value = kwargs.pop(key, None)
            if value:
                raise ValueError(f"{key}={value!r} is not supported (allowed: unset, 0 or null)")
        g = self._default_gconfig()
        changes: dict[str, Any] = {}
        temperature = kwargs.pop("temperature", None)
        if temperature is not None:
            if float(temperature) < 0:
                raise ValueError(f"temperature must be >= 0, got {temperature}")
            if float(temperature) == 0:
                changes["greedy"] = True
            else:
                changes.update(greedy=False, temperature=float(temperature))
        for key, cast in (("top_p", float), ("top_k", int)):
            value = kwargs.pop(key, None)
            if value is not None:
                changes[key] = cast(value)
        max_completion_tokens, max_tokens = kwargs.pop("max_completion_tokens", None), kwargs.pop("max_tokens", None)
        max_tokens = max_tokens if max_completion_tokens is None else max_completion_tokens
        if max_tokens is not None:
            changes["max_new_tokens"] = int(max_tokens)
        stop = kwargs.pop("stop", None)
        if stop:
            changes["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        n = kwargs.pop("n", None)
        n = 1 if n is None else int(n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        logprobs = bool(kwargs.pop("logprobs", False))
        if kwargs:
            raise TypeError(f"unsupported arguments {sorted(kwargs)}")
        return g.new(**changes), n, logprobs

    # ------------------------------------------------------------------ tokenisation
    def _render(self, messages: list[dict], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_prompt(self, messages: list[dict], tools: list | None) -> tuple[list[int], str, int | None]:
        """(prompt ids, rendered text, parent record index): reuse the ids of the conversation it extends."""
        text = self._render(messages, tools)
        for index in range(len(self.records) - 1, -1, -1):
            rec = self.records[index]
            if (
                rec.messages is None
                or len(messages) <= len(rec.messages)
                or messages[: len(rec.messages)] != rec.messages
            ):
                continue
            answer = messages[len(rec.messages)]
            if answer.get("role") != "assistant" or answer.get("content") != rec.content:
                continue
            prefix = rec.prompt_text + self.tokenizer.decode(rec.completion_ids, skip_special_tokens=False)
            if text.startswith(prefix):
                return rec.prompt_ids + rec.completion_ids + self._encode(text[len(prefix) :]), text, index
        return self._encode(text), text, None

    # ------------------------------------------------------------------ generation
    async def _generate(self, prompt_ids: list[int], g: GenerationHyperparameters, n: int) -> list[ModelResponse]:
        rid = uuid.uuid4().hex
        requests = [ModelRequest(list(prompt_ids), g.new(n_samples=1), f"{rid}-{i}") for i in range(n)]
        return list(await asyncio.gather(*(self.engine.agenerate(r) for r in requests)))

    def _content(self, resp: ModelResponse) -> str:
        ids = resp.output_tokens
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _save(self, resp: ModelResponse, content: str, messages=None, prompt_text=None, parent=None) -> str:
        rec_id = f"cmpl-{uuid.uuid4().hex[:16]}"
        if self.record:
            self.records.append(
                CompletionRecord(rec_id, list(resp.input_tokens), list(resp.output_tokens), list(resp.output_logprobs),
                                 list(resp.output_versions), resp.stop_reason, content, messages, prompt_text, parent)
            )  # fmt: skip
        return rec_id

    def _token_logprobs(self, resp: ModelResponse) -> list[dict]:
        return [
            {"token": self.tokenizer.decode([t], skip_special_tokens=False), "logprob": lp, "bytes": None,
             "top_logprobs": []}
            for t, lp in zip(resp.output_tokens, resp.output_logprobs)
        ]  # fmt: skip

    async def _create_chat(self, *, messages: list[dict], model: str | None = None, tools: list | None = None,
                           **sampling_args: Any) -> ChatCompletion:  # fmt: skip
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        g, n, want_logprobs = self._gconfig(sampling_args)
        messages = [dict(m) for m in messages]
        prompt_ids, text, parent = self._chat_prompt(messages, tools)
        responses = await self._generate(prompt_ids, g, n)
        choices = []
        for i, resp in enumerate(responses):
            content = self._content(resp)
            calls = [c for c in parse_tool_calls(content) if c.error is None] if tools else []
            tool_calls = [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls
            ] or None  # fmt: skip
            self._save(resp, content, messages, text, parent)
            finish = "tool_calls" if tool_calls else resp.stop_reason
            choices.append(ChatChoice(i, ChatCompletionMessage(content, tool_calls=tool_calls), finish,
                                      {"content": self._token_logprobs(resp)} if want_logprobs else None,
                                      list(resp.output_tokens)))  # fmt: skip
        return ChatCompletion(f"chatcmpl-{uuid.uuid4().hex[:16]}", model or self.model, choices,
                              _usage(prompt_ids, responses), list(prompt_ids))  # fmt: skip

    async def _create_completion(self, *, prompt: Any, model: str | None = None, echo: bool = False,
                                 **sampling_args: Any) -> Completion:  # fmt: skip
        if echo:
            raise ValueError("echo=True is not supported")
        logprobs_arg = sampling_args.pop("logprobs", None)
        g, n, _ = self._gconfig(sampling_args)
        prompts = _prompt_list(prompt)
        choices, usage_prompt, all_responses = [], [], []
        for p_index, p in enumerate(prompts):
            prompt_ids = self._encode(p) if isinstance(p, str) else list(p)
            responses = await self._generate(prompt_ids, g, n)
            for j, resp in enumerate(responses):
                text = self._content(resp)
                self._save(resp, text)
                logprobs = None
                if logprobs_arg is not None and logprobs_arg is not False:
                    logprobs = {"tokens": [e["token"] for e in self._token_logprobs(resp)],
                                "token_logprobs": list(resp.output_logprobs), "top_logprobs": None,
                                "text_offset": None}  # fmt: skip
                choices.append(CompletionChoice(p_index * n + j, text, resp.stop_reason, logprobs,
                                                list(resp.output_tokens)))  # fmt: skip
            usage_prompt += prompt_ids
            all_responses += responses
        return Completion(f"cmpl-{uuid.uuid4().hex[:16]}", model or self.model, choices,
                          _usage(usage_prompt, all_responses), usage_prompt if len(prompts) == 1 else [])  # fmt: skip

    # ------------------------------------------------------------------ training data
    def trajectory(self, index: int = -1) -> Trajectory | None:
        """The token sequence ending with record `index` (default: the last): its chain of chat turns joined
        on the token level. None when nothing was recorded."""
        if not self.records:
            return None
        chain = []
        i: int | None = range(len(self.records))[index]
        while i is not None:
            chain.append(self.records[i])
            i = self.records[i].parent
        chain.reverse()
        first = chain[0]
        response, mask, logprobs, versions = [], [], [], []
        done = len(first.prompt_ids)
        for rec in chain:
            between = rec.prompt_ids[done:]
            response += between + rec.completion_ids
            mask += [0] * len(between) + [1] * len(rec.completion_ids)
            logprobs += [0.0] * len(between) + rec.logprobs
            versions += [-1] * len(between) + rec.versions
            done = len(rec.prompt_ids) + len(rec.completion_ids)
        return Trajectory(list(first.prompt_ids), response, mask, logprobs, versions, len(chain))


def _usage(prompt_ids: list[int], responses: list[ModelResponse]) -> Usage:
    completion = sum(r.output_len for r in responses)
    return Usage(len(prompt_ids), completion, len(prompt_ids) + completion)


def _prompt_list(prompt: Any) -> list:
    """A prompt as a list of prompts: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise ValueError("prompt must be a string, a list of token ids, or a list of strings / token-id lists")
