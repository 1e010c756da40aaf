# The README's two commands. Each sets up .venv on first use (scripts/setup_env.sh).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint format bench

setup:
	@scripts/setup_env.sh

demo: setup
	@$(VENV)/bin/kvtransport demo $(ARGS)

lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(PY) scripts/typecheck.py

format: setup
	@$(VENV)/bin/ruff format .
	@$(VENV)/bin/ruff check --fix .

test: lint
	@PY=$(PY) scripts/run_tests.sh $(ARGS)

bench: setup
	@for b in scripts/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
