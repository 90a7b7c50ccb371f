#!/usr/bin/env bash
# The one entry point for runs on the device machine (H200s): GPU tests, checks, the benchmark
# tables, A/B runs of two binaries, sanitizers and profiles. Binaries are built here and carried in
# $BIN (default dev-bin/): megamoe, megamoe_gpu_tests, and optionally megamoe_before (an earlier
# build of the tool, compared in the same lease). Logs and JSON go under $OUT (default
# /tmp/megamoe-<subcommand>). The environment lines are scripts/device_env.sh's.
#
#   bash scripts/device.sh <subcommand> [args]
#
#   tests [FILTER]         GPU tests matching FILTER (default *) in one process; EACH=1: one process
#                          per test, stopping at the first that times out (a hang)
#   check                  `megamoe check --backend routed` on tiny EP1 / EP2, qwen3-30b-a3b EP2,
#                          deepseek-v3 (16 experts) EP2
#   bench-table            the routed layer's tables: `megamoe bench` for PRESETS (deepseek-v3
#                          qwen3-30b-a3b) x EPS (1 2) at TOKENS (1..8192), ITERS (20), --json each
#   layer-ab               `megamoe bench --backend routed --iters ITERS (50) --max-host-gb 120` plus
#                          each line of CASES, for each binary of BINS, alternated; tests first when
#                          FILTER is set
#   launch ARGS...         `megamoe launch -n NPROC (2) -- megamoe ARGS...` (one process per GPU)
#   barrier-timeout        rank 1 of a launched bench stopped mid-run: rank 0 must exit on its own
#   gemm [tests|sass|bench|all] [bench-gemm flags]   the grouped GEMM on GPU 0: its tests one process
#                          each (GEMM_FILTER), the SASS check, `bench-gemm --json`
#   fp4 [tests|bench|all]  mxfp4 weights: the codec and word-expansion tests, the mxfp4 GEMM's tests
#                          (bit for bit the fp8-block GEMM on the expansion, float64 on the mxfp4
#                          values) and the layers' (routed, then mega, against the cpu backend) one
#                          process each, then bench-gemm decode rows of fp8-block and mxfp4 side by
#                          side and the layer's bench rows (deepseek-v3 with 32 experts, EP1, 1 / 8 /
#                          128 tokens, routed and mega, each format; --json each)
#   gemm-ab                `bench-gemm --no-cublas` of each BINS binary for each line of BENCH,
#                          ROUNDS (2) times; @OUT@ @ROUND@ @BIN@ substituted, "VAR=v -- args" lines
#   gemm-matrix [matrix] [alone]   the GEMM against its targets (read floor, matrix, shapes alone)
#   transport [tests|bench|perf|all]   the EP transport: its tests, `bench-transport --json` (perf:
#                          the amortised table too, and megamoe_before's)
#   transport-ab           `bench-transport` of each BINS binary for each line of BENCH
#   link                   `bench-link`: every path, several shapes, the signal's round trip
#   tune                   `megamoe tune` on PRESETS (deepseek-v3 qwen3-30b-a3b) at EP1, TOKENS
#                          (1,8,128,1024,4096,8192) into $OUT/knobs.json (timed), then `megamoe bench` with
#                          that cache and with none (MEGAMOE_KNOB_CACHE=off), alternated ROUNDS (2) times
#                          at the same points; a tiny tuning run and its bench first; the table at the end
#   harness-ab             the bench harness of each BINS binary (megamoe_before: a build of 1f3011b,
#                          before the harness; megamoe), alternated ROUNDS (2) times on the same points
#                          of bench, bench-gemm and bench-transport on one GPU; medians side by side
#   mega [tests|check|bench|timeline|layers|sanitize|all]   the one-kernel backend on GPU 0: its tests one
#                          process each (MEGA_FILTER, default Sm90Mega*; the first run of the kernel,
#                          so EACH-style with a short wait bound), `check --backend mega` (EP1 and
#                          --shared-gpu R = 2), `bench --backend mega,routed` for PRESETS (deepseek-v3
#                          deepseek-v4-flash qwen3-30b-a3b) x EP1 and R = 2 logical ranks at TOKENS
#                          (1..8192) with the per-phase timeline (the stages column), `bench --layers
#                          LAYERS (4)` beside one layer (decode: the per-layer cost of a model's step),
#                          compute-sanitizer memcheck / racecheck / synccheck / initcheck on the small
#                          mega tests (summarised as `sanitize` does)
#   sanitize [FILTER]      compute-sanitizer TOOLS (memcheck racecheck synccheck initcheck) on those GPU
#                          tests (FILTER='*': the whole GPU suite; SANITIZE_TIMEOUT per tool, 150 s),
#                          then scripts/sanitize_report.py: this project's errors per tool, NCCL's own
#                          host-side reports filtered by rule (innermost non-CUDA host frame in libnccl)
#   profile                Nsight Compute: MODE=sections (default) | metrics | source
#   python                 the Python package's tests with torch on the GPU (tests/python: the torch
#                          tier, the routed backend from torch, host overhead, captured kernel nodes):
#                          installs $BIN/python/megamoe-*.whl (a wheel built for the device's python3)
#                          into $OUT/site without dependencies, then the GPU tests Sm90RoutedInputs* and
#                          Sm90RoutedFaults.ErrorPending* (error_pending() polled without a host sync)
#   verify                 one device call's worth of checks in priority order, each stage bounded and
#                          skipped when VERIFY_SECONDS (540) would run out or STAGES (names, default
#                          all) leaves it out: the in-kernel FC2 reduce's tests (in_kernel_reduce) and
#                          its bench rows (bench_in_kernel_reduce_<preset>, IKR_TOKENS), the mega tests
#                          (mega_ep1, then shared_gpu: logical ranks), the rest of the GPU suite (suite),
#                          the soak (soak, SOAK_FORWARDS 300), `bench --backend mega,routed` at EP1
#                          (bench_<preset>, qwen3-30b-a3b then deepseek-v3, TOKENS 1..8192, ITERS 10:
#                          the crossover), the Python tier (python); all of $OUT packed into
#                          $OUT/out.tgz (a device call returns a few files only)
# Every binary runs under `timeout`; each subcommand prints a short summary and exits non-zero when
# something failed. Run binaries through this script (or source device_env.sh): started bare they
# load the machine's older system NCCL, and every NCCL group fails in ncclDevCommCreate.
# shellcheck disable=SC2317  # functions called through for_lines_and_bins
set -uo pipefail
sub=${1:-}
[[ $# -gt 0 ]] && shift
case $sub in
  tests | check | bench-table | layer-ab | launch | barrier-timeout | gemm | fp4 | gemm-ab | gemm-matrix | transport | \
    transport-ab | link | harness-ab | mega | tune | sanitize | profile | python | verify) ;;
  *)
    sed -n '2,/^# shellcheck disable=SC2317/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [[ -z $sub || $sub == help || $sub == -h || $sub == --help ]] && exit 0
    echo "device.sh: unknown subcommand '$sub'" >&2
    exit 2
    ;;
