#!/usr/bin/env bash
# The launched benches' host barrier is bounded (nvidia-h200-x2): rank 1 of `megamoe launch -n 2 --
# megamoe bench` is stopped (SIGSTOP) in the middle of its timed forwards; rank 0 must report the
# barrier (or its bounded transport wait) and exit, and the launch must end on its own, well inside
# the outer timeout, with a non-zero code.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-barrier}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 MEGAMOE_BARRIER_TIMEOUT_MS=${MEGAMOE_BARRIER_TIMEOUT_MS:-3000}
timeout 180 dev-bin/megamoe launch -n 2 -- dev-bin/megamoe bench --preset qwen3-30b-a3b --backend routed --ep 2 \
  --tokens 8 --iters 1000000 --warmup 1 --max-host-gb 100 > "$OUT/barrier.log" 2>&1 &
LPID=$!
# the timed loop reports progress every 2 s; stop rank 1 once it is running
for _ in $(seq 1 120); do grep -q "forwards (" "$OUT/barrier.log" 2>/dev/null && break; kill -0 $LPID 2>/dev/null || break; sleep 1; done
sleep 3
R1=$(pgrep -P "$(pgrep -P $LPID | head -1)" 2>/dev/null | sed -n 2p)
[[ -z $R1 ]] && R1=$(pgrep -f "dev-bin/megamoe bench" | sort -n | sed -n 2p)
echo "stopping rank 1 (pid $R1) at $(date +%T)"; kill -STOP "$R1"
t0=$(date +%s); wait $LPID; rc=$?; t1=$(date +%s)
echo "launch exited with $rc, $((t1 - t0)) s after rank 1 stopped"
grep -vE "^\[bench\] +[0-9]+/" "$OUT/barrier.log" | tail -8
