// What the fuzz targets share: splitting an input into fields, the seed corpus in the repository
// (tests/fuzz/corpus/<target>/, also libFuzzer's seeds in scripts/fuzz.sh), and the mutations the CI
// replays apply to those seeds (tests/cpu/test_*_fuzz.cpp; libFuzzer finds more, this is bounded).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace megamoe::fuzz {

// The input cut at every '\n' (n newlines give n + 1 fields; an empty input gives one empty field).
inline std::vector<std::string> split_lines(const uint8_t* data, size_t size) {
  std::vector<std::string> fields(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') fields.emplace_back();
    else fields.back() += static_cast<char>(data[i]);
  }
  return fields;
}

// Every file of `dir` (sorted by name), as bytes.
inline std::vector<std::string> read_corpus(const std::string& dir) {
  std::vector<std::filesystem::path> paths;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::ifstream f(p, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    out.push_back(s.str());
  }
  return out;
}

// One to three edits of `s`: a bit flipped, a cut, a span deleted or repeated, or one of `tokens`
// (the format's own words and boundary values) written over or inserted at a random place.
inline void mutate(std::string* s, std::mt19937* rng, const std::vector<std::string>& tokens) {
  std::mt19937& r = *rng;
  const int edits = 1 + static_cast<int>(r() % 3);
  for (int k = 0; k < edits; ++k) {
    const size_t n = s->size();
    const size_t at = n ? r() % (n + 1) : 0;
    const size_t len = n > at ? 1 + r() % std::min<size_t>(16, n - at) : 0;
    switch (r() % 6) {
      case 0:
        if (n) (*s)[r() % n] ^= static_cast<char>(1u << (r() % 8));
        break;
      case 1:
        s->resize(at);
        break;
      case 2:
        s->erase(at, len);
        break;
      case 3:
        s->insert(at, s->substr(at, len));
        break;
      case 4:
        s->replace(at, len, tokens[r() % tokens.size()]);
        break;
      default:
        s->insert(at, tokens[r() % tokens.size()]);
        break;
    }
  }
}

}  // namespace megamoe::fuzz
