#!/usr/bin/env bash
# A/B of the grouped GEMM on one H200 (device machine): `megamoe bench-gemm` of each binary in BINS
# (default: dev-bin/megamoe and dev-bin/megamoe_before), alternated, for each argument line of BENCH,
# all of it ROUNDS times (default 2) in one lease; the GEMM tests first when FILTER is set.
#   FILTER='*GroupedGemm*' BENCH=$'--preset qwen3-30b-a3b --fc fc1,fc2\n--preset deepseek-v3 --experts 32' \
#     bash scripts/device_gemm_ab.sh
# "@OUT@", "@ROUND@" and "@BIN@" in a BENCH line stand for $OUT, the round and the binary (each binary
# writes its own file: `--trace @OUT@/trace_@BIN@.json`); "VAR=value ... -- args" sets environment
# variables for that line. $OUT comes back as out.tgz.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" gemm-ab
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
tests_if_filter; rc=$?
bench() {  # index binary args (and $round)
  local args=${3//@OUT@/$OUT} envs=
  args=${args//@ROUND@/$round}
  args=${args//@BIN@/$2}
  if [[ $args == *" -- "* ]]; then envs=${args%% -- *}; args=${args#* -- }; fi
  timeout ${BENCH_TIMEOUT:-120} env $envs $BIN/$2 bench-gemm --no-cublas --iters ${ITERS:-20} $args > "$OUT/gemm$1_r${round}_$2.log" 2>&1
  echo "== $2 (round $round) $3: exit $?"
  grep -vE "^#" "$OUT/gemm$1_r${round}_$2.log" | grep -v "# trace" | cut -c1-175
  grep "# trace" "$OUT/gemm$1_r${round}_$2.log" | sed 's/^ *# trace/  trace/' 
}
for round in $(seq 1 ${ROUNDS:-2}); do for_lines_and_bins "${BENCH:-}" bench; done
[[ -f $OUT/tests.log ]] && { echo "== tests (again)"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran" "$OUT/tests.log" | tail -12; }
pack_out
exit $rc
