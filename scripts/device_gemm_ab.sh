#!/usr/bin/env bash
# A/B of the grouped GEMM on one H200 (device machine): `megamoe bench-gemm` of each binary in BINS
# (default: dev-bin/megamoe and dev-bin/megamoe_before), alternated ROUNDS times (default 2) in one
# lease, for each argument line of BENCH; the GEMM tests first when FILTER is set.
#   FILTER='*GroupedGemm*' BENCH=$'--preset qwen3-30b-a3b --fc fc1,fc2\n--preset deepseek-v3 --experts 32' \
#     bash scripts/device_gemm_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-gemm-ab}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
BIN=${BIN:-dev-bin}
rc=0
if [[ -n ${FILTER:-} ]]; then
  timeout ${TEST_TIMEOUT:-300} $BIN/megamoe_gpu_tests --gtest_filter="$FILTER" > "$OUT/tests.log" 2>&1; trc=$?; rc=$((rc | trc))
  echo "tests: exit $trc"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure" "$OUT/tests.log" | head -40
fi
i=0
while IFS= read -r args; do
  [[ -z $args ]] && continue
  i=$((i + 1))
  for round in $(seq 1 ${ROUNDS:-2}); do
    for b in ${BINS:-megamoe megamoe_before}; do
      [[ -x $BIN/$b ]] || continue
      timeout ${BENCH_TIMEOUT:-120} $BIN/$b bench-gemm --no-cublas --iters ${ITERS:-20} $args > "$OUT/gemm${i}_r${round}_$b.log" 2>&1
      echo "== $b (round $round) $args: exit $?"
      grep -vE "^#" "$OUT/gemm${i}_r${round}_$b.log" | cut -c1-120
    done
  done
done <<< "${BENCH:-}"
exit $rc
