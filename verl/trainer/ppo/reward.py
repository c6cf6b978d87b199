"""Reward wiring of the PPO trainer: `CustomRewardFunction`, `get_custom_reward_fn(config)`,
`load_reward_manager(config, tokenizer, num_examine, **reward_kwargs)`, `compute_reward(data, reward_fn)` and
`agent_loop_scores(data)`. Reads verl's `reward.*` keys (`custom_reward_function`, `reward_manager.name`,
`on_error`, `timeout_s`, `reward_kwargs`, `sandbox_fusion`) and `data.reward_fn_key`. Must not import Ray or workers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.reward_manager import get_reward_manager_cls

__all__ = [
    "CustomRewardFunction",
    "agent_loop_scores",
    "compute_reward",
    "get_custom_reward_fn",
    "load_reward_manager",
    "sandbox_fusion_compute_score",
]


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


def _setting(config: Any, new: tuple[str, ...], legacy: tuple[str, ...], default: Any = None) -> Any:
    """`reward.<new>` (verl 0.9.1), else the legacy location (a config not passed through `prepare_config`)."""
    for path in (new, legacy):
        node = config
        for part in path:
            node = _section(node, part) if part != path[-1] else (node.get(part) if node else None)
        if node is not None:
            return node
    return default


def get_custom_reward_fn(config: Any) -> CustomRewardFunction | None:
    """The function named by `reward.custom_reward_function.path/.name` (verl 0.9.1; the legacy top-level
    `custom_reward_function` of a config not passed through `prepare_config` too); None when no path is set."""
    section = _section(_section(config, "reward"), "custom_reward_function")
    if not section.get("path"):
        section = _section(config, "custom_reward_function")
    path = section.get("path")
    if not path:
        return None
    name = section.get("name") or "compute_score"
    return CustomRewardFunction(str(path), str(name), dict(section.get("reward_kwargs") or {}))


def sandbox_fusion_compute_score(config: Any, manager_cls: type) -> Callable | None:
    """The manager's default scorer bound to `reward.sandbox_fusion` (verl's partial), or None when no url is set.

    Reads `reward.sandbox_fusion.url` (default null), `.max_concurrent` (64: requests in flight, all score
    calls of this manager together) and `.memory_limit_mb` (1024). The cap is a `threading.Semaphore`, or a
    multiprocessing manager's semaphore (as verl uses) for the "prime" manager, whose samples run in processes.
    """
    from verl.utils.reward_score import default_compute_score
    from verl.workers.reward_manager import BatchRewardManager, PrimeRewardManager
    from verl.workers.reward_manager.batch import default_batch_compute_score

    sandbox = _section(_section(config, "reward"), "sandbox_fusion")
    url = sandbox.get("url")
    if not url:
        return None
    max_concurrent = sandbox.get("max_concurrent", 64)
    memory_limit_mb = sandbox.get("memory_limit_mb", 1024)
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(
            f"reward.sandbox_fusion.max_concurrent={max_concurrent!r}; allowed: an integer >= 1 (verl's default 64)"
        )
    if memory_limit_mb is None:
        memory_limit_mb = 1024
    if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 1:
        raise ValueError(
            f"reward.sandbox_fusion.memory_limit_mb={memory_limit_mb!r}; allowed: megabytes >= 1 (verl's default 1024)"
        )
    if issubclass(manager_cls, PrimeRewardManager):
        semaphore = multiprocessing.Manager().Semaphore(max_concurrent)  # the proxy keeps its manager alive
    else:
        semaphore = threading.Semaphore(max_concurrent)
    scorer = default_batch_compute_score if issubclass(manager_cls, BatchRewardManager) else default_compute_score
    bound = functools.partial(
        scorer, sandbox_fusion_url=str(url), concurrent_semaphore=semaphore, memory_limit_mb=memory_limit_mb
    )
    bound.__name__ = scorer.__name__  # named in reward errors
    return bound


def load_reward_manager(config: Any, tokenizer: Any, num_examine: int, **reward_kwargs: Any) -> Any:
    """Build `reward.reward_manager.name` (default "naive") with the custom or default score function.

    Manager keyword arguments: `reward.reward_kwargs`, then `reward_kwargs` given here (these win), `on_error`
    from `reward.on_error` (default "raise") and `timeout_s` from `reward.timeout_s` (legacy `reward_model.*`
    locations are read for a config not passed through `prepare_config`).
    Without a custom function and with `reward.sandbox_fusion.url` set, the default scorer runs the code data
    sources through that SandboxFusion service (see `sandbox_fusion_compute_score`).
    """
    name = _setting(config, ("reward", "reward_manager", "name"), ("reward_model", "reward_manager"), "naive")
    manager_cls = get_reward_manager_cls(name)
    manager_kwargs = _setting(config, ("reward", "reward_kwargs"), ("reward_model", "reward_kwargs"), {})
    kwargs = {**dict(manager_kwargs or {}), **reward_kwargs}
    kwargs.setdefault("on_error", _setting(config, ("reward", "on_error"), ("reward_model", "on_error"), "raise"))
    timeout_s = _setting(config, ("reward", "timeout_s"), ("reward_model", "timeout_s"))
    if timeout_s is not None:  # wall-time limit of one score call (prime: of one sample)
        kwargs.setdefault("timeout_s", timeout_s)
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=get_custom_reward_fn(config) or sandbox_fusion_compute_score(config, manager_cls),
        reward_fn_key=_section(config, "data").get("reward_fn_key", "data_source"),
        **kwargs,
    )


def compute_reward(data: DataProto, reward_fn: Callable) -> tuple[torch.Tensor, dict[str, list]]:
    """`reward_fn(data, return_dict=True)` -> (token-level scores (bs, response_length), extra info lists); when
    every row carries the score its agent loop computed (`reward_score`, verl's `rm_scores`), those scores instead."""
    scores = agent_loop_scores(data)
    if scores is not None:
        return scores, {}
    result = reward_fn(data, return_dict=True)
    if isinstance(result, torch.Tensor):  # a plain callable that ignores return_dict
        return result, {}
    return result["reward_tensor"], dict(result.get("reward_extra_info") or {})


def agent_loop_scores(data: DataProto) -> torch.Tensor | None:
    """The non-tensor `reward_score` of every row (the agent_loop workflow's) at the row's last trained response
    token, or None when a row has none (verl uses its agent loops' scores only when all samples have one)."""
    column = data.non_tensor_batch.get("reward_score")
    if column is None or len(column) == 0 or any(score is None for score in column):
        return None
    mask = data.batch["response_mask"]
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    for row, score in enumerate(column):
        trained = mask[row].nonzero()
        scores[row, int(trained[-1]) if trained.numel() else 0] = float(score)
    return scores
