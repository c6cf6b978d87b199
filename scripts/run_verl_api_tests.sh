#!/usr/bin/env bash
# Run verl 0.9.1's own CPU test files (tests/**/*_on_cpu.py in its wheel) against THIS package (not part of CI).
#
# Downloads the verl 0.9.1 wheel (PyPI, no dependencies), unpacks its tests/ into a scratch directory outside the
# repository, links this checkout's `verl` package beside them (so `import verl` and paths such as
# verl/trainer/config/rollout/rollout.yaml, read from the working directory as in verl's repository, are this
# project's) and runs them with this repository's interpreter. Two files are left out: they test multi-modal and
# audio input, which this project does not have (test_multimodal_position_ids_on_cpu, test_audio_server_contract_on_cpu).
# Usage: scripts/run_verl_api_tests.sh [extra pytest args]     (PYTHON=... to pick the interpreter)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download verl==0.9.1 --no-deps --only-binary=:all: -d "$work/wheel" -q
"$python" -m zipfile -e "$work"/wheel/verl-0.9.1-*.whl "$work/src"
mkdir -p "$work/run"
cp -r "$work/src/tests" "$work/run/tests"
ln -s "$repo/verl" "$work/run/verl"

cd "$work/run"
"$python" -c "import os, sys, verl; p = os.path.realpath(verl.__file__); print('verl from', p); sys.exit(not p.startswith('$repo'))"
mapfile -t files < <(find tests -name '*_on_cpu.py' ! -name 'test_multimodal_position_ids_on_cpu.py' \
    ! -name 'test_audio_server_contract_on_cpu.py' | sort)
echo "${#files[@]} test files"
status=0
for file in "${files[@]}"; do  # one process per file, as verl's CI runs them (several start their own Ray session)
    "$python" -m pytest "$file" -q -p no:cacheprovider -o asyncio_default_fixture_loop_scope=function "$@" 2>/dev/null | tail -1 | sed "s|^|$file: |" || status=1
done
exit $status
