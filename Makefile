.PHONY: setup test demo bench
VENV := .venv/bin

setup:
	bash scripts/setup_env.sh

test: setup
	$(VENV)/python -m pytest -n 2 --dist loadgroup -q tests

demo: setup
	$(VENV)/python examples/scripts/ppo_sentiment.py

bench: setup
	$(VENV)/python benchmarks/bench_step.py
