# shellcheck shell=bash
# The device machine's environment, sourced by scripts/device.sh (and by any run script that wants
# the same lines): the repository root as the working directory, $OUT (created; default
# /tmp/megamoe-$1), NCCL from PyTorch's environment on the library path, NVLink multicast off,
# $BIN (default dev-bin: the binaries built here and carried), MEGAMOE_CUPTI_LIB (a libcupti found
# there, for bench-gemm's kernel times), and these helpers:
#   run_tests FILTER        the GPU tests matching it in one process, their summary printed, their
#                           exit status returned (TEST_TIMEOUT, default 240 s)
#   tests_if_filter         run_tests "$FILTER" when FILTER is set (exit status 0 otherwise)
#   for_lines_and_bins LINES FN   FN INDEX BINARY ARGS for each non-empty line of LINES (index from
#                           1) and each binary of BINS (default "megamoe megamoe_before") present in
#                           $BIN, binaries alternated within a line
#   gpu_state               one line: name, clocks, temperature, power, throttle reasons (or why not)
#   pack_out                $OUT's files into $OUT/out.tgz (a device call returns a few files only)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/megamoe-$1}
mkdir -p "$OUT"
LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH
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
  MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${TEST_TIMEOUT:-240}" "$BIN/megamoe_gpu_tests" \
    --gtest_filter="$1" > "$OUT/tests.log" 2>&1
  local trc=$?
  echo "tests: exit $trc"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran|Failure|differs|rel-L2" "$OUT/tests.log" | head -40
  return $trc
}

tests_if_filter() {
  [[ -n ${FILTER:-} ]] || return 0
  run_tests "$FILTER"
}

for_lines_and_bins() {
  local lines=$1 fn=$2 args b i=0
  while IFS= read -r args; do
    [[ -z $args ]] && continue
    i=$((i + 1))
    for b in ${BINS:-megamoe megamoe_before}; do
      [[ -x $BIN/$b ]] || continue
      "$fn" "$i" "$b" "$args"
    done
  done <<< "$lines"
}

gpu_state() {
  if ! command -v nvidia-smi > /dev/null 2>&1; then echo "no nvidia-smi"; return 0; fi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv,noheader
}

pack_out() {
  (cd "$OUT" && tar czf /tmp/megamoe-out.tgz --exclude=out.tgz . && rm -rf ./* && mv /tmp/megamoe-out.tgz out.tgz)
}
