#!/usr/bin/env bash
# Device checks of a routed-layer change: GPU tests by filter, then `megamoe bench` on the routed
# backend once per line of ROUTED (extra flags; an empty ARGS line runs the defaults), same lease.
#   FILTER='Sm90Routed*' ROUTED=$'--owner-reduce\n--combine-dtype bf16' bash scripts/device_routed_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-routed-ab}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=${BIN:-dev-bin}
rc=0
if [[ -n ${FILTER:-} ]]; then
  MEGAMOE_WAIT_TIMEOUT_MS=5000 timeout ${TEST_TIMEOUT:-240} $BIN/megamoe_gpu_tests --gtest_filter="$FILTER" > "$OUT/tests.log" 2>&1
  trc=$?; rc=$((rc | trc))
  echo "tests: exit $trc"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure|differs|rel-L2" "$OUT/tests.log" | head -40
fi
i=0
while IFS= read -r args; do
  i=$((i + 1))
  timeout ${BENCH_TIMEOUT:-240} $BIN/megamoe bench --preset ${PRESET:-qwen3-30b-a3b} --backend routed --ep 2 \
    --tokens ${TOKENS:-8,128,1024,4096} --iters ${ITERS:-30} --max-host-gb 120 $args > "$OUT/routed$i.txt" 2>&1
  echo "== routed $args: exit $?"; grep -vE "^\[bench\]" "$OUT/routed$i.txt" | grep -E "^ *(routed|backend|#)|fc1|dispatch" | head -14
done <<< "${ROUTED:-}"
exit $rc
