#!/usr/bin/env bash
# A/B of a layer change on the device machine: GPU tests by filter (when FILTER is set), then `megamoe
# bench` of each binary in BINS (default dev-bin/megamoe and dev-bin/megamoe_before) for each line of
# CASES (flags appended to `bench --backend routed --iters ITERS --max-host-gb 120`), binaries
# alternated within a line, the rows printed.
#   CASES=$'--preset qwen3-30b-a3b --ep 2 --tokens 1,8,128' bash scripts/device_layer_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" layer-ab
tests_if_filter; rc=$?
bench() {  # index binary args
  timeout ${BENCH_TIMEOUT:-240} $BIN/$2 bench --backend routed --iters ${ITERS:-50} --max-host-gb 120 $3 \
    > "$OUT/layer$1_$2.txt" 2>&1
  echo "== $2 $3: exit $?"; grep -E "^ *routed" "$OUT/layer$1_$2.txt" | cut -c1-110 | head -8
}
for_lines_and_bins "${CASES:-}" bench
exit $rc
