#!/usr/bin/env bash
# Runs on the H200 machine (nvidia-h200-x2) with the binaries built here carried in dev-bin/:
#   dev-bin/megamoe, dev-bin/megamoe_gpu_tests
# Usage: bash scripts/device_routed.sh [tests|check|bench|all|table]   (logs under $OUT)
set -uo pipefail
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BIN=dev-bin
what=${1:-all}
nvidia-smi -L | tee "$OUT/gpus.txt"

if [[ $what == tests || $what == all ]]; then
  timeout 420 $BIN/megamoe_gpu_tests --gtest_filter="${GTEST_FILTER:-*}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[routed\]|FAILED|rel-L2" | head -120
fi
if [[ $what == check || $what == all ]]; then
  for args in "--preset tiny --ep 1 --tokens 64" "--preset tiny --ep 2 --tokens 64" \
              "--preset qwen3-30b-a3b --ep 2 --tokens 64" "--preset deepseek-v3 --experts 16 --ep 2 --tokens 8"; do
    echo "== megamoe check --backend routed $args"
    timeout 300 $BIN/megamoe check --backend routed $args 2>&1 | tail -6
  done 2>&1 | tee "$OUT/check.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 300 $BIN/megamoe bench --preset qwen3-30b-a3b --backend routed --ep 2 --tokens 8,128,1024 --iters 30 \
    --json "$OUT/bench_qwen3_ep2.json" 2>&1 | tee "$OUT/bench.log" | tail -8
fi
# The table (deepseek-v3 and qwen3-30b-a3b, EP1 and EP2, 1..8192 tokens/rank); PRESETS and
# EPS pick a part of it so each device call stays under its 10-minute limit.
# The 2-GPU machine's MemTotal reads ~31 GiB at start and grows on use, hence --max-host-gb.
if [[ $what == table ]]; then
  TOK=${TOKENS:-1,8,64,128,512,1024,2048,4096,8192}
  for preset in ${PRESETS:-deepseek-v3 qwen3-30b-a3b}; do
    for ep in ${EPS:-1 2}; do
      echo "== $preset EP$ep"
      timeout 540 $BIN/megamoe bench --preset $preset --backend routed --ep $ep --tokens $TOK --iters 20 --warmup 5 \
        --max-host-gb 120 --json "$OUT/bench_${preset}_ep${ep}.json" 2>&1 | tee "$OUT/bench_${preset}_ep${ep}.log" | \
        grep -vE "^\[bench\]" | tail -24
    done
  done
fi
