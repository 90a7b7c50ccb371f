#!/usr/bin/env bash
# A/B of the grouped GEMM on one H200 (device machine): `megamoe bench-gemm` of each binary in BINS
# (default: dev-bin/megamoe and dev-bin/megamoe_before), alternated, for each argument line of BENCH,
# all of it ROUNDS times (default 2) in one lease; the GEMM tests first when FILTER is set.
#   FILTER='*GroupedGemm*' BENCH=$'--preset qwen3-30b-a3b --fc fc1,fc2\n--preset deepseek-v3 --experts 32' \
#     bash scripts/device_gemm_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" gemm-ab
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
tests_if_filter; rc=$?
bench() {  # index binary args (and $round)
  timeout ${BENCH_TIMEOUT:-120} $BIN/$2 bench-gemm --no-cublas --iters ${ITERS:-20} $3 > "$OUT/gemm$1_r${round}_$2.log" 2>&1
  echo "== $2 (round $round) $3: exit $?"
  grep -vE "^#" "$OUT/gemm$1_r${round}_$2.log" | cut -c1-175
}
for round in $(seq 1 ${ROUNDS:-2}); do for_lines_and_bins "${BENCH:-}" bench; done
exit $rc
