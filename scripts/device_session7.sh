#!/usr/bin/env bash
# One device call of session 7's final checks (nvidia-h200-x2): every GPU test, the default bench-gemm
# table with the cuBLASLt peer (GPU 0), and the routed layer on qwen3-30b-a3b EP2 for this binary and
# dev-bin/megamoe_before in the same lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-s7}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000}
timeout 300 dev-bin/megamoe_gpu_tests > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: exit $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|pair quantisers" "$OUT/gpu_tests.log" | head -20
if [[ -z ${SKIP_GEMM_TABLE:-} ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 dev-bin/megamoe bench-gemm --iters 20 --json "$OUT/bench_gemm.json" \
    > "$OUT/bench_gemm.txt" 2>&1
  echo "bench-gemm: exit $?"; grep -vE "^#" "$OUT/bench_gemm.txt" | cut -c1-150
fi
for b in megamoe megamoe_before; do
  echo "== $b routed qwen3-30b-a3b EP2"
  timeout 240 dev-bin/$b bench --preset qwen3-30b-a3b --backend routed --ep 2 --tokens ${ROUTED_TOKENS:-8,128,1024,2048,4096} \
    --iters 30 --max-host-gb 120 > "$OUT/routed_$b.txt" 2>&1
  grep -vE "^\[bench\]" "$OUT/routed_$b.txt" | grep -E "^ *(routed|backend|#)|fc1|dispatch" | head -14
done
