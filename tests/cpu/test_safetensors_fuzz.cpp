// The safetensors fuzz target (tests/fuzz/safetensors_fuzz_target.h) replayed in CI on mutations of
// valid files: byte flips, truncations, bytes inserted into the header, random header lengths. Every
// input must be handled (ok or an error naming the input), and an accepted header must keep every
// tensor inside the file and apart from the others. scripts/fuzz.sh runs the same target under
// libFuzzer with sanitizers.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fuzz/safetensors_fuzz_target.h"

namespace {

std::vector<uint8_t> file_of(std::string header, size_t data_bytes) {
  while (header.size() % 8) header += ' ';
  std::vector<uint8_t> f(8 + header.size() + data_bytes, 0x5A);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[i] = uint8_t(n >> (8 * i));
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

TEST(SafetensorsFuzz, MutationsOfValidFilesAreHandled) {
  const std::vector<std::vector<uint8_t>> seeds = {
      file_of(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"U8","shape":[4],"data_offsets":[24,28]}})", 28),
      file_of(R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F8_E4M3","shape":[16],"data_offsets":[0,16]},"s":{"dtype":"F4","shape":[8],"data_offsets":[16,20]}})", 20),
      file_of("{}", 0),
  };
  std::mt19937 rng(2024u);
  int64_t accepted = 0, refused = 0;
  for (int it = 0; it < 60000; ++it) {
    std::vector<uint8_t> f = seeds[rng() % seeds.size()];
    switch (rng() % 5) {
      case 0:  // flip bytes
        for (int k = 0, n = 1 + int(rng() % 4); k < n; ++k) f[rng() % f.size()] ^= uint8_t(1u << (rng() % 8));
        break;
      case 1:  // truncate
        f.resize(rng() % (f.size() + 1));
        break;
      case 2: {  // a digit or a structural character written into the header
        const char* chars = "0123456789[]{},:\"-.eE ";
        if (f.size() > 9) f[8 + rng() % (f.size() - 8)] = uint8_t(chars[rng() % std::strlen(chars)]);
        break;
      }
      case 3:  // a random header length
        for (int i = 0; i < 8; ++i) f[i] = i < 2 ? uint8_t(rng()) : (rng() % 8 == 0 ? uint8_t(rng()) : 0);
        break;
      default:  // bytes inserted inside the header
        if (f.size() > 9) f.insert(f.begin() + 8 + long(rng() % (f.size() - 8)), uint8_t(rng()));
        break;
    }
    megamoe::io::StHeader h;
    const megamoe::Status st = megamoe::io::parse_safetensors_header(f.data(), f.size(), f.size(), "fuzz-input", &h);
    (st.is_ok() ? accepted : refused)++;
    if (!st.is_ok()) ASSERT_NE(st.message().find("fuzz-input"), std::string::npos) << st.message();
    ASSERT_EQ(megamoe::fuzz::safetensors_header_one_input(f.data(), f.size()), 0);
  }
  std::printf("%lld accepted, %lld refused\n", (long long)accepted, (long long)refused);
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
