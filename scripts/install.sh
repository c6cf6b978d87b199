#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install verl with its test extras.
# torch is installed first from the pinned CPU wheel so that no dependency can pull a CUDA build.
# Usage: bash scripts/install.sh [extra,...]   (default extras: test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$py" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
"$py" -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "is ignored" || true
"$py" -c "import torch, verl; assert torch.__version__.startswith('2.13'), torch.__version__; print('verl installed, torch', torch.__version__)"
