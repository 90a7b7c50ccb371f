#!/usr/bin/env bash
# Ad-hoc device checks of one change: GPU tests by filter, then a bench-transport sweep of the new
# binary and (when present) $BIN/megamoe_before, or the binaries named in BINS, same arguments, same
# lease.
#   FILTER='Sm90Transport.*' BENCH='--tokens 1,8,128 --combine mxfp8' bash scripts/device_quick.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-quick-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=${BIN:-dev-bin}
rc=0
if [[ -n ${FILTER:-} ]]; then
  timeout ${TEST_TIMEOUT:-240} $BIN/megamoe_gpu_tests --gtest_filter="$FILTER" > "$OUT/tests.log" 2>&1; trc=$?; rc=$((rc | trc))
  echo "tests: exit $trc"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure|differs" "$OUT/tests.log" | head -40
fi
i=0
while IFS= read -r args; do
  [[ -z $args ]] && continue
  i=$((i + 1))
  for b in ${BINS:-megamoe megamoe_before}; do
    [[ -x $BIN/$b ]] || continue
    timeout ${BENCH_TIMEOUT:-90} $BIN/$b bench-transport --ranks 2 --dispatch fp8 --iters 10 --warmup 2 \
      --graph-iters 16 --graph-reps 3 $args > "$OUT/bench${i}_$b.log" 2>&1
    echo "== $b $args: exit $?"; grep -A12 -i amortised "$OUT/bench${i}_$b.log" | head -14
  done
done <<< "${BENCH:-}"
exit $rc
