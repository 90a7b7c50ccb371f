#!/usr/bin/env bash
# What the 2-GPU machine allows of the EP4 / EP8 issue (nvidia-h200-x2): deepseek-v3 on the routed
# backend with one process per GPU (megamoe launch), EP2, at the issue's tokens per rank.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-issue4}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 MEGAMOE_WAIT_TIMEOUT_MS=5000
timeout ${LAUNCH_TIMEOUT:-420} dev-bin/megamoe launch -n 2 -- dev-bin/megamoe bench --preset deepseek-v3 --backend routed --ep 2 \
  --tokens ${TOKENS:-8,128,512,1024,2048,8192} --iters 20 --warmup 5 --max-host-gb 120 > "$OUT/launch_deepseek_ep2.log" 2>&1
echo "launch: exit $?"
grep -vE "^\[bench\]" "$OUT/launch_deepseek_ep2.log" | grep -E "^routed|stages|rank|error" | cut -c1-160 | head -40