esac
# shellcheck source=scripts/device_env.sh
source "$(dirname "$0")/device_env.sh" "$sub"
TOOL=$BIN/megamoe
rc=0

tests() {
  local filter=${1:-${FILTER:-*}}
  if [[ -z ${EACH:-} ]]; then
    run_tests "$filter" || rc=1
    return
  fi
  : > "$OUT/tests.log"
  local t trc
  for t in $("$BIN/megamoe_gpu_tests" --gtest_filter="$filter" --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^  / {print s $1}'); do
    MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${TEST_TIMEOUT:-120}" "$BIN/megamoe_gpu_tests" \
      --gtest_filter="$t" >> "$OUT/tests.log" 2>&1
    trc=$?
    printf '%-90s %s\n' "$t" "$([[ $trc -eq 0 ]] && echo ok || echo "FAIL rc=$trc")" | tee -a "$OUT/test_summary.txt"
    [[ $trc -eq 0 ]] || rc=1
    if [[ $trc -eq 124 ]]; then echo "test timed out (hang?): skipping the rest"; break; fi
  done
  grep -E "^\s+\[|Failure|error|Which is" "$OUT/tests.log" | head -80
}

check() {
  local args i=0 crc
  for args in "--preset tiny --ep 1 --tokens 64" "--preset tiny --ep 2 --tokens 64" \
              "--preset qwen3-30b-a3b --ep 2 --tokens 64" "--preset deepseek-v3 --experts 16 --ep 2 --tokens 8"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout 300 "$TOOL" check --backend routed $args \
      > "$OUT/check$i.log" 2>&1
    crc=$?
    [[ $crc -eq 0 ]] || rc=1
    echo "== megamoe check --backend routed $args: exit $crc"
    tail -6 "$OUT/check$i.log"
  done
}

# The host memory of the 2-GPU machine reads ~31 GiB at start and grows on use: --max-host-gb.
bench_table() {
  local preset ep json
  for preset in ${PRESETS:-deepseek-v3 qwen3-30b-a3b}; do
    for ep in ${EPS:-1 2}; do
      echo "== $preset EP$ep"
      json="$OUT/bench_${preset}_ep${ep}.json"
      MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${BENCH_TIMEOUT:-540}" "$TOOL" bench \
        --preset "$preset" --backend routed --ep "$ep" --tokens "${TOKENS:-1,8,64,128,512,1024,2048,4096,8192}" \
        --iters "${ITERS:-20}" --warmup "${WARMUP:-5}" --max-host-gb 120 --json "$json" \
        > "$OUT/bench_${preset}_ep${ep}.log" 2>&1 || rc=1
      grep -vE "^\[bench\]" "$OUT/bench_${preset}_ep${ep}.log" | tail -24
    done
  done
  echo "tables: python3 scripts/perf_refresh.py --machine '2 x H200' $OUT/bench_*.json"
}

layer_ab_one() {  # index binary args
  # shellcheck disable=SC2086
  MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${BENCH_TIMEOUT:-240}" "$BIN/$2" bench \
    --backend routed --iters "${ITERS:-50}" --max-host-gb 120 $3 > "$OUT/layer$1_$2.txt" 2>&1
  local brc=$?
  [[ $brc -eq 0 ]] || rc=1
  echo "== $2 $3: exit $brc"
  grep -vE "^\[bench\]" "$OUT/layer$1_$2.txt" | grep -E "^ *(routed|backend|#)|stages|not run" | cut -c1-160 | head -12
}

launch() {
  [[ $# -gt 0 ]] || { echo "device.sh launch: give the megamoe command, e.g. launch bench --preset ... --ep 2"; rc=2; return; }
  MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${LAUNCH_TIMEOUT:-420}" "$TOOL" launch \
    -n "${NPROC:-2}" -- "$TOOL" "$@" > "$OUT/launch.log" 2>&1
  local lrc=$?
  [[ $lrc -eq 0 ]] || rc=1
  echo "launch: exit $lrc"
  grep -vE "^\[bench\]" "$OUT/launch.log" | grep -vE "^ *[0-9]+/" | cut -c1-200 | tail -40
}

barrier_timeout() {
  export MEGAMOE_BARRIER_TIMEOUT_MS=${MEGAMOE_BARRIER_TIMEOUT_MS:-3000}
  timeout 180 "$TOOL" launch -n 2 -- "$TOOL" bench --preset qwen3-30b-a3b --backend routed --ep 2 \
    --tokens 8 --iters 1000000 --warmup 1 --max-host-gb 100 > "$OUT/barrier.log" 2>&1 &
  local lpid=$! r1 t0 t1 lrc
  # the timed loop reports progress every 2 s; stop rank 1 once it is running
  for _ in $(seq 1 120); do
    grep -q "forwards (" "$OUT/barrier.log" 2>/dev/null && break
    kill -0 $lpid 2>/dev/null || break
    sleep 1
  done
  sleep 3
  r1=$(pgrep -P "$(pgrep -P $lpid | head -1)" 2>/dev/null | sed -n 2p)
  [[ -z $r1 ]] && r1=$(pgrep -f "$TOOL bench" | sort -n | sed -n 2p)
  if [[ -z $r1 ]]; then
    echo "rank 1 not found: the launch did not start"; wait $lpid; rc=1; tail -8 "$OUT/barrier.log"; return
  fi
  echo "stopping rank 1 (pid $r1) at $(date +%T)"
  kill -STOP "$r1"
  t0=$(date +%s); wait $lpid; lrc=$?; t1=$(date +%s)
  echo "launch exited with $lrc, $((t1 - t0)) s after rank 1 stopped (expected: non-zero, within ~10 s)"
  [[ $lrc -ne 0 && $lrc -ne 124 ]] || rc=1
  grep -vE "^\[bench\] +[0-9]+/" "$OUT/barrier.log" | tail -8
}

gemm() {  # [tests|sass|bench|all] [bench-gemm flags]
  local what=all
  [[ ${1:-} =~ ^(tests|sass|bench|all)$ ]] && { what=$1; shift; }
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  echo "gpu: $(gpu_state)" | tee "$OUT/gpu.txt"
  if [[ $what == all || $what == tests ]]; then
    EACH=1 tests "${GEMM_FILTER:-*GroupedGemm*}"
  fi
  if [[ $what == all || $what == sass ]]; then
    if ! command -v cuobjdump > /dev/null 2>&1; then
      echo "no cuobjdump here: SASS check skipped"
    else
      {
        echo "## wgmma instructions in the SASS, per kernel"
        cuobjdump --dump-sass "$TOOL" | awk '/Function :/ {f=$3} /GMMA/ {c[f]++} END {for (k in c) print c[k], k}' | sort -k2
        cuobjdump --dump-sass "$TOOL" | grep -oE "[QH]GMMA\.[A-Z0-9x.]+" | sort | uniq -c
        echo "## local memory (spills) in the SASS: LDL/STL count"
        cuobjdump --dump-sass "$TOOL" | grep -cE "\b(LDL|STL)\b"
        echo "## resource usage"
        cuobjdump --dump-resource-usage "$TOOL" | grep -A1 grouped_gemm
      } > "$OUT/sass.txt" 2>&1
      head -40 "$OUT/sass.txt"
    fi
  fi
  if [[ $what == all || $what == bench ]]; then
    timeout 300 "$TOOL" bench-gemm --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  fi
}

fp4() {  # [tests|bench|all]
  local what=${1:-all} wf
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  if [[ $what == all || $what == tests ]]; then
    EACH=1 tests "${FP4_FILTER:-FormatsDevice.Mxfp4*:FormatsDevice.Fp4*:Cases/Mxfp4Gemm.*:Sm90/Sm90Mxfp4Layer.*routed_*:Sm90/Sm90Mxfp4Prefill.*:Sm90Mxfp4Knob.*:Sm90/Sm90Mxfp4Layer.*mega_*}"
  fi
  if [[ $what == all || $what == bench ]]; then
    for wf in fp8-block mxfp4; do
      timeout 300 "$TOOL" bench-gemm --no-cublas --weight-format "$wf" --tokens 8,32 --json "$OUT/fp4_gemm_$wf.json" \
        2>&1 | tee "$OUT/fp4_gemm_$wf.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
      if [[ $wf == mxfp4 ]]; then  # the default (2 math warpgroups per tile) above; 1 for comparison
        timeout 300 "$TOOL" bench-gemm --no-cublas --weight-format mxfp4 --fp4-math-wg 1 --tokens 8,32 \
          --json "$OUT/fp4_gemm_mxfp4_wg1.json" 2>&1 | tee "$OUT/fp4_gemm_mxfp4_wg1.log"
        [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
      fi
      # 32 experts: the weight generation of all 256 takes ~90 s on the device
      timeout 300 "$TOOL" bench --preset deepseek-v3 --experts 32 --tokens 1,8,128 --backend routed,mega \
        --weight-format "$wf" --json "$OUT/fp4_layer_$wf.json" 2>&1 | tee "$OUT/fp4_layer_$wf.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
    done
  fi
}

gemm_ab_one() {  # index binary args (and $round)
  local args=${3//@OUT@/$OUT} envs=
  args=${args//@ROUND@/$round}
  args=${args//@BIN@/$2}
  if [[ $args == *" -- "* ]]; then envs=${args%% -- *}; args=${args#* -- }; fi
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-120}" env $envs "$BIN/$2" bench-gemm --no-cublas --iters "${ITERS:-20}" $args \
    > "$OUT/gemm$1_r${round}_$2.log" 2>&1
  local brc=$?
  [[ $brc -eq 0 ]] || rc=1
  echo "== $2 (round $round) $3: exit $brc"
  grep -vE "^#" "$OUT/gemm$1_r${round}_$2.log" | grep -v "# trace" | cut -c1-175
  grep "# trace" "$OUT/gemm$1_r${round}_$2.log" | sed 's/^ *# trace/  trace/'
}

gemm_ab() {
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} tests_if_filter || rc=1
  for round in $(seq 1 "${ROUNDS:-2}"); do for_lines_and_bins "${BENCH:-}" gemm_ab_one; done
  [[ -f $OUT/tests.log ]] && { echo "== tests (again)"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran" "$OUT/tests.log" | tail -12; }
  pack_out
}

matrix_bench() {  # json-file args...
  local json=$1
  shift
  timeout "${BENCH_TIMEOUT:-280}" "$TOOL" bench-gemm --iters "${ITERS:-20}" --json "$json" "$@" > "${json%.json}.log" 2>&1
  local brc=$?
  [[ $brc -eq 0 ]] || { rc=1; echo "bench-gemm $*: exit $brc"; tail -5 "${json%.json}.log"; }
}

# 1. scripts/device_read_floor.py: PyTorch reading the decode weight sets (the floor's reference);
# 2. the whole bench-gemm matrix in one process after the memset flush (SwiGLU rows, cuBLASLt peer),
#    then after the read flush without them;
# 3. each shape with a target in a process of its own (no longer launch before it), ROUNDS (3) times,
#    cases alternated; the decode shapes after both flushes.
gemm_matrix() {
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  local parts=${*:-matrix alone} f i round
  echo "before: $(gpu_state)" | tee "$OUT/gpu.txt"
  if [[ $parts == *matrix* ]]; then
    timeout "${FLOOR_TIMEOUT:-120}" python3 scripts/device_read_floor.py "${ITERS:-20}" > "$OUT/read_floor.log" 2>&1 || rc=1
    grep -v Warning "$OUT/read_floor.log" | grep -v _warn_once
    matrix_bench "$OUT/matrix_memset.json" --flush memset
    matrix_bench "$OUT/matrix_read.json" --flush read --no-swiglu --no-cublas
    for f in memset read; do python3 scripts/gemm_targets.py "$OUT/matrix_$f.json" > "$OUT/targets_matrix_$f.md"; done
    echo "after the matrix: $(gpu_state)" | tee -a "$OUT/gpu.txt"
  fi
  if [[ $parts == *alone* ]]; then
    local cases=(
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
    for round in $(seq 1 "${ROUNDS:-3}"); do
      for i in "${!cases[@]}"; do
        # shellcheck disable=SC2086
        matrix_bench "$OUT/alone_memset_c${i}_r$round.json" ${cases[$i]} --no-swiglu --flush memset
        # shellcheck disable=SC2086
        [[ ${cases[$i]} == *"8,32"* ]] && matrix_bench "$OUT/alone_read_c${i}_r$round.json" ${cases[$i]} --no-swiglu --no-cublas --flush read
      done
      echo "after round $round: $(gpu_state)" | tee -a "$OUT/gpu.txt"
    done
    for f in memset read; do python3 scripts/gemm_targets.py "$OUT"/alone_${f}_*.json > "$OUT/targets_alone_$f.md"; done
  fi
  for f in "$OUT"/targets_*.md; do echo "== $(basename "$f")"; cat "$f"; done
  echo "tables: python3 scripts/perf_refresh.py --flush memset $OUT/alone_memset_*.json (and --flush read, --table gemm/read)"
  pack_out
}

TRANSPORT_ARGS="--ranks 2 --tokens 1,8,128,512,1024,4096,8192 --dispatch fp8 --combine bf16"
transport() {  # [tests|bench|perf|all]
  local what=${1:-all} trc
  command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  if [[ $what == tests || $what == all || $what == perf ]]; then
    TEST_TIMEOUT=150 run_tests "${FILTER:-Sm90Transport.*}" || rc=1
  fi
  if [[ $what == bench || $what == all ]]; then
    # shellcheck disable=SC2086
    timeout 100 "$TOOL" bench-transport $TRANSPORT_ARGS --iters 20 --warmup 3 --json "$OUT/transport.json" 2>&1 | \
      tee "$OUT/bench_fp8_bf16.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  fi
  if [[ $what == perf ]]; then
    # shellcheck disable=SC2086
    timeout 75 "$TOOL" bench-transport $TRANSPORT_ARGS --iters 10 --warmup 2 --graph-iters 32 --graph-reps 3 \
      --json "$OUT/transport_graph.json" 2>&1 | tee "$OUT/bench_fp8_bf16.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
    if [[ -x $BIN/megamoe_before ]]; then
      # shellcheck disable=SC2086
      timeout 75 "$BIN/megamoe_before" bench-transport $TRANSPORT_ARGS --iters 10 --warmup 2 --graph-iters 32 \
        --graph-reps 3 --json "$OUT/transport_graph_before.json" > "$OUT/bench_before.log" 2>&1
      trc=$?
      echo "before: exit $trc"
      grep -A9 amortised "$OUT/bench_before.log"
    fi
  fi
}

transport_ab_one() {  # index binary args
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-90}" "$BIN/$2" bench-transport --ranks 2 --dispatch fp8 --iters 10 --warmup 2 \
    --graph-iters 16 --graph-reps 3 $3 --json "$OUT/transport$1_$2.json" > "$OUT/bench$1_$2.log" 2>&1
  local brc=$?
  [[ $brc -eq 0 ]] || rc=1
  echo "== $2 $3: exit $brc"
  grep -A12 -i amortised "$OUT/bench$1_$2.log" | head -14
}

link() {
  local shape i=0
  timeout 120 "$TOOL" bench-link --json "$OUT/link0.json" 2>&1 | tee "$OUT/link1.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  for shape in "--paths tma,staged,store --chunk 4096 --stages 8 --tma-warps 4 --staged-warps 16" \
               "--paths tma --chunk 16384 --stages 3 --tma-warps 4" \
               "--paths tma --chunk 8192 --stages 2 --tma-warps 8" \
               "--paths tma,staged --chunk 2048 --stages 8 --tma-warps 8 --staged-warps 16" \
               "--paths store,pull --store-ctas-per-sm 1" \
               "--paths store,pull,tma --store-ctas-per-sm 4 --mib 64" \
               "--mib 1 --paths handshake,handshake-grid --iters 10"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    timeout 120 "$TOOL" bench-link $shape --json "$OUT/link$i.json" 2>&1 | tee -a "$OUT/link_shapes.log" | grep -v "^#"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  done
  echo "table: python3 scripts/perf_refresh.py --machine '2 x H200' $OUT/link*.json"
}

tune_one() {  # preset tokens: tune into $OUT/knobs.json, then bench with it and without, alternated
  local preset=$1 tokens=$2 t0 t1 round cache
  t0=$(date +%s)
  timeout "${TUNE_TIMEOUT:-540}" "$TOOL" tune --preset "$preset" --backend routed --tokens "$tokens" \
    --cache "$OUT/knobs.json" --json "$OUT/tune_$preset.json" --max-host-gb 120 ${TUNE_ARGS:-} \
    > "$OUT/tune_$preset.log" 2>&1 || rc=1
  t1=$(date +%s)
  echo "== tune $preset: $((t1 - t0)) s"
  grep -vE "^\[tune\]" "$OUT/tune_$preset.log" | tail -14
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for cache in "$OUT/knobs.json" off; do
      local tag=tuned; [[ $cache == off ]] && tag=heuristic
      MEGAMOE_KNOB_CACHE=$cache MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-5000} timeout "${BENCH_TIMEOUT:-300}" \
        "$TOOL" bench --preset "$preset" --backend routed --tokens "$tokens" --iters "${ITERS:-20}" --warmup 5 \
        --max-host-gb 120 --json "$OUT/bench_${preset}_${tag}_r$round.json" > "$OUT/bench_${preset}_${tag}_r$round.log" 2>&1 || rc=1
    done
  done
}

tune_table() {  # the tuned against the heuristic, per preset and point (median of the rounds' medians)
  python3 - "$OUT" ${PRESETS:-deepseek-v3 qwen3-30b-a3b} <<'PY'
import glob, json, statistics, sys
out, presets = sys.argv[1], sys.argv[2:]
for preset in ["tiny"] + presets:
    med = {}
    for tag in ("tuned", "heuristic"):
        for f in glob.glob(f"{out}/bench_{preset}_{tag}_r*.json"):
            for r in json.load(open(f))["rows"]:
                if "median_us" in r:
                    med.setdefault((r["tokens"], tag), []).append(r["median_us"])
    if not med:
        continue
    print(f"| {preset} tokens/rank | heuristic µs | tuned µs | gain |")
    print("| ---: | ---: | ---: | ---: |")
    for t in sorted({k[0] for k in med}):
        h, u = med.get((t, "heuristic")), med.get((t, "tuned"))
        if not h or not u:
            continue
        h, u = statistics.median(h), statistics.median(u)
        print(f"| {t} | {h:.1f} ({len(med[(t, 'heuristic')])} runs) | {u:.1f} | {100 * (h - u) / h:+.1f}% |")
PY
}

harness_ab() {
  local round b
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for b in ${BINS:-megamoe_before megamoe}; do
      [[ -x $BIN/$b ]] || { echo "no $BIN/$b"; rc=1; continue; }
      timeout 90 "$BIN/$b" bench --preset qwen3-30b-a3b --backend routed --tokens 1,128,1024 --iters 30 --warmup 5 \
        --max-host-gb 100 --json "$OUT/bench_${b}_r$round.json" > "$OUT/bench_${b}_r$round.log" 2>&1 || rc=1
      timeout 60 "$BIN/$b" bench-gemm --preset qwen3-30b-a3b --experts 64 --tokens 8,256 --no-swiglu --iters 20 \
        --json "$OUT/gemm_${b}_r$round.json" > "$OUT/gemm_${b}_r$round.log" 2>&1 || rc=1
      timeout 60 "$BIN/$b" bench-gemm --preset deepseek-v3 --experts 32 --tokens 512 --fc fc1 --no-swiglu --iters 20 \
        --flush read --json "$OUT/gemmread_${b}_r$round.json" > "$OUT/gemmread_${b}_r$round.log" 2>&1 || rc=1
      timeout 60 "$BIN/$b" bench-transport --ranks 1 --tokens 128,4096 --iters 20 --warmup 3 --graph-iters 16 \
        --graph-reps 3 > "$OUT/transport_${b}_r$round.log" 2>&1 || rc=1
      echo "round $round $b: done ($(gpu_state))"
    done
  done
  python3 - "$OUT" "${ROUNDS:-2}" ${BINS:-megamoe_before megamoe} <<'PY'
import json, sys
out, rounds, bins = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
def transport(path):  # the gated table's rows: tokens | dispatch ... | combine ... | d+c | ...
    rows = []
    try:
        for line in open(path):
            if line.startswith("# amortised"):
                break
            parts = line.split("|")
            if len(parts) > 3 and parts[0].strip().isdigit():
                rows.append((parts[0].strip(), parts[1].split()[0], parts[2].split()[0], parts[3].strip()))
    except OSError:
        pass
    return rows
for r in range(1, rounds + 1):
    print(f"== round {r}: " + " | ".join(bins))
    docs = [load(f"{out}/bench_{b}_r{r}.json") for b in bins]
    if all(docs):
        for rows in zip(*[d["rows"] for d in docs]):
            print(f"bench qwen3-30b-a3b routed T={rows[0]['tokens']}: " +
                  " | ".join(f"{x.get('median_us', 0):.1f} ({x.get('min_us', 0):.1f}-{x.get('max_us', 0):.1f})" for x in rows))
    for tag in ("gemm", "gemmread"):
        docs = [load(f"{out}/{tag}_{b}_r{r}.json") for b in bins]
        if all(docs):
            for rows in zip(*docs):
                x = rows[0]
                print(f"{tag} {x['model']} {x['fc']} {x['experts']}x{x['tokens_per_expert']} events/kernel us: " +
                      " | ".join(f"{y['us_median']:.1f} / {y['kernel_us_median']:.1f}" for y in rows))
    tables = [transport(f"{out}/transport_{b}_r{r}.log") for b in bins]
    for rows in zip(*tables):
        print(f"transport T={rows[0][0]} dispatch / combine / d+c us: " + " | ".join(f"{d} / {c} / {t}" for _, d, c, t in rows))
PY
}

# The mega backend. Its kernel first ran here: every test in its own process with a short wait bound
# (a hang costs TEST_TIMEOUT, then the rest is skipped), the routed EP1 tests beside it (the shared
# building blocks), then the tool.
mega() {  # [tests|check|bench|timeline|layers|sanitize|all]
  local what=${1:-all} t trc args i=0 crc preset shared
  export MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-3000}
  if [[ $what == tests || $what == all ]]; then
    : > "$OUT/mega_tests.log"
    for t in $("$BIN/megamoe_gpu_tests" --gtest_filter="${MEGA_FILTER:-Sm90Mega*}:Sm90/Sm90Routed.*EP1*" --gtest_list_tests | \
               awk '/^[^ ]/ {s=$1} /^  / {print s $1}'); do
      timeout "${TEST_TIMEOUT:-90}" "$BIN/megamoe_gpu_tests" --gtest_filter="$t" >> "$OUT/mega_tests.log" 2>&1
      trc=$?
      printf '%-90s %s\n' "$t" "$([[ $trc -eq 0 ]] && echo ok || echo "FAIL rc=$trc")" | tee -a "$OUT/mega_summary.txt"
      [[ $trc -eq 0 ]] || rc=1
      if [[ $trc -eq 124 ]]; then echo "test timed out (hang?): skipping the rest"; break; fi
    done
    grep -E "^\[mega\]|Failure|Which is|error" "$OUT/mega_tests.log" | head -60
  fi
  if [[ $what == check || $what == all ]]; then
    for args in "--preset tiny --ep 1 --tokens 64" "--preset qwen3-30b-a3b --ep 1 --tokens 96" \
                "--preset deepseek-v3 --experts 16 --ep 1 --tokens 8" "--preset tiny --ep 2 --shared-gpu --tokens 64" \
                "--preset qwen3-30b-a3b --ep 2 --shared-gpu --tokens 64"; do
      i=$((i + 1))
      # shellcheck disable=SC2086
      timeout 200 "$TOOL" check --backend mega $args > "$OUT/mega_check$i.log" 2>&1
      crc=$?
      [[ $crc -eq 0 ]] || rc=1
      echo "== megamoe check --backend mega $args: exit $crc"
      tail -4 "$OUT/mega_check$i.log"
    done
  fi
  if [[ $what == bench || $what == timeline || $what == all ]]; then
    for preset in ${PRESETS:-deepseek-v3 deepseek-v4-flash qwen3-30b-a3b}; do
      for shared in "--ep 1" "--ep 2 --shared-gpu"; do
        echo "== $preset $shared"
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-400}" "$TOOL" bench --preset "$preset" --backend mega,routed $shared \
          --tokens "${TOKENS:-1,8,64,128,512,1024,2048,4096,8192}" --iters "${ITERS:-20}" --warmup "${WARMUP:-5}" \
          --max-host-gb 100 --json "$OUT/mega_${preset}_${shared// /_}.json" > "$OUT/mega_${preset}_${shared// /_}.log" 2>&1 || rc=1
        grep -vE "^\[bench\]" "$OUT/mega_${preset}_${shared// /_}.log" | tail -24
      done
    done
  fi
  if [[ $what == layers || $what == all ]]; then
    for preset in deepseek-v3 qwen3-30b-a3b; do
      for n in 1 "${LAYERS:-4}"; do
        echo "== $preset --layers $n"
        timeout "${BENCH_TIMEOUT:-300}" "$TOOL" bench --preset "$preset" --backend mega,routed --layers "$n" \
          --tokens "${LAYER_TOKENS:-1,8,64}" --iters "${ITERS:-20}" --warmup "${WARMUP:-5}" --max-host-gb 100 \
          --json "$OUT/mega_layers_${preset}_$n.json" > "$OUT/mega_layers_${preset}_$n.log" 2>&1 || rc=1
        grep -vE "^\[bench\]" "$OUT/mega_layers_${preset}_$n.log" | tail -8
      done
    done
  fi
  if [[ $what == sanitize || $what == all ]]; then
    local tool ct logs=()
    ct=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
      timeout 300 "$ct" --tool "$tool" --print-limit "${PRINT_LIMIT:-10000}" "$BIN/megamoe_gpu_tests" \
        --gtest_filter='Sm90/Sm90Mega.*Tiny_T64:Sm90/Sm90Mega.*Tiny_T1:Sm90MegaEdges.ZeroTokens*' > "$OUT/mega_$tool.log" 2>&1
      trc=$?
      echo "== compute-sanitizer --tool $tool: exit $trc"
      [[ $trc -eq 124 ]] && rc=1
      logs+=("$OUT/mega_$tool.log")
    done
    python3 "$(dirname "$0")/sanitize_report.py" "${logs[@]}" | tee "$OUT/mega_sanitize_summary.txt" || rc=1
  fi
}

sanitize() {
  local filter=${1:-${FILTER:-Sm90Transport.Bf16Wire*:Sm90Transport.Nvfp4*}} tool trc logs=()
  if ! command -v compute-sanitizer > /dev/null 2>&1; then echo "no compute-sanitizer here"; rc=1; return; fi
  for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
    # Every report printed (up to PRINT_LIMIT) so that each is attributed by sanitize_report.py's rule.
    MEGAMOE_WAIT_TIMEOUT_MS=30000 timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" \
      --print-limit "${PRINT_LIMIT:-10000}" "$BIN/megamoe_gpu_tests" --gtest_filter="$filter" \
      > "$OUT/sanitize_$tool.log" 2>&1
    trc=$?
    echo "$tool: exit $trc"
    [[ $trc -eq 124 ]] && { echo "$tool: timed out after ${SANITIZE_TIMEOUT:-150} s"; rc=1; }
    logs+=("$OUT/sanitize_$tool.log")
  done
  # This project's errors only: NCCL's own host-side reports are filtered by rule (the script says which).
  python3 "$(dirname "$0")/sanitize_report.py" "${logs[@]}" | tee "$OUT/sanitize_summary.txt" || rc=1
}

# MODE=sections: SpeedOfLight, WarpStateStats, MemoryWorkloadAnalysis of the GEMM at deepseek-v3
#   128 experts x 512 rows (FCS: fc1 fc2).
# MODE=metrics: DRAM and L2 byte counts and tensor-pipe activity for each "experts:rows:fc" of CASES
#   (EXTRA: more bench-gemm flags).
# MODE=source: per-instruction stall samples (SASS) of one launch of the kernel whose mangled name
#   matches KERNEL (default: the fp8 SwiGLU configurations) under bench-gemm ARGS: $OUT/source.csv.
profile() {
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  local ncu fc c experts rows metrics kernel args
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  if [[ -z $ncu ]]; then echo "no ncu on this machine"; return; fi
  "$ncu" --version | tail -1
  case ${MODE:-sections} in
    metrics)
      metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
      metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum
      metrics+=,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_op_write.sum
      metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
      metrics+=,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
      for c in ${CASES:-128:512:fc1 32:512:fc1}; do
        IFS=: read -r experts rows fc <<< "$c"
        echo "## $BIN experts=$experts rows=$rows $fc ${EXTRA:-}"
        # shellcheck disable=SC2086
        timeout 200 "$ncu" --clock-control none --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 1 \
          --metrics "$metrics" "$TOOL" bench-gemm --preset deepseek-v3 --experts "$experts" --tokens "$rows" --fc "$fc" \
          --no-cublas --no-swiglu --iters 3 --warmup 1 ${EXTRA:-} > "$OUT/ncu_${experts}_${rows}_$fc.txt" 2>&1 || rc=1
        grep -E "^\s+(gpu__|dram__|lts__|sm__)|ERR|rror" "$OUT/ncu_${experts}_${rows}_$fc.txt" | head -20
      done
      ;;
    source)
      kernel=${KERNEL:-ELb1ELi1EE}
      args=${ARGS:---preset qwen3-30b-a3b --experts 64 --tokens 1024 --fc fc1 --no-cublas --iters 2 --warmup 1}
      # shellcheck disable=SC2086
      timeout 300 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:$kernel" --launch-skip 1 \
        --launch-count 1 --section SourceCounters --section WarpStateStats --export "$OUT/prof" \
        "$BIN/${BINARY:-megamoe}" bench-gemm $args > "$OUT/ncu.txt" 2>&1 || rc=1
      grep -E "==PROF==|rror" "$OUT/ncu.txt" | head -5
      "$ncu" --import "$OUT/prof.ncu-rep" --page source --print-source sass --csv > "$OUT/source.csv" 2>&1
      echo "source page: $(wc -l < "$OUT/source.csv") lines"
      "$ncu" --import "$OUT/prof.ncu-rep" --section WarpStateStats --page details > "$OUT/warpstate.txt" 2>&1
      grep -iE "stall|cycles per" "$OUT/warpstate.txt" | head -30
      rm -f "$OUT/prof.ncu-rep"
      ;;
    *)
      for fc in ${FCS:-fc1 fc2}; do
        timeout 240 "$ncu" --clock-control none --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
          --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,sm__warps_active.avg.pct_of_peak_sustained_active \
          "$TOOL" bench-gemm --preset deepseek-v3 --experts 128 --tokens 512 --fc "$fc" --no-cublas --no-swiglu \
          --iters 3 --warmup 1 > "$OUT/ncu_$fc.txt" 2>&1 || rc=1
        grep -E "gmma|lts__t_bytes|Duration|Throughput|Stall|stall|Warp Cycles|Issued|L2 Cache|ERR|rror" "$OUT/ncu_$fc.txt" | head -40
      done
      ;;
  esac
}

verify() {
  local end=$((SECONDS + ${VERIFY_SECONDS:-540})) root=$OUT
  # stage NAME SECONDS CMD...: CMD under timeout in $root/NAME (its own OUT), skipped without time left
  # or when STAGES (space-separated names; default: every stage) does not name it
  stage() {
    local name=$1 s=$2 left=$((end - SECONDS)) t0=$SECONDS src
    shift 2
    if [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]]; then return; fi
    if ((left < 30)); then echo "== $name: skipped (VERIFY_SECONDS spent)"; return; fi
    ((s > left - 20)) && s=$((left - 20))
    mkdir -p "$root/$name"
    OUT=$root/$name timeout -k 5 "$s" "$@" > "$root/$name/console.log" 2>&1
    src=$?
    [[ $src -eq 0 ]] || rc=1
    echo "== $name: exit $src in $((SECONDS - t0)) s"
    grep -E '^\[  (PASSED|FAILED) |^\[  FAILED  \]|^(mega|routed) |^\[soak\].*total|python: pytest' \
      "$root/$name/console.log" | cut -c1-170 | head -30
  }
  export MEGAMOE_WAIT_TIMEOUT_MS=${MEGAMOE_WAIT_TIMEOUT_MS:-3000}
  local T=$BIN/megamoe_gpu_tests mega='Sm90/Sm90Mega.*:Sm90MegaEdges.*' shared='*SharedGpu*'
  stage in_kernel_reduce 120 "$T" --gtest_filter='*InKernelFc2Reduce*:Sm90MegaEdges.AutoSelects*:TransportOptions.*'
  local preset
  for preset in qwen3-30b-a3b deepseek-v3; do
    stage "bench_in_kernel_reduce_$preset" 150 "$TOOL" bench --preset "$preset" --backend mega --ep 1 \
      --in-kernel-fc2-reduce --tokens "${IKR_TOKENS:-1,8,128,1024,8192}" --iters 10 --warmup 3 --max-host-gb 100 \
      --json "$root/bench_in_kernel_reduce_$preset.json"
  done
  stage mega_ep1 90 "$T" --gtest_filter="$mega"
  stage shared_gpu 150 "$T" --gtest_filter="$shared:-*Soak*"
  stage suite 200 "$T" --gtest_filter="*-$mega:$shared:*Soak*"
  MEGAMOE_SOAK_FORWARDS=${SOAK_FORWARDS:-300} stage soak 120 "$T" --gtest_filter='*Soak*'
  for preset in qwen3-30b-a3b deepseek-v3; do
    stage "bench_$preset" 300 "$TOOL" bench --preset "$preset" --backend mega,routed --ep 1 \
      --tokens "${TOKENS:-1,8,64,128,512,1024,2048,4096,8192}" --iters "${ITERS:-10}" --warmup 3 --max-host-gb 100 \
      --json "$root/bench_$preset.json"
  done
  [[ -d $BIN/python ]] && stage python 120 bash "$0" python
  OUT=$root pack_out
}

python_tests() {
  local wheel
  wheel=$(ls "$BIN"/python/megamoe-*.whl 2>/dev/null | head -1)
  if [[ -z $wheel ]]; then
    echo "python: no wheel in $BIN/python/ (build one here with the device's python3: pip wheel --no-deps .)"
    rc=1
    return
  fi
  python3 -m pip install -q --no-deps --no-index --target "$OUT/site" "$wheel" > "$OUT/pip.log" 2>&1 || {
    echo "python: pip install of $wheel failed"; tail -5 "$OUT/pip.log"; rc=1; return; }
  # torch's own libstdc++ may be older than the one the module was built against
  PYTHONPATH=$OUT/site LD_PRELOAD=${PY_PRELOAD-/usr/lib/x86_64-linux-gnu/libstdc++.so.6} MEGAMOE_WAIT_TIMEOUT_MS=5000 \
    timeout "${PY_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider tests/python > "$OUT/pytest.log" 2>&1
  local prc=$?
  echo "python: pytest exit $prc"
  grep -E "host time per forward|kernel nodes|routed vs cpu|FAILED|Error|passed|failed|skipped" "$OUT/pytest.log" | tail -25
  [[ $prc -eq 0 ]] || rc=1
  TEST_TIMEOUT=120 run_tests "${FILTER:-Sm90RoutedInputs*:Sm90RoutedFaults.ErrorPending*}" || rc=1
}

case $sub in
  tests) tests "$@" ;;
  check) check ;;
  bench-table) bench_table ;;
  layer-ab) tests_if_filter || rc=1; for_lines_and_bins "${CASES:-}" layer_ab_one ;;
  launch) launch "$@" ;;
  barrier-timeout) barrier_timeout ;;
  gemm) gemm "$@" ;;
  fp4) fp4 "$@" ;;
  gemm-ab) gemm_ab ;;
  gemm-matrix) gemm_matrix "$@" ;;
  transport) transport "$@" ;;
  transport-ab) tests_if_filter || rc=1; for_lines_and_bins "${BENCH:-}" transport_ab_one ;;
  link) link ;;
  harness-ab) harness_ab ;;
  mega) mega "$@" ;;
  tune)
    tune_one tiny 1,8,128
    for preset in ${PRESETS:-deepseek-v3 qwen3-30b-a3b}; do tune_one "$preset" "${TOKENS:-1,8,128,1024,4096,8192}"; done
    tune_table
    echo "plots (here, with matplotlib): megamoe plot OUT/tune_<preset>.json tune.png; megamoe plot OUT/bench_<preset>_tuned_r1.json bench.png"
    ;;
  sanitize) sanitize "$@" ;;
  profile) profile ;;
  python) python_tests ;;
  verify) verify ;;
esac
exit $rc
