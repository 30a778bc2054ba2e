# Quickstart targets (see README.md). Both set up .venv first (idempotent).
.PHONY: setup train test test-vllm test-gpu

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/asyncrl train $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -n 2 --durations=25

test-vllm: setup
	.venv/bin/python -m pytest -q -m vllm

test-gpu: setup
	.venv/bin/python -m pytest -q -m gpu -rs
