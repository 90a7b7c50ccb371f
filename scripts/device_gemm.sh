#!/usr/bin/env bash
# Grouped GEMM on an H200 (device machine): correctness tests, SASS/register check, benchmark.
# Binaries are built here and carried in dev-bin/ (build/megamoe and build/tests/megamoe_gpu_tests):
#   dev-bin/megamoe_gpu_tests   the GEMM tests are its *GroupedGemm* cases
#   dev-bin/megamoe             `megamoe bench-gemm`
# Usage: scripts/device_gemm.sh [tests|sass|bench|all] [extra bench-gemm flags...]
set -uo pipefail
what=${1:-all}
shift || true
OUT=${OUT:-/tmp/gemm-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])' 2>/dev/null)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
BIN=${BIN:-dev-bin}
TESTS="$BIN/megamoe_gpu_tests"
GEMM_FILTER=${GEMM_FILTER:-*GroupedGemm*}
rc=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
if [[ $what == all || $what == tests ]]; then
  # one process per test, so a device fault in one case cannot hide the others
  : > "$OUT/test_gemm.log"
  for t in $("$TESTS" --gtest_filter="$GEMM_FILTER" --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^  / {print s $1}'); do
    timeout 120 "$TESTS" --gtest_filter="$t" >> "$OUT/test_gemm.log" 2>&1
    trc=$?
    printf '%-90s %s\n' "$t" "$([[ $trc -eq 0 ]] && echo ok || echo FAIL rc=$trc)" | tee -a "$OUT/test_summary.txt"
    [[ $trc -eq 0 ]] || rc=1
    if [[ $trc -eq 124 ]]; then echo "test timed out (hang?): skipping the rest"; what=tests; break; fi
  done
  grep -E "^\s+\[|Failure|error|Which is" "$OUT/test_gemm.log" | head -80
  if [[ -n ${SANITIZE:-} ]]; then
    timeout 120 compute-sanitizer --tool memcheck "$TESTS" --gtest_filter="$SANITIZE" > "$OUT/sanitizer.log" 2>&1
    head -60 "$OUT/sanitizer.log"
  fi
fi
if [[ $what == all || $what == sass ]]; then
  {
    echo "## wgmma instructions in the SASS, per kernel"
    cuobjdump --dump-sass "$BIN/megamoe" | awk '/Function :/ {f=$3} /GMMA/ {split($0, a, /GMMA/); c[f]++} END {for (k in c) print c[k], k}' | sort -k2
    cuobjdump --dump-sass "$BIN/megamoe" | grep -oE "[QH]GMMA\.[A-Z0-9x.]+" | sort | uniq -c
    echo "## local memory (spills) in the SASS: LDL/STL count"
    cuobjdump --dump-sass "$BIN/megamoe" | grep -cE "\b(LDL|STL)\b" || true
    echo "## resource usage"
    cuobjdump --dump-resource-usage "$BIN/megamoe" | grep -A1 grouped_gemm || true
  } > "$OUT/sass.txt" 2>&1
  head -40 "$OUT/sass.txt"
fi
if [[ $what == all || $what == bench ]]; then
  timeout 300 "$BIN/megamoe" bench-gemm --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
fi
exit $rc
