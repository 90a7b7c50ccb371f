# Sourced by the device scripts (scripts/device_*.sh): the repository root as the working directory,
# $OUT (created; default /tmp/megamoe-$1), NCCL from PyTorch's environment on the library path, NVLink
# multicast off, $BIN (default dev-bin), MEGAMOE_CUPTI_LIB (a libcupti found there), and
# run_tests FILTER: the GPU tests matching it, their summary printed, their exit status returned.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/megamoe-$1}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=${BIN:-dev-bin}
# libcupti for bench-gemm's kernel times (PyTorch's environment ships one; the toolkit may too).
if [[ -z ${MEGAMOE_CUPTI_LIB:-} ]]; then
  for d in $(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null) /usr/local/cuda/lib64 \
           /usr/local/cuda/extras/CUPTI/lib64; do
    f=$(find "$d" -name 'libcupti.so*' 2>/dev/null | head -1)
    if [[ -n $f ]]; then export MEGAMOE_CUPTI_LIB=$f; break; fi
  done
fi

run_tests() {
  MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout ${TEST_TIMEOUT:-240} $BIN/megamoe_gpu_tests \
    --gtest_filter="$1" > "$OUT/tests.log" 2>&1
  local trc=$?
  echo "tests: exit $trc"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure|differs|rel-L2" "$OUT/tests.log" | head -40
  return $trc
}
