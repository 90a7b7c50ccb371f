#!/usr/bin/env bash
# A/B of a layer change on the device machine: GPU tests by filter (when FILTER is set), then `megamoe
# bench` of each binary in BINS (default dev-bin/megamoe and dev-bin/megamoe_before) for each line of
# CASES (flags appended to `bench --backend routed --iters ITERS --max-host-gb 120`), binaries
# alternated within a line, the rows printed.
#   CASES=$'--preset qwen3-30b-a3b --ep 2 --tokens 1,8,128' bash scripts/device_layer_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" layer-ab
rc=0
if [[ -n ${FILTER:-} ]]; then
  run_tests "$FILTER"; rc=$((rc | $?))
fi
i=0
while IFS= read -r args; do
  [[ -z $args ]] && continue
  i=$((i + 1))
  for b in ${BINS:-megamoe megamoe_before}; do
    [[ -x $BIN/$b ]] || continue
    timeout ${BENCH_TIMEOUT:-240} $BIN/$b bench --backend routed --iters ${ITERS:-50} --max-host-gb 120 $args \
      > "$OUT/layer${i}_$b.txt" 2>&1
    echo "== $b $args: exit $?"; grep -E "^ *routed" "$OUT/layer${i}_$b.txt" | cut -c1-110 | head -8
  done
done <<< "${CASES:-}"
exit $rc
