"""scripts/run_tests.sh, the README's and CI's test command: both passes run on the given paths (the parallel one
on pytest-xdist workers), a pass that selects nothing counts as passed, and a marker selection of the caller's is
refused with the reason (the passes select with -m themselves)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", "scripts/run_tests.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_both_passes_run_on_the_given_file_and_an_empty_serial_pass_passes():
    out = _run("tests/benchmarks/test_flops.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the parallel pass ran the file's tests on 2 workers; the serial pass found none of them marked serial
    assert "bringing up nodes" in out.stdout, out.stdout[-2000:]  # pytest-xdist's workers
    assert "4 passed" in out.stdout and "4 deselected" in out.stdout, out.stdout[-2000:]


def test_a_marker_selection_is_refused_naming_it():
    for args in (["-m", "not slow"], ["--markexpr=gpu"]):
        out = _run(*args)
        assert out.returncode == 2
        assert f"run_tests.sh got '{args[0]}'" in out.stderr and 'pytest tests -m "not slow"' in out.stderr
        assert "passed" not in out.stdout
