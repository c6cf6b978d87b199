"""CPU-only speed-ups behind one boundary: `CPU`, the hooks `verl.utils.acceleration.for_device("cpu")` returns.

The hooks switch on adaptive thread counts (`threads`), OpenBLAS products (`blas`), glibc heap retention
(`VERL_RETAIN_FREED_MEMORY`, `MALLOC_ARENA_MAX=1`) and the `hf` rollout's decode path (`shared_prefix`,
`lean_decode`, `decode_kernel`). Each keeps the generic path's numbers up to float rounding.
Layer 2: imported only through verl.utils.acceleration.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from verl.cpu import threads

RETAIN_FREED_MEMORY_ENV = "VERL_RETAIN_FREED_MEMORY"


def retain_freed_memory_from_env() -> bool:
    """Unless `VERL_RETAIN_FREED_MEMORY=0`: make glibc's malloc serve large blocks from its heap and keep freed heap
    memory, so each step reuses the pages of the step before. With glibc's defaults every activation over its
    (adaptive) mmap threshold is a fresh mmap that is unmapped when freed and page-faulted in again, zero-filled, on
    the next step. The process's peak memory is unchanged (the same blocks are live at the peak); its memory after
    the peak stays at the peak. The settings are process-wide: with `trainer.single_process=true` the driver's whole
    process has them. Returns whether the settings were applied (False off glibc, or when switched off)."""
    raw = os.environ.get(RETAIN_FREED_MEMORY_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{RETAIN_FREED_MEMORY_ENV} must be 0 or 1, got {raw!r}")
    if raw == "0":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator's own policy stays
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    limit = 1 << 30  # 1 GiB: blocks below it come from the heap; up to it of freed heap top is kept
    return bool(mallopt(m_mmap_threshold, limit)) and bool(mallopt(m_trim_threshold, limit))


def adaptive_threads_from_env(share: int | None) -> threads.ThreadPolicy | None:
    """With `VERL_ADAPTIVE_THREADS=1`, enable this process's thread policy (`threads`) for a share of `share`
    threads (torch's current count when None) and return it; else disable it and return None. Another value is
    refused."""
    if not threads.adaptive_threads_wanted(default="0"):
        threads.disable()
        return None
    import torch

    return threads.enable(share or torch.get_num_threads())


class CPUAcceleration:
    """The CPU's hooks (the same names as `verl.utils.acceleration.Generic`, which documents each)."""

    name = "cpu"

    def worker_env(self, new_process: bool = True) -> dict[str, str]:
        env = {threads.ADAPTIVE_THREADS_ENV: os.environ.get(threads.ADAPTIVE_THREADS_ENV, "1")}
        if not new_process:  # a running process read OpenMP's and malloc's variables when it started
            return env
        from verl.cpu import blas

        # the driver's own choices reach workers on other nodes too
        forwarded = (*threads.OPENMP_WAIT_ENV, blas.ENV, RETAIN_FREED_MEMORY_ENV)
        env.update({key: os.environ[key] for key in forwarded if key in os.environ})
        # one glibc heap for all threads: what the decode kernel's threads free is reused by the update instead of
        # staying in per-thread arenas
        env["MALLOC_ARENA_MAX"] = os.environ.get("MALLOC_ARENA_MAX", "1")
        return env

    def start_worker(self, num_threads: int | None) -> None:
        from verl.cpu import blas

        retain_freed_memory_from_env()
        blas.prepare()  # VERL_CPU_BLAS: the training passes' products through OpenBLAS (`products`)
        adaptive_threads_from_env(num_threads)  # the process's policy, applied by `call`

    def stop_worker(self) -> None:
        threads.disable()

    def call(self) -> contextlib.AbstractContextManager[None]:
        return threads.worker_call()

    def products(self, rows: int | None = None) -> contextlib.AbstractContextManager[None]:
        from verl.cpu import blas

        # under MIN_ROWS rows the products would stay with MKL anyway, behind the override's Python dispatch
        if rows is not None and rows < blas.MIN_ROWS:
            return contextlib.nullcontext()
        return blas.products()

    def lean_decoder(self, module: Any, positions: int) -> Any | None:
        from verl.cpu import lean_decode

        return lean_decode.LeanDecoder(module, positions) if lean_decode.applies_to(module) else None

    def shared_prefix_cache(self, config: Any, capacity: int) -> Any | None:
        from verl.cpu import shared_prefix

        if not shared_prefix.applies_to(config):
            return None
        return shared_prefix.SharedPrefixCache(config.num_hidden_layers, capacity)

    def decode_attention(self, module: Any) -> contextlib.AbstractContextManager[None]:
        from verl.cpu import shared_prefix

        return shared_prefix.decode_attention(module)

    def token_sampler(self, top_k: int, top_p: float, logits: Any) -> Any | None:
        import torch

        from verl.cpu import decode_kernel

        plain = top_k == -1 and top_p >= 1.0  # the kernel applies the temperature only
        if plain and logits.dtype == torch.float32 and logits.device.type == "cpu" and decode_kernel.available():
            return decode_kernel.sample_tokens
        return None


CPU = CPUAcceleration()
