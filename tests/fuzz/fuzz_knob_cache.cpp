// libFuzzer entry point over the knob cache reader (see knob_cache_fuzz_target.h).
// Built and run by scripts/fuzz.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include <cstdlib>

#include "core/env.h"
#include "fuzz/knob_cache_fuzz_target.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("MEGAMOE_LOG", "0", 1);  // a warning per input would flood the run
  megamoe::reload_env_knobs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return megamoe::fuzz::knob_cache_one_input(data, size);
}
