// The knob cache reader's fuzz target (tests/fuzz/knob_cache_fuzz_target.h) replayed in CI on
// mutations of the seed corpus (tests/fuzz/corpus/knob_cache/): every text loads with no crash, a
// warning names the file, and what loads writes back and reads back unchanged. scripts/fuzz.sh runs
// the same target under libFuzzer with sanitizers.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/env.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/knob_cache_fuzz_target.h"

namespace {

TEST(KnobCacheFuzz, MutationsOfTheSeedCorpusAreHandled) {
  setenv("MEGAMOE_LOG", "0", 1);  // a warning per refused input would flood the log
  megamoe::reload_env_knobs();
  const std::vector<std::string> seeds = megamoe::fuzz::read_corpus(MEGAMOE_SOURCE_DIR "/tests/fuzz/corpus/knob_cache");
  ASSERT_GE(seeds.size(), 3u);
  const std::vector<std::string> tokens = {
      "{", "}", "[", "]", ",", ":", "\"", "null", "true", "-1", "0", "1", "1.5", "1e400", "-0.0",
      "9223372036854775807", "9223372036854775808", "18446744073709551616", "-9223372036854775809", "2147483648",
      "\"version\":1,", "\"entries\":[]", "\"knobs\":{}", "\"block_m\":16", "\"backend_us\":{\"mega\":1}",
      "\"owner_reduce\":\"auto\"", "\"mega_max_tokens_per_rank\":-2", "\"\\u0000\"", "\"\\ud800\"", "\xff"};
  std::mt19937 rng(24u);
  int64_t loaded = 0, refused = 0;
  for (int it = 0; it < 100000; ++it) {
    std::string text = seeds[rng() % seeds.size()];
    megamoe::fuzz::mutate(&text, &rng, tokens);
    std::string warning;
    const megamoe::KnobCache c = megamoe::KnobCache::parse(text, "fuzz-input", &warning);
    (c.size() > 0 ? loaded : refused)++;
    ASSERT_EQ(megamoe::fuzz::knob_cache_one_input(reinterpret_cast<const uint8_t*>(text.data()), text.size()), 0);
  }
  std::printf("%lld inputs with entries, %lld without\n", (long long)loaded, (long long)refused);
  EXPECT_GT(loaded, 0);
  EXPECT_GT(refused, 0);
  unsetenv("MEGAMOE_LOG");
  megamoe::reload_env_knobs();
}

}  // namespace
