#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck on the GPU tests matching FILTER (device machine).
#   FILTER='Sm90Transport.OwnerReduce_EveryWire_EP2' bash scripts/device_sanitize.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" sanitize
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  MEGAMOE_WAIT_TIMEOUT_MS=30000 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 \
    $BIN/megamoe_gpu_tests --gtest_filter="${FILTER:?set FILTER}" > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool: exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|PASSED|FAILED' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
done
