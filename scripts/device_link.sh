#!/usr/bin/env bash
# NVLink paths between the two GPUs of an nvidia-h200-x2 machine (`megamoe bench-link`), several shapes.
# Usage (device): OUT=... bash scripts/device_link.sh   (binary: dev-bin/megamoe)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/megamoe-link}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])')/lib:/usr/local/cuda/lib64:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=dev-bin/megamoe
$B bench-link 2>&1 | tee $OUT/link1.log
$B bench-link --paths tma,staged,store --chunk 4096 --stages 8 --tma-warps 4 --staged-warps 16 2>&1 | grep -v "^#"
$B bench-link --paths tma --chunk 16384 --stages 3 --tma-warps 4 2>&1 | grep -v "^#"
$B bench-link --paths tma --chunk 8192 --stages 2 --tma-warps 8 2>&1 | grep -v "^#"
$B bench-link --paths tma,staged --chunk 2048 --stages 8 --tma-warps 8 --staged-warps 16 2>&1 | grep -v "^#"
$B bench-link --paths store,pull --store-ctas-per-sm 1 2>&1 | grep -v "^#"
$B bench-link --paths store,pull,tma --store-ctas-per-sm 4 --mib 64 2>&1 | grep -v "^#"
