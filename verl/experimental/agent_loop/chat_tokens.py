"""The token stream of a multi-turn agent loop, built with the tokenizer's chat template (verl's "Continuous
Token" builder, the text-only part of it).

Owns `ChatTokenBuilder` and `MergeResult`. An agent loop keeps one runtime token list (prompt, then every turn)
and never re-tokenises what the model wrote:
- `initial_tokens(messages, tools)`: the chat template over the dataset's messages with the generation prompt;
- `merge_assistant(runtime_ids, assistant_ids)`: the model's tokens appended as they are;
- `merge_context(previous_messages, updated_messages, runtime_ids, tools)`: the messages appended since
  (tool results, user or system turns) as the template's delta: each group is rendered after a fixed synthetic
  prefix (system, user, and for tool results an assistant turn calling that many tools) with and without the
  group, and the suffix of the longer rendering is the group's tokens; the last group also carries the
  generation prompt. Before them, the tokens the template writes after an ended turn but the model did not
  generate are inserted: when the runtime stream ends with the template's end-of-turn token (for ChatML,
  `<|im_end|>`), the rest of the template's turn ending (`\n`) follows it.

For ChatML templates (Qwen2, Qwen2.5, Qwen3, the embedded tiny model) this gives verl's ids; verl's
model-specific boundary rules for GLM, gpt-oss, DeepSeek and Gemma 4 are not reproduced, and multi-modal
content is refused by the agent loops before it gets here.

Layer 1 (utilities): standard library only; the tokenizer is duck-typed (`apply_chat_template`,
`all_special_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatTokenBuilder", "MergeResult"]

SYNTHETIC_SYSTEM = {"role": "system", "content": "synthetic system message"}
SYNTHETIC_USER = {"role": "user", "content": "synthetic user message"}
SYNTHETIC_ANSWER = {"role": "assistant", "content": "synthetic answer"}
APPENDABLE_ROLES = ("tool", "user", "system")


@dataclass(frozen=True)
class MergeResult:
    """The runtime token list after a merge: `token_ids`; `appended_token_count` new tokens at its end
    (model tokens for kind "assistant", template tokens for kind "context"), preceded by `inserted_token_ids`
    (turn-ending tokens the template writes but the model did not generate)."""

    token_ids: list[int]
    appended_token_count: int
    kind: str = "context"
    inserted_token_ids: list[int] = field(default_factory=list)


def token_ids_of(rendered: Any) -> list[int]:
    """The flat id list of what `apply_chat_template(..., tokenize=True)` returned (a list, a batch of one, a
    BatchEncoding or dict with `input_ids`, or a tensor)."""
    if hasattr(rendered, "keys") and "input_ids" in rendered.keys():
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    rendered = list(rendered)
    if rendered and isinstance(rendered[0], (list, tuple)):
        if len(rendered) != 1:
            raise ValueError(f"the chat template rendered a batch of {len(rendered)} sequences; expected one")
        rendered = list(rendered[0])
    return [int(t) for t in rendered]


class ChatTokenBuilder:
    """See the module docstring. `chat_template_kwargs` (verl's `data.apply_chat_template_kwargs`, e.g.
    `enable_thinking`) go to every `apply_chat_template` call."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._turn_ending: list[int] | None = None  # computed on first use

    def render(self, messages: list[dict], *, add_generation_prompt: bool, tools: list | None = None) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **self.chat_template_kwargs,
        )
        return token_ids_of(rendered)

    def initial_tokens(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def merge_assistant(self, runtime_ids: list[int], assistant_ids: list[int]) -> MergeResult:
        return MergeResult(list(runtime_ids) + list(assistant_ids), len(assistant_ids), kind="assistant")

    def merge_context(
        self,
        previous_messages: list[dict],
        updated_messages: list[dict],
        runtime_ids: list[int],
        tools: list | None = None,
    ) -> MergeResult:
        if updated_messages[: len(previous_messages)] != list(previous_messages):
            raise ValueError("agent-loop messages must only be appended to: an earlier message changed")
        groups = _groups(updated_messages[len(previous_messages) :])
        appended: list[int] = []
        for i, group in enumerate(groups):
            appended += self._group_tokens(group, add_generation_prompt=i == len(groups) - 1, tools=tools)
        inserted = self._turn_ending_rest(runtime_ids) if groups else []
        return MergeResult(list(runtime_ids) + inserted + appended, len(appended), "context", inserted)

    # ------------------------------------------------------------------ template deltas
    def _group_tokens(self, group: list[dict], *, add_generation_prompt: bool, tools: list | None) -> list[int]:
        if group[0].get("role") == "tool":
            prefix = [SYNTHETIC_SYSTEM, SYNTHETIC_USER, _assistant_calling(group)]
        else:
            prefix = [SYNTHETIC_SYSTEM, SYNTHETIC_USER]
        short = self.render(prefix, add_generation_prompt=False, tools=tools)
        full = self.render(prefix + group, add_generation_prompt=add_generation_prompt, tools=tools)
        if full[: len(short)] != short:
            roles = [m.get("role") for m in group]
            raise ValueError(
                f"the chat template renders the conversation before appended {roles} messages differently once they "
                "are added, so their tokens cannot be appended to the running token stream"
            )
        return full[len(short) :]

    def _turn_ending_rest(self, runtime_ids: list[int]) -> list[int]:
        """The template's turn-ending tokens after the last one of `runtime_ids`, when the stream ends with the
        template's end-of-turn token (e.g. `\\n` after `<|im_end|>`); else nothing."""
        if self._turn_ending is None:
            self._turn_ending = self._template_turn_ending()
        ending = self._turn_ending
        if len(ending) > 1 and runtime_ids and runtime_ids[-1] == ending[0]:
            return list(ending[1:])
        return []

    def _template_turn_ending(self) -> list[int]:
        """What the template writes from an assistant turn's last special token on (ChatML: `<|im_end|>\\n`)."""
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        try:
            ids = self.render([SYNTHETIC_USER, SYNTHETIC_ANSWER], add_generation_prompt=False)
        except Exception:  # a template that cannot render this conversation: no turn ending is inserted
            return []
        positions = [i for i, t in enumerate(ids) if t in special]
        return ids[positions[-1] :] if positions else []


def _groups(messages: list[dict]) -> list[list[dict]]:
    """Consecutive tool messages form one group (rendered together); any other message is a group alone."""
    groups: list[list[dict]] = []
    for message in messages:
        role = message.get("role")
        if role not in APPENDABLE_ROLES:
            raise ValueError(f"an agent loop may append {list(APPENDABLE_ROLES)} messages to its context, got {role!r}")
        if role == "tool" and groups and groups[-1][0].get("role") == "tool":
            groups[-1].append(message)
        else:
            groups.append([message])
    return groups


def _assistant_calling(tool_messages: list[dict]) -> dict:
    """A synthetic assistant turn calling one tool per tool message (templates want the call before the result)."""
    calls = [
        {
            "id": message.get("tool_call_id") or f"call_{i}",
            "type": "function",
            "function": {"name": message.get("name") or "tool", "arguments": {}},
        }
        for i, message in enumerate(tool_messages)
    ]
    return {"role": "assistant", "content": "", "tool_calls": calls}
