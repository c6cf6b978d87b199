"""System metrics of the calling process: CPU use and resident memory (psutil), plus GPU memory and utilisation when
CUDA is in use. Every worker process reports its own (`Worker.get_system_metrics`, reward workers' `system_metrics`);
the trainer logs them as `system/{worker}/{metric}`.

Owns `process_metrics()` and `prefixed(name, metrics)`. Layer 1: psutil and torch only.
"""

from __future__ import annotations

import os

import psutil
import torch

__all__ = ["process_metrics", "prefixed"]

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
