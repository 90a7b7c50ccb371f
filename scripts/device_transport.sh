#!/usr/bin/env bash
# EP transport on the H200 machine: GPU tests, compute-sanitizer passes, benchmark.
# Build here first (see docs/TRANSPORT.md), copy the binaries to dev-bin/, then on the device:
#   bash scripts/device_transport.sh tests|sanitize|bench|launch|perf|all      (logs go to $OUT)
# perf = tests + bench (gated and graph-amortised tables) [+ the same bench of $BIN/megamoe_before
# when that binary exists: an earlier build to compare against in the same lease].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-transport-out}
mkdir -p "$OUT"
NCCL_LIB=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib
export LD_LIBRARY_PATH=${NCCL_LIB}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=${BIN:-dev-bin}
TESTS="$BIN/megamoe_gpu_tests --gtest_filter=Sm90Transport.*"
TOOL=${TOOL:-$BIN/megamoe}   # the tool (megamoe launch / bench-transport)
what=${1:-all}
rc=0
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1

BENCH_ARGS="--ranks 2 --tokens 1,8,128,512,1024,4096,8192 --dispatch fp8 --combine bf16"
if [[ $what == tests || $what == all || $what == perf ]]; then
  timeout 150 $TESTS > "$OUT/tests.log" 2>&1; trc=$?; rc=$((rc | trc))
  echo "tests: exit $trc"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure|differs" "$OUT/tests.log" | head -40
fi
if [[ $what == bench || $what == all ]]; then
  timeout 100 $TOOL bench-transport $BENCH_ARGS --iters 20 --warmup 3 \
    2>&1 | tee "$OUT/bench_fp8_bf16.log"; rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == perf ]]; then
  timeout 75 $TOOL bench-transport $BENCH_ARGS --iters 10 --warmup 2 --graph-iters 32 --graph-reps 3 \
    2>&1 | tee "$OUT/bench_fp8_bf16.log"; rc=$((rc | PIPESTATUS[0]))
  if [[ -x $BIN/megamoe_before ]]; then
    timeout 75 $BIN/megamoe_before bench-transport $BENCH_ARGS --iters 10 --warmup 2 --graph-iters 32 --graph-reps 3 \
      > "$OUT/bench_before.log" 2>&1; echo "before: exit $?"; grep -A9 amortised "$OUT/bench_before.log"
  fi
fi
if [[ $what == launch || $what == all ]]; then
  # One process per GPU through `megamoe launch` (MEGAMOE_NCCL_ID_FILE bootstrap).
  timeout 45 $TOOL launch -n 2 -- $TOOL bench-transport --tokens 8,8192 --iters 10 --warmup 2 2>&1 | tee "$OUT/launch.log"
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == sanitize ]]; then
  export MEGAMOE_WAIT_TIMEOUT_MS=30000
  SUB="--gtest_filter=${SANITIZE_FILTER:-Sm90Transport.Bf16Wire*:Sm90Transport.Nvfp4*}"
  for tool in memcheck racecheck synccheck; do
    timeout ${SANITIZE_TIMEOUT:-45} compute-sanitizer --tool $tool --print-limit 20 $BIN/megamoe_gpu_tests $SUB \
      > "$OUT/sanitize_$tool.log" 2>&1
    echo "$tool: exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi
exit $rc
