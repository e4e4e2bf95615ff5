.PHONY: setup test demo bench gpu-check
VENV := .venv/bin

# Does nothing while .venv matches setup.cfg and the set-up script; `make setup FORCE=1` redoes it.
setup:
	bash scripts/setup_env.sh

test: setup
	$(VENV)/python -m pytest -n 2 --dist loadgroup -q tests

demo: setup
	$(VENV)/python examples/scripts/ppo_sentiment.py

bench: setup
	$(VENV)/python benchmarks/bench_step.py

# On a GPU machine: the checks a first GPU session must run, as one table (refuses without a GPU).
gpu-check: setup
	$(VENV)/python scripts/gpu_check.py
