// libFuzzer entry point over the tool's flag parse (see tool_args_fuzz_target.h).
// Built and run by scripts/fuzz.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include "fuzz/tool_args_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  megamoe::fuzz::tool_args_one_input(data, size);
  return 0;
}
