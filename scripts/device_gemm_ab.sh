#!/usr/bin/env bash
# A/B of the grouped GEMM on one H200 (device machine): `megamoe bench-gemm` of each binary in BINS
# (default: dev-bin/megamoe and dev-bin/megamoe_before), alternated ROUNDS times (default 2) in one
# lease, for each argument line of BENCH; the GEMM tests first when FILTER is set.
#   FILTER='*GroupedGemm*' BENCH=$'--preset qwen3-30b-a3b --fc fc1,fc2\n--preset deepseek-v3 --experts 32' \
#     bash scripts/device_gemm_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" gemm-ab
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
rc=0
if [[ -n ${FILTER:-} ]]; then
  run_tests "$FILTER"; rc=$((rc | $?))
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
      grep -vE "^#" "$OUT/gemm${i}_r${round}_$b.log" | cut -c1-175
    done
  done
done <<< "${BENCH:-}"
exit $rc
