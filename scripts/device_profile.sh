#!/usr/bin/env bash
# Nsight Compute on the device machine (when `ncu` is there): one launch of the grouped GEMM at the
# deepseek-v3 FC1 shape (128 experts x 512 rows), tensor-pipe activity, L2 throughput and warp
# stall reasons. Binaries in dev-bin/ (see device_gemm.sh). Usage: bash scripts/device_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/profile-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [[ -z $NCU ]]; then echo "no ncu on this machine"; exit 0; fi
"$NCU" --version | tail -1
for fc in ${FCS:-fc1 fc2}; do
  timeout 240 "$NCU" --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,sm__warps_active.avg.pct_of_peak_sustained_active \
    dev-bin/megamoe bench-gemm --preset deepseek-v3 --experts 128 --tokens 512 --fc $fc --no-cublas --no-swiglu \
    --iters 3 --warmup 1 > "$OUT/ncu_$fc.txt" 2>&1
  grep -E "gmma|lts__t_bytes|Duration|Throughput|Stall|stall|Warp Cycles|Issued|L2 Cache|ERR|rror" "$OUT/ncu_$fc.txt" | head -40
done
