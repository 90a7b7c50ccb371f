#!/usr/bin/env bash
# Fuzzes the safetensors header parser with libFuzzer (needs clang++ with -fsanitize=fuzzer):
#   bash scripts/fuzz.sh [SECONDS (60)] [WORKDIR (build/fuzz)]
# Builds the target with ASan + UBSan, seeds the corpus with small valid and broken files, runs for
# SECONDS, and exits non-zero on a crash (the reproducer is left in WORKDIR).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
work=${2:-build/fuzz}
mkdir -p "$work/corpus"
CXX=${FUZZ_CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: no $CXX (libFuzzer needs clang)" >&2; exit 2; }
"$CXX" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Isrc -Itests tests/fuzz/fuzz_safetensors_header.cpp src/io/safetensors.cpp src/core/status.cpp \
  -o "$work/fuzz_safetensors_header"
# seeds: an empty header, one tensor, metadata, an overlap
seed() { python3 - "$1" "$2" <<'PY'
import struct, sys
h = sys.argv[2].encode()
h += b' ' * (-len(h) % 8)
open(sys.argv[1], 'wb').write(struct.pack('<Q', len(h)) + h + b'\0' * 64)
PY
}
seed "$work/corpus/empty" '{}'
seed "$work/corpus/one" '{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}'
seed "$work/corpus/meta" '{"__metadata__":{"format":"pt"},"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]},"s":{"dtype":"F4","shape":[4],"data_offsets":[8,10]}}'
seed "$work/corpus/overlap" '{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}}'
cd "$work"
./fuzz_safetensors_header -max_total_time="$secs" -max_len=4096 corpus 2>&1 | tail -5
