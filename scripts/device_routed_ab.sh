#!/usr/bin/env bash
# Device checks of a routed-layer change: GPU tests by filter, then `megamoe bench` on the routed
# backend once per line of ROUTED (extra flags; an empty ARGS line runs the defaults), same lease.
#   FILTER='Sm90Routed*' ROUTED=$'--owner-reduce\n--combine-dtype bf16' bash scripts/device_routed_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" routed-ab
tests_if_filter; rc=$?
i=0
while IFS= read -r args; do
  i=$((i + 1))
  timeout ${BENCH_TIMEOUT:-240} $BIN/megamoe bench --preset ${PRESET:-qwen3-30b-a3b} --backend routed --ep ${EP:-2} \
    --tokens ${TOKENS:-8,128,1024,4096} --iters ${ITERS:-30} --max-host-gb 120 $args > "$OUT/routed$i.txt" 2>&1
  echo "== routed $args: exit $?"; grep -vE "^\[bench\]" "$OUT/routed$i.txt" | grep -E "^ *(routed|backend|#)|fc1|dispatch" | head -14
done <<< "${ROUTED:-}"
exit $rc
