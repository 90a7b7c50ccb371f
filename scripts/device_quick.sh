#!/usr/bin/env bash
# Ad-hoc device checks of one change: GPU tests by filter, then a bench-transport sweep of the new
# binary and (when present) $BIN/megamoe_before, or the binaries named in BINS, same arguments, same
# lease.
#   FILTER='Sm90Transport.*' BENCH='--tokens 1,8,128 --combine mxfp8' bash scripts/device_quick.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" quick-out
tests_if_filter; rc=$?
bench() {  # index binary args
  timeout ${BENCH_TIMEOUT:-90} $BIN/$2 bench-transport --ranks 2 --dispatch fp8 --iters 10 --warmup 2 \
    --graph-iters 16 --graph-reps 3 $3 > "$OUT/bench$1_$2.log" 2>&1
  echo "== $2 $3: exit $?"; grep -A12 -i amortised "$OUT/bench$1_$2.log" | head -14
}
for_lines_and_bins "${BENCH:-}" bench
exit $rc
