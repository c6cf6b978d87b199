"""Decode lanes: a CPU generation split into independent parts that run side by side, one core each.

Owns `lane_count` (how many lanes a micro-batch gets; whether the threads spin is `cpu_share.openmp_threads_spin`), `split_into_lanes` (which rows go to which lane) and
`run_lanes` (the lanes' work on the process's lane threads, each with one torch intra-op thread).

Why: a decode step of a small model is a few dozen small kernels. With two or more intra-op threads every kernel
is an OpenMP region whose helper threads must be woken when they sleep between kernels (`OMP_WAIT_POLICY=PASSIVE`,
or `GOMP_SPINCOUNT=0`). Two lanes of one thread each never wake anyone: on the bench shape (16 prompts x 8
samples, 64 tokens, 2 cores, shared-prompt cache) the generation took 0.78 s against 1.28 s in one lane of two
threads. torch releases the GIL inside every kernel, so the lanes' Python overlaps with the other lane's compute.
When the threads spin between kernels (libgomp's default, which CPU workers keep) a wake-up costs nothing and one
lane on all threads pays the step's fixed Python cost once: with the shared-prompt cache one lane was faster at
every shape measured (`benchmarks/bench_decode.py`, one process, 2 threads, 64 tokens: 0.52 vs 0.65 s at 16 x 4
rows, 0.70 vs 0.77 at 16 x 8, 1.16 vs 1.20 at 16 x 16; 3.41 vs 3.62 s at 256 tokens), so that is the default
there. With the per-row cache (a bigger attention per row) two lanes stay faster (0.91 vs 1.06 s at 16 x 8).

A lane holds whole prompt groups (the `rollout.n` samples of a prompt stay together: they share one prefill), and
lanes are balanced by row count. Each row's random draws come from the caller (one uniform per row and position),
so the samples are the same whatever the number of lanes.

Layer 5: imports torch and verl.utils.cpu_share only; must not import Ray.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from verl.utils.cpu_share import openmp_threads_spin

T = TypeVar("T")

# Fewest rows a lane gets: each lane pays a fixed cost per decode step (a pass through the model's Python). On the
# bench model two lanes of 8 rows were still faster than one of 16 (0.58-0.66 s against 0.74-0.82 s for 64 tokens,
# one process, 2 threads); fewer rows per lane were not measured.
MIN_ROWS_PER_LANE = 8


def lane_count(
    device: torch.device, rows: int, groups: int, requested: int | None = None, shared_cache: bool = False
) -> int:
    """Lanes for a micro-batch of `rows` rows in `groups` distinct prompts: `requested` when given; else one on any
    device but the CPU (a GPU kernel runs on the device, not on the calling thread), one on CPU when the decode
    uses the shared-prompt cache (`shared_cache`) and the OpenMP threads spin between kernels, and otherwise one per
    torch intra-op thread while each lane keeps `MIN_ROWS_PER_LANE` rows (see the module docstring). Never more
    than the number of prompt groups."""
    if requested is None:
        if device.type != "cpu" or (shared_cache and openmp_threads_spin()):
            requested = 1
        else:
            requested = min(torch.get_num_threads(), rows // MIN_ROWS_PER_LANE)
    return max(1, min(int(requested), groups))


def split_into_lanes(groups: torch.Tensor, lanes: int) -> list[torch.Tensor]:
    """Row indices of each lane, for (rows,) prompt-group ids 0..G-1: every group goes whole to one lane, the
    largest groups first, each to the lane with the fewest rows so far; a lane's rows keep their order."""
    sizes = torch.bincount(groups).tolist()
    load = [0] * lanes
    lane_of_group = [0] * len(sizes)
    for group in sorted(range(len(sizes)), key=lambda g: (-sizes[g], g)):
        lane = min(range(lanes), key=lambda i: (load[i], i))
        lane_of_group[group] = lane
        load[lane] += sizes[group]
    lane_of_row = torch.tensor(lane_of_group, dtype=torch.long)[groups.cpu()]
    return [(lane_of_row == lane).nonzero().flatten() for lane in range(lanes) if load[lane]]


def run_lanes(work: list[Callable[[], T]]) -> list[T]:
    """Run each callable on a lane thread of its own, with one torch intra-op thread and autograd off, and return
    their results in order. The caller's intra-op thread count is restored afterwards; the first error is
    re-raised once every lane has stopped. A single callable runs in the caller's thread, as it is.

    The lane threads live as long as the process (`_lane_pool`): with two threads started for every call the
    bench's worker grew by ~440 MB over 8 steps (most likely the math library's per-thread scratch buffers, e.g.
    MKL's GEMM packing buffers, which outlive their thread); with the pool the lanes cost it ~50 MB."""
    if len(work) == 1:
        return [work[0]()]

    def lane(job: Callable[[], T]) -> T:
        torch.set_num_threads(1)
        with torch.no_grad():
            return job()

    threads_before = torch.get_num_threads()
    try:
        futures = [_lane_pool(len(work)).submit(lane, job) for job in work]
        concurrent.futures.wait(futures)
    finally:
        torch.set_num_threads(threads_before)
    return [future.result() for future in futures]  # the first lane's error, if any, is raised here


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_KEY: tuple[int, int] = (0, 0)  # (process id, threads) of the pool
_POOL_LOCK = threading.Lock()


def _lane_pool(lanes: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's lane threads, at least `lanes` of them (a new pool when more are needed, or in a forked
    child, whose copy of the pool has no threads)."""
    global _POOL, _POOL_KEY
    with _POOL_LOCK:
        pid, size = _POOL_KEY
        if _POOL is None or pid != os.getpid() or size < lanes:
            if _POOL is not None and pid == os.getpid():
                _POOL.shutdown(wait=False)
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="decode-lane")
            _POOL_KEY = (os.getpid(), lanes)
        return _POOL
