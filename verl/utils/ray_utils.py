"""Small Ray and asyncio helpers (verl's `verl.utils.ray_utils`).

Owns `ray_noset_visible_devices` (whether Ray was told to leave the accelerators' visible-devices variables alone),
`parallel_put` (many objects into Ray's object store from a thread pool), `get_event_loop` (this thread's loop,
made if there is none) and `auto_await` (an async function callable from sync and async code alike).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import ray

# Ray's switches that stop it from setting each accelerator's visible-devices variable for its workers.
NOSET_VISIBLE_DEVICES_ENV_VARS = (
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HABANA_VISIBLE_MODULES",
    "RAY_EXPERIMENTAL_NOSET_NEURON_RT_VISIBLE_CORES",
    "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS",
    "RAY_EXPERIMENTAL_NOSET_ONEAPI_DEVICE_SELECTOR",
)


def ray_noset_visible_devices(env_vars: Mapping[str, str] | None = None) -> bool:
    """True when any of Ray's NOSET switches is set to a non-empty value in `env_vars` (default: os.environ)."""
    env_vars = os.environ if env_vars is None else env_vars
    return any(env_vars.get(name) for name in NOSET_VISIBLE_DEVICES_ENV_VARS)


def parallel_put(data_list: list[Any], max_workers: int | None = None) -> list[ray.ObjectRef]:
    """`ray.put` every item of `data_list` from up to `max_workers` threads (default: min(len, 16)); the refs
    come back in the order of `data_list`. An empty list raises AssertionError (verl's behaviour)."""
    if len(data_list) == 0:
        raise AssertionError("data_list must not be empty")
    if max_workers is None:
        max_workers = min(len(data_list), 16)
    if not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int or None, got {max_workers!r}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as executor:
        return list(executor.map(ray.put, data_list))


def get_event_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop; a new one, set as the thread's loop, when it has none."""
    try:
        return asyncio.get_event_loop()
    except RuntimeError:  # a thread other than the main one, without a loop
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


def auto_await(func: Callable) -> Callable:
    """Let an async function be called like a sync one where no one awaits it.

    The wrapper returns: the coroutine itself when called from a coroutine function (the caller awaits it);
    the coroutine's result, run with `asyncio.run`, when no event loop runs in this thread; the result, run on a
    new loop in another thread, when called from sync code while this thread's loop runs (blocking that loop
    meanwhile, as a sync call does). A `func` whose call returns no coroutine has its result returned as is.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        coro = func(*args, **kwargs)
        if not inspect.iscoroutine(coro):
            return coro
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        caller = inspect.currentframe().f_back
        if caller is not None and caller.f_code.co_flags & inspect.CO_COROUTINE:
            return coro
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()

    return wrapper
