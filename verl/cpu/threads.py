"""How many torch threads a CPU worker's next call computes with: its CPU share, less the cores the machine's other
processes kept busy during its last call (from /proc/stat, over calls of `MIN_WINDOW_S` or more; the share where
/proc is missing).

Owns `ThreadPolicy`, `adaptive_threads_wanted` (`VERL_ADAPTIVE_THREADS`), `enable` / `worker_call` (the process's
policy, applied through `verl.cpu.CPUAcceleration.call`), `measured_call` and `machine_busy_ticks`. OpenMP threads
keep spinning (benchmarks/README.md). Layer 2: os, time and torch only.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

# libgomp's variables for how an idle OpenMP thread waits (torch's OpenMP on Linux); a worker group passes the
# driver's to its CPU workers (`verl.cpu.CPUAcceleration.worker_env`)
OPENMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
ADAPTIVE_THREADS_ENV = "VERL_ADAPTIVE_THREADS"  # 1: calls pick their thread count (this module), 0: torch's count kept
MIN_WINDOW_S = 0.2  # a shorter window holds too few clock ticks (10 ms each) to tell
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def adaptive_threads_wanted(default: str) -> bool:
    """`VERL_ADAPTIVE_THREADS` (`default` when unset) is 1; 0 is False; another value is refused."""
    raw = os.environ.get(ADAPTIVE_THREADS_ENV, default)
    if raw not in ("0", "1"):
        raise ValueError(f"{ADAPTIVE_THREADS_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def machine_busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs in `cpus` spent busy since boot (all but idle and iowait), or None without /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            lines = stat.readlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def own_ticks() -> int | None:
    """Clock ticks this process (all its threads) has run, user + system, or None without /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class ThreadPolicy:
    """Torch's intra-op thread count per call for a worker whose CPU share is `share` threads (see the module
    docstring). `clock`, `busy` and `own` are the sources of wall seconds and busy ticks (a test passes its own)."""

    def __init__(self, share: int, clock=time.monotonic, busy=machine_busy_ticks, own=own_ticks):
        if share < 1:
            raise ValueError(f"a worker's CPU share must be at least 1 thread, got {share}")
        self.share = share
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count()))
        self._clock, self._busy, self._own = clock, busy, own
        self.threads = share
        self._depth = 0  # calls in progress (a worker method may call another)
        self._start: tuple | None = None

    def _sample(self) -> tuple[float, int | None, int | None]:
        return self._clock(), self._busy(self.cpus), self._own()

    @staticmethod
    def others_cores(before: tuple, after: tuple) -> float | None:
        """Cores the other processes kept busy between two samples, or None when it cannot be told."""
        (t0, busy0, own0), (t1, busy1, own1) = before, after
        if None in (busy0, busy1, own0, own1) or t1 - t0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / _CLOCK_TICKS / (t1 - t0)

    def start(self) -> int:
        """A call begins: set torch's thread count to the one the last measured call left, return it."""
        self._depth += 1
        if self._depth == 1:
            self._start = self._sample()
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
        return self.threads

    def finish(self) -> None:
        """A call ended: when it lasted `MIN_WINDOW_S` or more, the next call's count is the cores the other
        processes left free while it ran (round(CPUs - their cores), within 1 and the share)."""
        self._depth = max(0, self._depth - 1)
        if self._depth or self._start is None:
            return
        end = self._sample()
        if end[0] - self._start[0] >= MIN_WINDOW_S:
            others = self.others_cores(self._start, end)
            if others is not None:
                self.threads = max(1, min(self.share, round(len(self.cpus) - others)))
        self._start = None


_POLICY: ThreadPolicy | None = None


def enable(share: int) -> ThreadPolicy:
    """Make this process's worker calls (`worker_call`) pick their thread count, for a CPU share of `share`."""
    global _POLICY
    _POLICY = ThreadPolicy(share)
    return _POLICY


def disable() -> None:
    """Worker calls keep whatever thread count is set (the default)."""
    global _POLICY
    _POLICY = None


def worker_call() -> contextlib.AbstractContextManager[None]:
    """The block is one worker call, measured under this process's policy (`measured_call`; none enabled: nothing)."""
    return measured_call(_POLICY)


@contextlib.contextmanager
def measured_call(policy: ThreadPolicy | None) -> Iterator[None]:
    """The block runs with the thread count `policy` picks (`ThreadPolicy.start`) and is measured for its next pick
    (`ThreadPolicy.finish`); with None nothing happens."""
    if policy is None:
        yield
        return
    policy.start()
    try:
        yield
    finally:
        policy.finish()
