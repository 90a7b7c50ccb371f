#!/usr/bin/env bash
# Ad-hoc device checks of one change: GPU tests by filter, then a bench-transport sweep of the new
# binary and (when present) $BIN/megamoe_before, or the binaries named in BINS, same arguments, same
# lease.
#   FILTER='Sm90Transport.*' BENCH='--tokens 1,8,128 --combine mxfp8' bash scripts/device_quick.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" quick-out
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
    timeout ${BENCH_TIMEOUT:-90} $BIN/$b bench-transport --ranks 2 --dispatch fp8 --iters 10 --warmup 2 \
      --graph-iters 16 --graph-reps 3 $args > "$OUT/bench${i}_$b.log" 2>&1
    echo "== $b $args: exit $?"; grep -A12 -i amortised "$OUT/bench${i}_$b.log" | head -14
  done
done <<< "${BENCH:-}"
exit $rc
