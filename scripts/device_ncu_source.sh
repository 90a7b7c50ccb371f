#!/usr/bin/env bash
# Nsight Compute per-instruction stall samples (SASS) of one grouped-GEMM launch: the kernel whose
# mangled name matches KERNEL (default: the fp8 SwiGLU epilogue configurations), under the bench-gemm
# arguments ARGS, of dev-bin/$BINARY (default megamoe). Writes $OUT/source.csv (one row per SASS
# instruction) and the warp-state summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-ncu}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [[ -z $NCU ]]; then echo "no ncu on this machine"; exit 0; fi
KERNEL=${KERNEL:-ELb1ELi1EE}
ARGS=${ARGS:---preset qwen3-30b-a3b --experts 64 --tokens 1024 --fc fc1 --no-cublas --iters 2 --warmup 1}
timeout 300 "$NCU" --kernel-name-base mangled --kernel-name "regex:$KERNEL" --launch-skip 1 --launch-count 1 --section SourceCounters \
  --section WarpStateStats --export "$OUT/prof" dev-bin/${BINARY:-megamoe} bench-gemm $ARGS > "$OUT/ncu.txt" 2>&1
echo "ncu: exit $?"; grep -E "==PROF==|rror" "$OUT/ncu.txt" | head -5
"$NCU" --import "$OUT/prof.ncu-rep" --page source --print-source sass --csv > "$OUT/source.csv" 2>&1
echo "source page: exit $?, $(wc -l < "$OUT/source.csv") lines"
"$NCU" --import "$OUT/prof.ncu-rep" --section WarpStateStats --page details > "$OUT/warpstate.txt" 2>&1
grep -iE "stall|cycles per" "$OUT/warpstate.txt" | head -30
rm -f "$OUT/prof.ncu-rep"
