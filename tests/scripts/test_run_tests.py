"""scripts/run_tests.sh, the README's and CI's test command: both passes run on the given paths (the parallel one
on pytest-xdist workers), a pass that selects nothing counts as passed, the vLLM lane runs the `vllm` tests in
the environment $VLLM_PYTHON names (or says it is skipped when there is none), and a marker selection of the
caller's is refused with the reason (the passes select with -m themselves)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, vllm_python: str = "/nonexistent/python") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "VLLM_PYTHON": vllm_python}
    return subprocess.run(
        ["bash", "scripts/run_tests.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_both_passes_run_on_the_given_file_and_an_empty_serial_pass_passes():
    out = _run("tests/benchmarks/test_flops.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the parallel pass ran the file's tests on 2 workers; the serial pass found none of them marked serial
    assert "bringing up nodes" in out.stdout, out.stdout[-2000:]  # pytest-xdist's workers
    assert "4 passed" in out.stdout and "4 deselected" in out.stdout, out.stdout[-2000:]
    assert "vLLM lane skipped: no /nonexistent/python" in out.stdout


def test_the_vllm_lane_runs_the_vllm_tests_with_its_interpreter(tmp_path):
    """A `vllm`-marked test on the given path runs in the lane, with the lane's interpreter (a wrapper that
    records being called); the parallel pass runs it too (the real `vllm` tests skip themselves there, where vllm
    is not installed)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\n@pytest.mark.vllm\ndef test_lane():\n    pass\n")
    marker = tmp_path / "called"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\ntouch {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    out = _run(str(probe), vllm_python=str(wrapper))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert marker.exists() and "vLLM lane skipped" not in out.stdout
    assert out.stdout.count("1 passed") == 2, out.stdout[-2000:]  # the parallel pass and the lane


def test_a_marker_selection_is_refused_naming_it():
    for args in (["-m", "not slow"], ["--markexpr=gpu"]):
        out = _run(*args)
        assert out.returncode == 2
        assert f"run_tests.sh got '{args[0]}'" in out.stderr and 'pytest tests -m "not slow"' in out.stderr
        assert "passed" not in out.stdout
