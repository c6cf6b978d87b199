"""verifiers-style environments: `Environment.rollout(client, prompt, answer, sampling_args)` and a `Rubric`.

`Rubric(funcs, weights)`: reward = sum_i w_i * f_i(...), each function given the arguments it names among
`prompt`, `completion`, `answer`, `state`, `info`. `Environment` talks to the model only through an OpenAI-shaped
client; `SingleTurnEnv`, `MultiTurnEnv` (`env_response` until `is_completed` or `max_turns`) and `ToolEnv`
(`<tool_call>` blocks run with `verl.envs.tools`). The `environment` workflow records the in-process client's
`trajectory()` as the training row. Layer 5: must not import Ray, torch or the trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl.envs.tools import DEFAULT_REGISTRY, ToolRegistry, format_observations, parse_tool_calls, run_tool_calls

__all__ = ["Environment", "EnvResult", "MultiTurnEnv", "Rubric", "SingleTurnEnv", "ToolEnv"]

Messages = list[dict]
_RUBRIC_ARGS = ("prompt", "completion", "answer", "state", "info")


class Rubric:
    """Weighted reward functions (verifiers' `Rubric`). weights default to 1.0 each."""

    def __init__(self, funcs: list[Callable], weights: list[float] | None = None):
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"Rubric got {len(funcs)} functions and {len(weights)} weights; give one weight each")
        for fn in funcs:
            if not callable(fn):
                raise TypeError(f"Rubric functions must be callable, got {fn!r}")
            names = set(inspect.signature(fn).parameters)
            if not names & set(_RUBRIC_ARGS) and not _takes_kwargs(fn):
                raise TypeError(f"reward function {fn.__name__} takes none of {_RUBRIC_ARGS}")
        self.funcs, self.weights = list(funcs), [float(w) for w in weights]

    async def score(
        self, prompt: Messages, completion: Messages, answer: Any, state: dict, info: dict | None = None
    ) -> tuple[float, dict[str, float]]:
        """(weighted reward, {function name: its value})."""
        available = {"prompt": prompt, "completion": completion, "answer": answer, "state": state, "info": info}
        values = {}
        for fn in self.funcs:
            kwargs = available if _takes_kwargs(fn) else {
                k: v for k, v in available.items() if k in inspect.signature(fn).parameters
            }  # fmt: skip
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                value = await value
            values[fn.__name__] = float(value)
        reward = sum(w * values[fn.__name__] for fn, w in zip(self.funcs, self.weights))
        return reward, values


def _takes_kwargs(fn: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


@dataclass
class EnvResult:
    """One scored rollout: the model's messages, the environment's state, the reward and each function's value."""

    completion: Messages
    state: dict
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class. Subclasses implement `rollout`; `run` scores it with `rubric`.

    sampling_args: defaults merged under the ones given to `rollout` (e.g. {"max_tokens": 64}).
    model: the model name sent with every request.
    """

    def __init__(self, rubric: Rubric | None = None, sampling_args: dict | None = None, model: str = "verl-policy"):
        self.rubric = rubric or Rubric([])
        self.sampling_args = dict(sampling_args or {})
        self.model = model

    async def rollout(
        self, client: Any, prompt: Messages, answer: Any, sampling_args: dict | None = None
    ) -> tuple[Messages, dict]:
        """Talk to the model through `client`; return (completion messages, state)."""
        raise NotImplementedError

    async def run(self, client: Any, prompt: Messages, answer: Any, sampling_args: dict | None = None,
                  info: dict | None = None) -> EnvResult:  # fmt: skip
        completion, state = await self.rollout(client, prompt, answer, sampling_args)
        reward, metrics = await self.rubric.score(prompt, completion, answer, state, info)
        return EnvResult(completion, state, reward, metrics)

    def _args(self, sampling_args: dict | None) -> dict:
        return {**self.sampling_args, **(sampling_args or {})}

    async def _ask(self, client: Any, messages: Messages, sampling_args: dict | None) -> tuple[dict, Any]:
        response = await client.chat.completions.create(
            model=self.model, messages=messages, **self._args(sampling_args)
        )
        choice = response.choices[0]
        return {"role": "assistant", "content": choice.message.content or ""}, response


class SingleTurnEnv(Environment):
    """One chat completion; state["responses"] holds the raw response."""

    async def rollout(self, client, prompt, answer, sampling_args=None):
        message, response = await self._ask(client, list(prompt), sampling_args)
        return [message], {"responses": [response], "answer": answer}


class MultiTurnEnv(Environment):
    """Model turn, then `env_response`, until `is_completed` or `max_turns` model turns."""

    def __init__(self, max_turns: int = 4, **kwargs: Any):
        super().__init__(**kwargs)
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = int(max_turns)

    def is_completed(self, messages: Messages, state: dict) -> bool:
        raise NotImplementedError

    async def env_response(self, messages: Messages, state: dict) -> tuple[Messages, dict]:
        """The environment's reply to the last model turn (new messages) and the updated state."""
        raise NotImplementedError

    async def rollout(self, client, prompt, answer, sampling_args=None):
        messages = list(prompt)
        state: dict = {"responses": [], "answer": answer, "turn": 0}
        while state["turn"] < self.max_turns:
            message, response = await self._ask(client, messages, sampling_args)
            messages.append(message)
            state["responses"].append(response)
            state["turn"] += 1
            if self.is_completed(messages, state) or state["turn"] >= self.max_turns:
                break
            reply, state = await self.env_response(messages, state)
            messages += reply
        return messages[len(prompt) :], state


class ToolEnv(MultiTurnEnv):
    """Tool use in text: the model writes `<tool_call>` JSON, the tools' results come back as a user turn of
    `<obs>` lines; done when a turn has no tool call (e.g. a `<response>`)."""

    def __init__(self, registry: ToolRegistry | None = None, tool_timeout_s: float | None = 30.0,
                 max_tool_response_length: int | None = 512, **kwargs: Any):  # fmt: skip
        super().__init__(**kwargs)
        self.registry = registry or DEFAULT_REGISTRY
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_response_length = max_tool_response_length

    def is_completed(self, messages, state):
        return not parse_tool_calls(messages[-1]["content"]) or "<response>" in messages[-1]["content"]

    async def env_response(self, messages, state):
        observations = await run_tool_calls(
            self.registry, parse_tool_calls(messages[-1]["content"]), self.tool_timeout_s
        )
        state.setdefault("tool_errors", 0)
        state["tool_errors"] += sum(obs.startswith("error:") for obs in observations)
        text = format_observations(observations, self.max_tool_response_length).strip()
        return [{"role": "user", "content": text}], state
