#!/usr/bin/env bash
# One device call of session 6's final checks (nvidia-h200-x2): every GPU test, the SwiGLU GEMM cases
# and the routed layer on qwen3-30b-a3b EP2, new binary against dev-bin/megamoe_before in the same lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-s6}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 MEGAMOE_WAIT_TIMEOUT_MS=5000
timeout 300 dev-bin/megamoe_gpu_tests > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests: exit $?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$OUT/gpu_tests.log" | head -20
for b in megamoe megamoe_before; do
  echo "== $b fc1+swiglu"
  CUDA_VISIBLE_DEVICES=0 timeout 120 dev-bin/$b bench-gemm --no-cublas --iters 20 --fc fc1 --preset qwen3-30b-a3b \
    --experts 64 --tokens 8,256,1024 2>&1 | grep swiglu
  CUDA_VISIBLE_DEVICES=0 timeout 120 dev-bin/$b bench-gemm --no-cublas --iters 20 --fc fc1 --preset deepseek-v3 \
    --experts 32,128 --tokens 32,512 2>&1 | grep swiglu
done
for b in megamoe megamoe_before; do
  echo "== $b routed qwen3-30b-a3b EP2"
  timeout 200 dev-bin/$b bench --preset qwen3-30b-a3b --backend routed --ep 2 --tokens 8,128,1024 --iters 30 \
    --max-host-gb 120 2>&1 | grep -vE "^\[bench\]" | grep -E "^ *(routed|backend|#)|fc1|dispatch" | head -12
done
