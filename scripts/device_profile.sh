#!/usr/bin/env bash
# Nsight Compute on the device machine (when `ncu` is there): one launch of the grouped GEMM.
#   MODE=sections (default): SpeedOfLight, WarpStateStats, MemoryWorkloadAnalysis of FC1/FC2 at the
#                 deepseek-v3 shape (128 experts x 512 rows), FCS picks fc1 and/or fc2.
#   MODE=metrics: exact byte counts (DRAM read/write, L2 reads from the SMs and their hits, L2 fabric
#                 traffic) and tensor-pipe activity for each "experts:rows:fc" in CASES.
# Binaries in $BIN (default dev-bin/, see device_gemm.sh). Usage: bash scripts/device_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/profile-out}
BIN=${BIN:-dev-bin}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
if [[ -z $NCU ]]; then echo "no ncu on this machine"; exit 0; fi
"$NCU" --version | tail -1
if [[ ${MODE:-sections} == metrics ]]; then
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
  METRICS+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
  METRICS+=,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_op_write.sum
  METRICS+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
  METRICS+=,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
  for c in ${CASES:-128:512:fc1 32:512:fc1}; do
    IFS=: read -r experts rows fc <<< "$c"
    echo "## $BIN experts=$experts rows=$rows $fc ${EXTRA:-}"
    timeout 200 "$NCU" --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
      "$BIN/megamoe" bench-gemm --preset deepseek-v3 --experts "$experts" --tokens "$rows" --fc "$fc" --no-cublas \
      --no-swiglu --iters 3 --warmup 1 ${EXTRA:-} > "$OUT/ncu_${experts}_${rows}_$fc.txt" 2>&1
    grep -E "^\s+(gpu__|dram__|lts__|sm__)|ERR|rror" "$OUT/ncu_${experts}_${rows}_$fc.txt" | head -20
  done
  exit 0
fi
for fc in ${FCS:-fc1 fc2}; do
  timeout 240 "$NCU" --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$BIN/megamoe" bench-gemm --preset deepseek-v3 --experts 128 --tokens 512 --fc $fc --no-cublas --no-swiglu \
    --iters 3 --warmup 1 > "$OUT/ncu_$fc.txt" 2>&1
  grep -E "gmma|lts__t_bytes|Duration|Throughput|Stall|stall|Warp Cycles|Issued|L2 Cache|ERR|rror" "$OUT/ncu_$fc.txt" | head -40
done
