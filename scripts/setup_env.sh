#!/usr/bin/env bash
# Creates .venv and installs trl_lite with everything the tests, demo and benchmarks need.
# On machines without CUDA the CPU build torch==2.13.0 is installed first, so that no range
# in the dependencies pulls the newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
fi
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # DeepSpeed compiles its CPU collective op on first use (about a minute); do it once here, not in a test.
  python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
fi
