"""System metrics of the calling process: CPU use and resident memory (psutil), plus GPU memory and utilisation when
CUDA is in use. Every worker process reports its own (`Worker.get_system_metrics`, reward workers' `system_metrics`);
the trainer logs them as `system/{worker}/{metric}`.

Owns `process_metrics()`, `prefixed(name, metrics)` and `phase_memory(name)`, which records the resident memory of
one phase (e.g. the workers' weight sync: `system/actor_rollout_rank{r}/weight_sync_peak_rss_gb`) for
`process_metrics()` to report. Layer 1: psutil and torch only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import psutil
import torch

__all__ = ["phase_memory", "process_metrics", "prefixed"]

_PHASES: dict[str, dict[str, float]] = {}  # phase name -> its last measurement (`phase_memory`)

_PROCESS: dict[int, psutil.Process] = {}  # one Process object per pid, so cpu_percent measures since the last call


def _process() -> psutil.Process:
    pid = os.getpid()
    if pid not in _PROCESS:
        _PROCESS[pid] = psutil.Process(pid)
        _PROCESS[pid].cpu_percent(None)  # the first call only starts the clock
    return _PROCESS[pid]


def process_metrics() -> dict[str, float]:
    """`cpu_percent` (average since the previous call; 100 = one core busy), `rss_gb`, and with CUDA initialised
    `gpu_memory_allocated_gb`, `gpu_memory_reserved_gb` and `gpu_utilization` (percent, when NVML answers)."""
    process = _process()
    metrics = {"cpu_percent": float(process.cpu_percent(None)), "rss_gb": process.memory_info().rss / 2**30}
    for phase, values in _PHASES.items():
        metrics.update({f"{phase}_{key}": value for key, value in values.items()})
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        metrics["gpu_memory_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
        try:
            metrics["gpu_utilization"] = float(torch.cuda.utilization())
        except Exception:  # no NVML (pynvml) in this environment: utilisation is unknown, memory is still reported
            pass
    return metrics


def prefixed(name: str, metrics: dict[str, float]) -> dict[str, float]:
    """`{f"system/{name}/{key}": value}`."""
    return {f"system/{name}/{key}": value for key, value in metrics.items()}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:  # Linux: a cheap read, fit for sampling every few ms
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _process().memory_info().rss


@contextlib.contextmanager
def phase_memory(name: str, interval_s: float = 0.002) -> Iterator[None]:
    """Measure this process's resident memory over the block: `process_metrics()` then reports
    `{name}_rss_before_gb` (at its start) and `{name}_peak_rss_gb` (the largest of samples taken every
    `interval_s` by a thread, and at both ends) until the next measurement of `name`. RSS only (not GPU memory)."""
    before = _rss_bytes()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            peak[0] = max(peak[0], _rss_bytes())

    thread = threading.Thread(target=sample, name=f"phase_memory:{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], _rss_bytes())
        _PHASES[name] = {"rss_before_gb": before / 2**30, "peak_rss_gb": peak[0] / 2**30}
