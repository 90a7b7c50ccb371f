// The safetensors header parser's fuzz target (src/io/safetensors.h), shared by the libFuzzer binary
// (tests/fuzz/fuzz_safetensors_header.cpp, scripts/fuzz.sh) and the CPU test that replays mutations of
// valid files (tests/cpu/test_safetensors_fuzz.cpp). Any input must give ok or an error, never a crash,
// and a header that parses must keep every tensor inside the file and apart from the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "io/safetensors.h"

namespace megamoe::fuzz {

// 0 when the input was handled; aborts when an accepted header breaks an invariant.
inline int safetensors_header_one_input(const uint8_t* data, size_t size) {
  io::StHeader h;
  const Status st = io::parse_safetensors_header(data, size, size, "fuzz-input", &h);
  if (!st.is_ok()) {
    if (st.message().empty()) std::abort();
    return 0;
  }
  if (h.data_offset != 8 + h.json_bytes || h.data_offset > size || h.data_bytes != size - h.data_offset) std::abort();
  uint64_t prev_end = 0;
  for (const io::StTensor& t : h.tensors) {
    if (t.begin > t.end || t.end > h.data_bytes) std::abort();
    if (t.bytes() > 0 && t.begin < prev_end) std::abort();
    if (t.bytes() > 0) prev_end = t.end;
    if (h.find(t.name) != &t) std::abort();
  }
  return 0;
}

}  // namespace megamoe::fuzz
