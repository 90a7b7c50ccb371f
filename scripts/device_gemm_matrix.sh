#!/usr/bin/env bash
# The grouped GEMM against issue 5's targets on one H200 (device machine). Three parts:
#   1. scripts/device_read_floor.py: PyTorch reading the decode weight sets, a reference for the floor;
#   2. the whole `megamoe bench-gemm` matrix (deepseek-v3 32 / 128 experts at 8-2048 rows per expert,
#      qwen3-30b-a3b 64 experts at 8-1024) in one process after the memset flush, with the SwiGLU rows
#      and the cuBLASLt peer; then again after the read flush without them;
#   3. each shape the issue sets a target for in a process of its own (as a one-shape harness times
#      it: no longer launch runs before it), ROUNDS times (default 3), cases alternated; the decode
#      shapes after both flushes.
# scripts/gemm_targets.py folds the JSON into tables (targets_*.md). $OUT comes back as out.tgz.
#   bash scripts/device_gemm_matrix.sh [matrix] [alone]     (default: both)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" gemm-matrix
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
parts=${*:-matrix alone}
rc=0
gpu_state() { nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv,noheader; }
bench() {  # json-file args...
  local json=$1; shift
  timeout ${BENCH_TIMEOUT:-280} $BIN/megamoe bench-gemm --iters "${ITERS:-20}" --json "$json" "$@" > "${json%.json}.log" 2>&1
  local brc=$?
  [[ $brc -eq 0 ]] || { rc=1; echo "bench-gemm $*: exit $brc"; tail -5 "${json%.json}.log"; }
}
echo "before: $(gpu_state)" | tee "$OUT/gpu.txt"
if [[ $parts == *matrix* ]]; then
  timeout ${FLOOR_TIMEOUT:-120} python3 scripts/device_read_floor.py "${ITERS:-20}" > "$OUT/read_floor.log" 2>&1 || rc=1
  grep -v Warning "$OUT/read_floor.log" | grep -v _warn_once
  bench "$OUT/matrix_memset.json" --flush memset
  bench "$OUT/matrix_read.json" --flush read --no-swiglu --no-cublas
  for f in memset read; do python3 scripts/gemm_targets.py "$OUT/matrix_$f.json" > "$OUT/targets_matrix_$f.md"; done
  echo "after the matrix: $(gpu_state)" | tee -a "$OUT/gpu.txt"
fi
if [[ $parts == *alone* ]]; then
  cases=(
    "--preset deepseek-v3 --experts 32 --tokens 512 --fc fc1"
    "--preset deepseek-v3 --experts 32 --tokens 512 --fc fc2"
    "--preset deepseek-v3 --experts 32 --tokens 2048 --fc fc1"
    "--preset deepseek-v3 --experts 32 --tokens 2048 --fc fc2"
    "--preset deepseek-v3 --experts 128 --tokens 128 --fc fc1"
    "--preset deepseek-v3 --experts 128 --tokens 512 --fc fc1"
    "--preset deepseek-v3 --experts 128 --tokens 512 --fc fc2"
    "--preset deepseek-v3 --experts 128 --tokens 2048 --fc fc1"
    "--preset deepseek-v3 --experts 128 --tokens 2048 --fc fc2"
    "--preset qwen3-30b-a3b --tokens 256 --fc fc1"
    "--preset qwen3-30b-a3b --tokens 256 --fc fc2"
    "--preset deepseek-v3 --tokens 8,32"
    "--preset qwen3-30b-a3b --tokens 8,32"
  )
  for round in $(seq 1 ${ROUNDS:-3}); do
    for i in "${!cases[@]}"; do
      bench "$OUT/alone_memset_c${i}_r$round.json" ${cases[$i]} --no-swiglu --flush memset
      [[ ${cases[$i]} == *"8,32"* ]] && bench "$OUT/alone_read_c${i}_r$round.json" ${cases[$i]} --no-swiglu --no-cublas --flush read
    done
    echo "after round $round: $(gpu_state)" | tee -a "$OUT/gpu.txt"
  done
  for f in memset read; do python3 scripts/gemm_targets.py "$OUT"/alone_${f}_*.json > "$OUT/targets_alone_$f.md"; done
fi
for t in "$OUT"/targets_*.md; do echo "== $(basename "$t")"; cat "$t"; done
pack_out
exit $rc
