#!/usr/bin/env bash
# The test suite, as CI and the README run it: bash scripts/run_tests.sh [pytest arguments ...]
#
# 1. every test not marked `serial`, on TEST_WORKERS pytest-xdist workers (default 2), whole files per worker
#    (`--dist loadfile`: a module's fixtures, its Ray session and its processes stay in one worker), the files
#    holding `slow` tests first (tests/conftest.py) so that no worker ends up running a long end-to-end file alone;
# 2. then the `serial` tests alone in one process: they assert wall time or CPU share (work done side by side,
#    a timeout's bound, threads kept busy), which a second worker's load on the same cores would distort.
# Extra arguments (paths, -k, --durations=N) go to both passes; with no path, pyproject.toml's testpaths (tests/).
# A pass that selects no test (pytest's exit code 5) counts as passed; a -m of the caller's is refused.
# Plain `pytest tests` still runs everything in one process, in file order.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
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
  "$PY" -m pytest -q -x -p no:cacheprovider "$@"  # no path given: pyproject.toml's testpaths, tests/
  local rc=$?
  [ "$rc" = 5 ] && rc=0
  return "$rc"
}

run_pass -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "not serial" "$@" || exit $?
run_pass -m serial "$@"
