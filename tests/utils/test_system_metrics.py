"""Tests of verl/utils/system_metrics.py: the per-process metrics and the memory of one phase (`phase_memory`)."""

import mmap
import time

from verl.utils.system_metrics import phase_memory, process_metrics


def test_process_metrics_report_cpu_and_rss():
    metrics = process_metrics()
    assert metrics["rss_gb"] > 0 and metrics["cpu_percent"] >= 0


def test_phase_memory_sees_a_short_lived_allocation():
    with phase_memory("test_phase"):
        # 64 MiB of fresh anonymous pages, written, alive for 50 ms (mmap: not memory the allocator kept from earlier
        # tests, which a worker's VERL_RETAIN_FREED_MEMORY makes glibc keep)
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\1" * len(block))
        time.sleep(0.05)
        block.close()
    metrics = process_metrics()
    before, peak = metrics["test_phase_rss_before_gb"], metrics["test_phase_peak_rss_gb"]
    assert peak - before > 60 / 1024  # GiB
    with phase_memory("test_phase"):  # a new measurement replaces the last one
        pass
    assert process_metrics()["test_phase_peak_rss_gb"] < peak
