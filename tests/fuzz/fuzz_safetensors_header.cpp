// libFuzzer entry point over the safetensors header parser (see safetensors_fuzz_target.h).
// Built and run by scripts/fuzz.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include "fuzz/safetensors_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return megamoe::fuzz::safetensors_header_one_input(data, size);
}
