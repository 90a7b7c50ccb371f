#!/usr/bin/env bash
# scripts/device.sh on the CPU with fake binaries: each subcommand that only calls the tool or the
# GPU test binary must call them with the arguments it documents, write under $OUT and report the
# exit status. The fakes log their arguments; `fail` in a fake's arguments makes it exit 3.
#   bash tests/scripts/test_device_sh.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export BIN=$TMP/bin LOG=$TMP/calls.log
mkdir -p "$BIN"
for b in megamoe megamoe_before; do
  cat > "$BIN/$b" <<FAKE
#!/usr/bin/env bash
echo "$b \$*" >> "\$LOG"
[[ " \$* " == *" fail "* ]] && { echo "routed 8 not run: fake failure"; exit 3; }
prev=
for a in "\$@"; do [[ \$prev == --json ]] && echo '{"tool": "megamoe bench", "rows": []}' > "\$a"; prev=\$a; done
echo "routed 8 1.0 1.0 1.0"
FAKE
done
cat > "$BIN/megamoe_gpu_tests" <<'FAKE'
#!/usr/bin/env bash
echo "megamoe_gpu_tests $*" >> "$LOG"
if [[ $* == *--gtest_list_tests* ]]; then printf 'Sm90Fake.\n  One\n  Two\n'; exit 0; fi
echo "[  PASSED  ] 1 test."
FAKE
chmod +x "$BIN"/*
failures=0
expect() {  # description, then a grep -E pattern the call log must hold
  if grep -qE -- "$2" "$LOG"; then echo "ok   $1"; else echo "FAIL $1: no call matching '$2'"; failures=$((failures + 1)); fi
}
exists() {  # description, file
  if [[ -f $2 ]]; then echo "ok   $1"; else echo "FAIL $1: no $2"; failures=$((failures + 1)); fi
}
status() {  # description, expected exit status, command...
  local want=$2
  shift 2
  "$@" > "$TMP/out.txt" 2>&1
  local got=$?
  if [[ $got -eq $want ]]; then echo "ok   exit $got: $*"; else echo "FAIL exit $got (want $want): $*"; cat "$TMP/out.txt"; failures=$((failures + 1)); fi
}
D=(bash "$ROOT/scripts/device.sh")
export OUT=$TMP/out

status "help" 0 "${D[@]}" help
status "unknown subcommand" 2 "${D[@]}" nonsense
status "tests" 0 "${D[@]}" tests 'Sm90Fake.*'
expect "tests: one process, the filter" "^megamoe_gpu_tests --gtest_filter=Sm90Fake\.\*$"
status "tests, one process each" 0 env EACH=1 "${D[@]}" tests 'Sm90Fake.*'
expect "tests: each test alone" "^megamoe_gpu_tests --gtest_filter=Sm90Fake\.Two$"
status "check" 0 "${D[@]}" check
expect "check: deepseek-v3 with 16 experts" "^megamoe check --backend routed --preset deepseek-v3 --experts 16 --ep 2 --tokens 8$"
status "bench-table" 0 env PRESETS=tiny EPS="1 2" TOKENS=1,8 "${D[@]}" bench-table
expect "bench-table: EP2 with --json" "^megamoe bench --preset tiny --backend routed --ep 2 --tokens 1,8 --iters 20 --warmup 5 --max-host-gb 120 --json $OUT/bench_tiny_ep2.json$"
exists "bench-table wrote its JSON" "$OUT/bench_tiny_ep1.json"
status "layer-ab" 0 env CASES=$'--preset tiny --tokens 1\n\n--preset tiny --tokens 8' "${D[@]}" layer-ab
expect "layer-ab: the second binary, second line" "^megamoe_before bench --backend routed --iters 50 --max-host-gb 120 --preset tiny --tokens 8$"
status "layer-ab, a failing case" 1 env BINS=megamoe CASES='--preset tiny fail' "${D[@]}" layer-ab
status "launch" 0 "${D[@]}" launch bench --preset tiny --ep 2
expect "launch: N processes of the tool" "^megamoe launch -n 2 -- $BIN/megamoe bench --preset tiny --ep 2$"
status "launch without a command" 2 "${D[@]}" launch
status "transport tests" 0 "${D[@]}" transport tests
expect "transport tests: the filter" "^megamoe_gpu_tests --gtest_filter=Sm90Transport\.\*$"
status "transport perf" 0 "${D[@]}" transport perf
expect "transport perf: amortised, this binary and the one before" "^megamoe_before bench-transport --ranks 2 --tokens 1,8,128,512,1024,4096,8192 --dispatch fp8 --combine bf16 --iters 10 --warmup 2 --graph-iters 32 --graph-reps 3 --json $OUT/transport_graph_before.json$"
exists "transport perf wrote its JSON" "$OUT/transport_graph.json"
status "transport-ab" 0 env BENCH='--tokens 1,8 --owner-reduce' "${D[@]}" transport-ab
expect "transport-ab: the line's flags" "^megamoe bench-transport --ranks 2 --dispatch fp8 --iters 10 --warmup 2 --graph-iters 16 --graph-reps 3 --tokens 1,8 --owner-reduce --json $OUT/transport1_megamoe.json$"
status "gemm bench" 0 "${D[@]}" gemm bench --preset qwen3-30b-a3b
expect "gemm bench: json and the flags" "^megamoe bench-gemm --json $OUT/bench.json --preset qwen3-30b-a3b$"
status "fp4" 0 "${D[@]}" fp4
expect "fp4: the mxfp4 GEMM tests one by one" "^megamoe_gpu_tests --gtest_filter=Sm90Fake\.Two$"
expect "fp4: mxfp4 bench rows with --json" "^megamoe bench-gemm --no-cublas --weight-format mxfp4 --tokens 8,32 --json $OUT/fp4_gemm_mxfp4.json$"
status "gemm-ab" 0 env ROUNDS=1 BENCH='--preset tiny --trace @OUT@/trace_@BIN@_@ROUND@.json' "${D[@]}" gemm-ab
expect "gemm-ab: substitutions" "^megamoe_before bench-gemm --no-cublas --iters 20 --preset tiny --trace $OUT/trace_megamoe_before_1.json$"
exists "gemm-ab packed its output" "$OUT/out.tgz"
status "link" 0 "${D[@]}" link
expect "link: the handshake" "^megamoe bench-link --mib 1 --paths handshake,handshake-grid --iters 10 --json $OUT/link7.json$"
: > "$LOG"
status "verify" 0 env TOKENS=1,8 "${D[@]}" verify
expect "verify: the mega tests" "^megamoe_gpu_tests --gtest_filter=Sm90/Sm90Mega\.\*:Sm90MegaEdges\.\*$"
expect "verify: the soak" "^megamoe_gpu_tests --gtest_filter=\*Soak\*$"
expect "verify: mega beside routed at EP1" "^megamoe bench --preset deepseek-v3 --backend mega,routed --ep 1 --tokens 1,8 --iters 10 --warmup 3 --max-host-gb 100 --json $OUT/bench_deepseek-v3.json$"
exists "verify packed its output" "$OUT/out.tgz"
# STAGES names the stages that run: only that one here
: > "$LOG"
status "verify STAGES" 0 env STAGES=in_kernel_reduce "${D[@]}" verify
expect "verify STAGES: the named stage" "^megamoe_gpu_tests --gtest_filter=\*InKernelFc2Reduce\*:Sm90MegaEdges\.AutoSelects\*:TransportOptions\.\*$"
if grep -q "Soak" "$LOG"; then echo "FAIL verify STAGES: a stage it does not name ran"; failures=$((failures + 1)); else echo "ok   verify STAGES: no other stage"; fi
# sanitize: a fake compute-sanitizer prints a fixture log (SANITIZER_FIXTURE); the summary must count
# only this project's errors, NCCL's own host-side reports filtered by rule.
cat > "$BIN/compute-sanitizer" <<'FAKE'
#!/usr/bin/env bash
echo "compute-sanitizer $*" >> "$LOG"
cat "$SANITIZER_FIXTURE"
FAKE
chmod +x "$BIN/compute-sanitizer"
FIX=$ROOT/tests/scripts/fixtures
status "sanitize: NCCL's probes only" 0 env PATH="$BIN:$PATH" SANITIZER_FIXTURE="$FIX/sanitize_memcheck_nccl.log" \
  "${D[@]}" sanitize 'Sm90Fake.*'
expect "sanitize: initcheck among the tools" "^compute-sanitizer --tool initcheck --print-limit 10000 $BIN/megamoe_gpu_tests --gtest_filter=Sm90Fake\.\*$"
if grep -q "sanitize_initcheck.log: clean: 0 error(s) of this project, 2 NCCL host-side report(s) filtered" "$OUT/sanitize_summary.txt"; then
  echo "ok   sanitize: NCCL's reports filtered"
else
  echo "FAIL sanitize: summary"; cat "$OUT/sanitize_summary.txt"; failures=$((failures + 1))
fi
status "sanitize: an error of this project" 1 env PATH="$BIN:$PATH" TOOLS=initcheck \
  SANITIZER_FIXTURE="$FIX/sanitize_initcheck_project.log" "${D[@]}" sanitize
if grep -q "FAIL: 2 error(s) of this project, 1 NCCL host-side report(s) filtered" "$OUT/sanitize_summary.txt"; then
  echo "ok   sanitize: this project's errors counted"
else
  echo "FAIL sanitize: summary"; cat "$OUT/sanitize_summary.txt"; failures=$((failures + 1))
fi
status "sanitize: a run cut short" 1 env PATH="$BIN:$PATH" TOOLS=racecheck \
  SANITIZER_FIXTURE="$FIX/sanitize_racecheck_cut.log" "${D[@]}" sanitize

echo "device.sh with fake binaries: $failures failure(s)"
[[ $failures -eq 0 ]]
