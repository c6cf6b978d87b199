"""The Ray-presence benchmark (benchmarks/bench_ray_presence.py): its measuring process honours the thread count
(one thread: CPU seconds at most its wall seconds; two: well over what one thread got) and reports the loop's time
as JSON."""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bench_ray_presence.py")


def _child(threads: int) -> dict:
    cmd = [sys.executable, SCRIPT, "--_child", "alone", "--_threads", str(threads), "--size", "512", "--reps", "40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.serial  # asserts wall time or CPU share: run alone (scripts/run_tests.sh)
def test_the_measuring_process_computes_on_the_threads_it_is_given():
    one = _child(1)
    assert one["wall_s"] > 0 and one["cpu_s"] / one["wall_s"] < 1.2  # never more than one thread busy
    if len(os.sched_getaffinity(0)) >= 2:
        two = _child(2)
        # both threads busy in the matmuls: more cores' worth than one thread got just before (on a quiet
        # machine ~1.9 against ~1.0; with two busy processes beside it ~1.0 against ~0.67)
        assert two["cpu_s"] / two["wall_s"] > 1.2 * one["cpu_s"] / one["wall_s"], (one, two)
