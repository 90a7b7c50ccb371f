#!/usr/bin/env bash
# One device call of session 8's final checks (nvidia-h200-x2): every GPU test, compute-sanitizer
# (memcheck, racecheck, synccheck) on the dispatch- and combine-heavy transport tests, bench-transport
# (the default sweep; mxfp8 with an fp8 input; a bf16 dispatch at 4096 / 8192) for this binary and, at
# small T, dev-bin/megamoe_before, the handshake floor, and the routed layer on qwen3-30b-a3b EP2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-s8}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
MEGAMOE_WAIT_TIMEOUT_MS=5000 timeout 300 dev-bin/megamoe_gpu_tests > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: exit $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gpu_tests.log" | head -20
SUB="--gtest_filter=${SANITIZE_FILTER:-Sm90Transport.Fp8Wire_Bf16Combine_EP2:Sm90Transport.ManyTokensPerCta_FewSms_EP2:Sm90Transport.Mxfp8Combine_EP2}"
for tool in memcheck racecheck synccheck; do
  MEGAMOE_WAIT_TIMEOUT_MS=30000 timeout ${SANITIZE_TIMEOUT:-90} compute-sanitizer --tool $tool --print-limit 20 \
    dev-bin/megamoe_gpu_tests $SUB > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool: exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|PASSED|FAILED' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
done
T="dev-bin/megamoe bench-transport --ranks 2 --iters 10 --warmup 2 --graph-iters 16 --graph-reps 3"
$T --tokens 1,8,128,512,1024,4096,8192 --dispatch fp8 > "$OUT/transport_fp8.txt" 2>&1; echo "transport fp8: exit $?"
grep -vE "^# (amortised|no-event)" "$OUT/transport_fp8.txt" | cut -c1-250
$T --tokens 1,8,128 --dispatch fp8 --x fp8 --combine mxfp8 > "$OUT/transport_mx.txt" 2>&1; echo "transport mxfp8: exit $?"
grep -A4 -i amortised "$OUT/transport_mx.txt" | tail -3 | cut -c1-250
$T --tokens 4096,8192 --dispatch bf16 > "$OUT/transport_bf16.txt" 2>&1; echo "transport bf16 dispatch: exit $?"
grep -vE "^# (amortised|no-event)" "$OUT/transport_bf16.txt" | cut -c1-250
if [[ -x dev-bin/megamoe_before ]]; then
  for b in megamoe megamoe_before; do
    dev-bin/$b bench-transport --ranks 2 --iters 10 --warmup 2 --graph-iters 16 --graph-reps 3 --tokens 1,8,128 \
      --dispatch fp8 > "$OUT/ab_$b.txt" 2>&1
    echo "== $b small T: exit $?"; grep -A5 -i amortised "$OUT/ab_$b.txt" | tail -3 | cut -c1-250
  done
fi
dev-bin/megamoe bench-link --mib 1 --paths handshake,handshake-grid --iters 10 2>&1 | tail -2
timeout 240 dev-bin/megamoe bench --preset qwen3-30b-a3b --backend routed --ep 2 --tokens ${ROUTED_TOKENS:-8,128,1024,4096} \
  --iters 30 --max-host-gb 120 > "$OUT/routed.txt" 2>&1
echo "routed: exit $?"; grep -vE "^\[bench\]" "$OUT/routed.txt" | grep -E "^ *(routed|backend|#)|fc1|dispatch" | head -14
