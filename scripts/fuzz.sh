#!/usr/bin/env bash
# Fuzzes the parsers of untrusted input with libFuzzer (needs clang++ with -fsanitize=fuzzer):
#   bash scripts/fuzz.sh [SECONDS per target (60)] [WORKDIR (build/fuzz)] [TARGET...]
# Targets (tests/fuzz/*_fuzz_target.h say what each checks):
#   safetensors_header  the safetensors header parser (src/io/safetensors.cpp)
#   knob_cache          the knob cache reader (KnobCache::parse, src/tune/knob_cache.cpp)
#   nccl_env            NcclBootstrap's environment parse (src/comm/nccl_bootstrap.cpp)
#   tool_args           the flag parse of every `megamoe` subcommand (parse_tool_args, tools/megamoe/)
# Each is built with ASan + UBSan (the code under test instrumented; the rest of the library linked
# from build/, built first when missing), seeded with tests/fuzz/corpus/<target>/ (read only: new
# inputs go to WORKDIR/<target>/corpus), and run for SECONDS. Prints the executions per target and
# exits non-zero on a crash (the reproducer is left in WORKDIR/<target>/). The CI replays bounded
# mutations of the same seeds through the same targets (tests/cpu/test_*_fuzz.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
secs=${1:-60}
work=${2:-build/fuzz}
shift $(($# > 2 ? 2 : $#))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors_header knob_cache nccl_env tool_args)
CXX=${FUZZ_CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: no $CXX (libFuzzer needs clang)" >&2; exit 2; }
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cuda=${CUDA_HOME:-/usr/local/cuda}
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -Iinclude -Isrc -Itests -Itools/megamoe -Ibuild/generated -isystem "$cuda/include" -DMEGAMOE_VERSION=\"fuzz\")
# The library, its CUDA part and the tool's kernels, as build/ has them (gcc and nvcc objects; only the
# sources named per target below are instrumented).
need_build() {
  if [ ! -f build/libmegamoe_tool_lib.a ] || [ ! -f build/libmegamoe.a ] || [ ! -f build/libmegamoe_cuda.a ]; then
    [ -f build/CMakeCache.txt ] || cmake --preset default >/dev/null
    cmake --build build --target megamoe_tool_lib -j "$(nproc)"
  fi
}
libs() {
  echo build/CMakeFiles/megamoe_tool_lib.dir/tools/megamoe/*.cu.o build/libmegamoe.a build/libmegamoe_cuda.a \
    -L"$cuda/lib64" -L"$cuda/targets/x86_64-linux/lib" -Wl,-rpath,"$cuda/lib64" -lcudart -lnccl -lcublasLt -ldl -lpthread
}

build_target() {
  local t=$1 out=$work/$1/fuzz_$1
  mkdir -p "$work/$t/corpus"
  case $t in
    safetensors_header)
      "$CXX" "${flags[@]}" tests/fuzz/fuzz_safetensors_header.cpp src/io/safetensors.cpp src/core/status.cpp -o "$out" ;;
    knob_cache)
      need_build
      # shellcheck disable=SC2046
      "$CXX" "${flags[@]}" tests/fuzz/fuzz_knob_cache.cpp src/tune/knob_cache.cpp $(libs) -o "$out" ;;
    nccl_env)
      need_build
      # shellcheck disable=SC2046
      "$CXX" "${flags[@]}" tests/fuzz/fuzz_nccl_env.cpp src/comm/nccl_bootstrap.cpp $(libs) -o "$out" ;;
    tool_args)
      need_build
      local srcs=()
      for f in tools/megamoe/*.cpp; do [ "$f" = tools/megamoe/main.cpp ] || srcs+=("$f"); done
      # shellcheck disable=SC2046
      "$CXX" "${flags[@]}" tests/fuzz/fuzz_tool_args.cpp "${srcs[@]}" $(libs) -o "$out" ;;
    *) echo "fuzz.sh: unknown target '$t'" >&2; exit 2 ;;
  esac
}

summary=()
rc=0
for t in "${targets[@]}"; do
  echo "== $t: building"
  build_target "$t"
  echo "== $t: fuzzing for ${secs} s"
  log=$work/$t/fuzz.log
  # Quiet the library's warnings (one per refused input); max_len: a command line, a header, a file.
  set +e
  (cd "$work/$t" && MEGAMOE_LOG=0 ./fuzz_"$t" -max_total_time="$secs" -max_len=4096 -print_final_stats=1 \
     corpus "$root/tests/fuzz/corpus/$t" >fuzz.log 2>&1)
  trc=$?
  set -e
  tail -3 "$log"
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  if [ "$trc" -ne 0 ]; then
    rc=1
    summary+=("$t: CRASH after ${runs} executions (rc $trc; see $log and the crash-* file in $work/$t)")
  else
    summary+=("$t: ${runs} executions in ${secs} s, no crash")
  fi
done
echo "== fuzz summary"
printf '%s\n' "${summary[@]}"
exit "$rc"
