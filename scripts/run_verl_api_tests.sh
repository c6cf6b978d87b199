#!/usr/bin/env bash
# Run verl 0.9.1's own CPU unit tests of the verl API surface against THIS package (not part of CI).
#
# Downloads the verl 0.9.1 wheel (PyPI, no dependencies), copies its tests of the protocol, core_algos, loss
# aggregation, value-loss normalisation, rollout correction, the @register decorator, the tool API (verl.tools:
# function tools, the tool-config loader), the tool parsers and the tool agent loop (tool calls, tool-call ids)
# into a scratch directory outside the repo, and runs them with this repository's interpreter, so that
# `import verl` resolves to this checkout.
# The tool tests keep verl's layout (tests/tools/ as a package, beside its _stub_search_tools.py), since they
# import `tests.tools._stub_search_tools`. One of them needs what this package lacks: verl's per-component
# config files (verl/trainer/config/rollout/rollout.yaml, read from the working directory).
# Usage: scripts/run_verl_api_tests.sh [extra pytest args]     (PYTHON=... to pick the interpreter)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download verl==0.9.1 --no-deps --only-binary=:all: -d "$work/wheel" -q
"$python" -m zipfile -e "$work"/wheel/verl-0.9.1-*.whl "$work/src"

mkdir -p "$work/tests"
for test in \
    tests/test_protocol_on_cpu.py \
    tests/trainer/ppo/test_core_algos_on_cpu.py \
    tests/experimental/agent_loop/test_qwen3_tool_parser_on_cpu.py \
    tests/experimental/agent_loop/test_call_tool_on_cpu.py \
    tests/experimental/agent_loop/test_tool_call_id_on_cpu.py \
    tests/trainer/ppo/test_loss_aggregation_on_cpu.py \
    tests/trainer/ppo/test_value_loss_normalization_on_cpu.py \
    tests/trainer/ppo/test_rollout_corr.py \
    tests/single_controller/test_decorator_on_cpu.py; do
    cp "$work/src/$test" "$work/tests/"
done
mkdir -p "$work/tool_tests/tests/tools"
for file in tests/__init__.py tests/tools/__init__.py tests/tools/_stub_search_tools.py \
    tests/tools/test_function_tool_on_cpu.py \
    tests/tools/test_mixed_tools_on_cpu.py; do
    cp "$work/src/$file" "$work/tool_tests/$file"
done

cd "$work/tests"  # outside the repo: `import verl` must find this checkout (installed editable), not the wheel
"$python" -c "import verl, sys; print('verl from', verl.__file__); sys.exit(not verl.__file__.startswith('$repo'))"
"$python" -m pytest "$work/tests" "$work/tool_tests" -q -p no:cacheprovider "$@"
