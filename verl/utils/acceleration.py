"""The one door to device-specific speed-ups: generic code asks here, never imports them.

Owns `for_device` (`verl.cpu`, imported on first use, for "cpu"; else `GENERIC`, which does nothing), the process's
choice (`enter`, `leave`, `current`) and `WORKER_DEVICE_ENV`. `VERL_CPU_ACCELERATION=0` makes the CPU take
`GENERIC` too. Layer 1: os and contextlib only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

WORKER_DEVICE_ENV = "VERL_WORKER_DEVICE"  # "cpu" or "cuda": set by the worker groups for each worker process
SWITCH_ENV = "VERL_CPU_ACCELERATION"  # "0": the CPU runs the generic paths too


class Generic:
    """No device-specific speed-up: every hook is a no-op or declines (returns None), so the caller takes its plain
    torch/HF path. `verl.cpu.CPU` has the same hooks."""

    name = "generic"

    def worker_env(self, new_process: bool = True) -> dict[str, str]:
        """Environment variables a worker group gives a worker of this device (before its process starts when
        `new_process`, else set in the running process)."""
        return {}

    def start_worker(self, num_threads: int | None) -> None:
        """Called once by a worker process at start, with its torch thread count."""

    def stop_worker(self) -> None:
        """Called when an in-process worker ends (the single-process trainer)."""

    def call(self) -> contextlib.AbstractContextManager[None]:
        """Wraps each `@register`ed worker call."""
        return contextlib.nullcontext()

    def products(self, rows: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Wraps a pass whose matrix products may take another kernel library (`rows`: the smallest batch of the
        pass's products, where known)."""
        return contextlib.nullcontext()

    def lean_decoder(self, module: Any, positions: int) -> Any | None:
        """An object whose `step(tokens, positions, cache, attention)` returns a decode step's last logits without
        the model's module calls, or None (the model's forward)."""
        return None

    def shared_prefix_cache(self, config: Any, capacity: int) -> Any | None:
        """A KV cache holding each distinct prompt once for all the rows sampled from it (`start_decode(groups,
        prompt_mask)` after the prefill), or None (a per-row cache)."""
        return None

    def decode_attention(self, module: Any) -> contextlib.AbstractContextManager[None]:
        """Wraps the decode steps that use a `shared_prefix_cache`."""
        return contextlib.nullcontext()

    def token_sampler(self, top_k: int, top_p: float, logits: Any) -> Any | None:
        """A function `(logits, temperature, draws, want_log_probs) -> (tokens, log_probs or None)` drawing each
        row's token from softmax(logits / temperature) by inverse CDF with its uniform (argmax when `draws` is None)
        in one pass, or None (the caller's own sampling)."""
        return None


GENERIC = Generic()
_current: Any = GENERIC


def cpu_wanted() -> bool:
    """Whether the CPU uses `verl.cpu` (`VERL_CPU_ACCELERATION`, default 1); another value is refused."""
    raw = os.environ.get(SWITCH_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{SWITCH_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def for_device(device_type: str) -> Any:
    """The speed-ups of a device type ("cpu", "cuda", ...): `verl.cpu.CPU` for the CPU unless switched off, else
    `GENERIC`."""
    if device_type == "cpu" and cpu_wanted():
        from verl.cpu import CPU

        return CPU
    return GENERIC


def worker_device() -> str:
    """This worker's device type: `VERL_WORKER_DEVICE` when its group set it, else "cuda" where torch sees a GPU
    (a worker built outside a group), else "cpu"."""
    device = os.environ.get(WORKER_DEVICE_ENV)
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def enter(device_type: str, num_threads: int | None = None) -> Any:
    """Make `for_device(device_type)` this process's current speed-ups and start them for a worker with
    `num_threads` torch threads; returns them."""
    global _current
    _current = for_device(device_type)
    _current.start_worker(num_threads)
    return _current


def leave() -> None:
    """Stop the current speed-ups (an in-process worker ended); `current()` is `GENERIC` again."""
    global _current
    _current.stop_worker()
    _current = GENERIC


def current() -> Any:
    """The speed-ups this process entered (`GENERIC` until a worker entered its device's)."""
    return _current
