// The knob cache reader's fuzz target (KnobCache::parse, megamoe/knobs.h), shared by the libFuzzer
// binary (tests/fuzz/fuzz_knob_cache.cpp, scripts/fuzz.sh) and the CPU test that replays mutations of
// the seed corpus (tests/cpu/test_knob_cache_fuzz.cpp). Any text must load (entries or none) with no
// crash or exception; a warning names the file; what loads writes back (to_json) and reads back to
// the same entries with no warning, and lookup() finds each entry under its own key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "megamoe/knobs.h"

namespace megamoe::fuzz {

inline bool same_entry(const KnobEntry& a, const KnobEntry& b) {
  for (const KnobField& f : knob_fields())
    if (a.knobs.*f.member != b.knobs.*f.member) return false;
  return a.owner_reduce == b.owner_reduce && a.mega_max_tokens_per_rank == b.mega_max_tokens_per_rank &&
         a.measured_us == b.measured_us && a.backend_us == b.backend_us && a.note == b.note;
}

// 0 when the input was handled; aborts when a loaded cache breaks an invariant.
inline int knob_cache_one_input(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::string warning;
  const KnobCache cache = KnobCache::parse(text, "fuzz-input", &warning);
  if (!warning.empty() && warning.find("knob cache fuzz-input") == std::string::npos) std::abort();
  std::string again_warning = "unset";
  const KnobCache again = KnobCache::parse(cache.to_json(), "round-trip", &again_warning);
  if (!again_warning.empty() || again.size() != cache.size()) std::abort();
  const auto a = cache.entries(), b = again.entries();
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i].first == b[i].first) || !same_entry(a[i].second, b[i].second)) std::abort();
    const std::optional<KnobEntry> found = cache.lookup(a[i].first);
    if (!found || !same_entry(*found, a[i].second)) std::abort();
  }
  return 0;
}

}  // namespace megamoe::fuzz
