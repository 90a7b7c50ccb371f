// libFuzzer entry point over NcclBootstrap's environment parse (see nccl_env_fuzz_target.h).
// Built and run by scripts/fuzz.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include "fuzz/nccl_env_fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return megamoe::fuzz::nccl_env_one_input(data, size);
}
