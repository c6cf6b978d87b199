"""Reward wiring of the PPO trainer: the custom reward function, the reward manager from config, and
`compute_reward` (one batch -> token-level scores + per-sample extra info).

Owns `CustomRewardFunction`, `get_custom_reward_fn(config)`, `load_reward_manager(config, tokenizer,
num_examine, **reward_kwargs)` and `compute_reward(data, reward_fn)`. Config keys (verl's):
`custom_reward_function.path` / `.name` / `.reward_kwargs`, `reward_model.reward_manager` (default
"naive"), `reward_model.on_error` ("raise" | "zero"), `reward_model.timeout_s` (seconds per score call),
`reward_model.reward_kwargs` (manager keyword
arguments, e.g. DAPO's `overlong_buffer_cfg`, or rlla flags such as `withlength: true` that are passed on
to every score call), `data.reward_fn_key`. Must not import Ray or worker code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.reward_manager import get_reward_manager_cls

__all__ = ["CustomRewardFunction", "compute_reward", "get_custom_reward_fn", "load_reward_manager"]


def _section(config: Any, name: str) -> Any:
    return config.get(name) or {}


def _load_function(path: str, name: str) -> Callable:
    """Import the Python file `path` and return its callable `name`; clear errors naming both."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} is not a file")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    module_name = f"verl_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path={path!r} cannot be imported (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ImportError(
            f"custom_reward_function.path={path!r} failed to import: {type(err).__name__}: {err}"
        ) from err
    fn = getattr(module, name, None)
    if fn is None:
        functions = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function.name={name!r} is not defined in {path}; functions there: {functions}"
        )
    if not callable(fn):
        raise TypeError(f"custom_reward_function.name={name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


class CustomRewardFunction:
    """A picklable handle on function `name` of the file `path`, with `kwargs` bound to every call.

    Pickles as (path, name, kwargs) and re-imports the file in the receiving process, so that the
    prime reward manager can run it in worker processes. Exposes the function's signature (minus the
    bound keywords) so that reward managers can tell whether it takes `step`.
    """

    def __init__(self, path: str, name: str = "compute_score", kwargs: dict[str, Any] | None = None) -> None:
        self.path, self.name, self.kwargs = path, name, dict(kwargs or {})
        self._fn = _load_function(path, name)
        self.__name__ = name
        try:
            signature = inspect.signature(self._fn)
            params = [p for p in signature.parameters.values() if p.name not in self.kwargs]
            self.__signature__ = signature.replace(parameters=params)
        except (TypeError, ValueError):  # a builtin without a signature: managers pass no `step`
            pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **{**self.kwargs, **kwargs})

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["name"], state["kwargs"])

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path!r}, {self.name!r})"


def get_custom_reward_fn(config: Any) -> CustomRewardFunction | None:
    """The function named by `custom_reward_function.path/.name` (None when no path is set)."""
    section = _section(config, "custom_reward_function")
    path = section.get("path")
    if not path:
        return None
    name = section.get("name") or "compute_score"
    return CustomRewardFunction(str(path), str(name), dict(section.get("reward_kwargs") or {}))


def load_reward_manager(config: Any, tokenizer: Any, num_examine: int, **reward_kwargs: Any) -> Any:
    """Build `reward_model.reward_manager` (default "naive") with the custom or default score function.

    Manager keyword arguments: `reward_model.reward_kwargs`, then `reward_kwargs` given here (these win),
    `on_error` from `reward_model.on_error` (default "raise") and `timeout_s` from `reward_model.timeout_s`.
    """
    reward_model = _section(config, "reward_model")
    manager_cls = get_reward_manager_cls(reward_model.get("reward_manager") or "naive")
    kwargs = {**dict(reward_model.get("reward_kwargs") or {}), **reward_kwargs}
    kwargs.setdefault("on_error", reward_model.get("on_error", "raise"))
    if reward_model.get("timeout_s") is not None:  # wall-time limit of one score call (prime: of one sample)
        kwargs.setdefault("timeout_s", reward_model.get("timeout_s"))
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=get_custom_reward_fn(config),
        reward_fn_key=_section(config, "data").get("reward_fn_key", "data_source"),
        **kwargs,
    )


def compute_reward(data: DataProto, reward_fn: Callable) -> tuple[torch.Tensor, dict[str, list]]:
    """`reward_fn(data, return_dict=True)` -> (token-level scores (bs, response_length), extra info lists)."""
    result = reward_fn(data, return_dict=True)
    if isinstance(result, torch.Tensor):  # a plain callable that ignores return_dict
        return result, {}
    return result["reward_tensor"], dict(result.get("reward_extra_info") or {})
