// NcclBootstrap's environment parse as a fuzz target (tests/fuzz/nccl_env_fuzz_target.h), replayed in
// CI on mutations of the seed corpus (tests/fuzz/corpus/nccl_env/): any values give ok or an error
// naming the variable, and an accepted bootstrap holds exactly the values' integers in range.
// scripts/fuzz.sh runs the same target under libFuzzer with sanitizers.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "fuzz/nccl_env_fuzz_target.h"

namespace {

TEST(NcclEnvFuzz, MutationsOfTheSeedCorpusAreHandled) {
  const std::vector<std::string> seeds = megamoe::fuzz::read_corpus(MEGAMOE_SOURCE_DIR "/tests/fuzz/corpus/nccl_env");
  ASSERT_GE(seeds.size(), 3u);
  const std::vector<std::string> tokens = {"0", "1", "7", "8", "\n", "1048576", "1048577", "9999999", "10000000",
                                           "+1", " 1", "1 ", "-0", "0x10", std::string(1, '\0'), "0000001", "1e3",
                                           std::string(256, 'F'), std::string(255, '0'), "g", "/tmp/id"};
  std::mt19937 rng(2026u);
  int64_t accepted = 0, refused = 0;
  for (int it = 0; it < 50000; ++it) {
    std::string input = seeds[rng() % seeds.size()];
    megamoe::fuzz::mutate(&input, &rng, tokens);
    const auto* data = reinterpret_cast<const uint8_t*>(input.data());
    megamoe::NcclBootstrap b;
    (megamoe::NcclBootstrap::from_values(megamoe::fuzz::nccl_env_of(data, input.size()), &b).is_ok() ? accepted
                                                                                                     : refused)++;
    ASSERT_EQ(megamoe::fuzz::nccl_env_one_input(data, input.size()), 0);
  }
  std::printf("%lld accepted, %lld refused\n", (long long)accepted, (long long)refused);
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
