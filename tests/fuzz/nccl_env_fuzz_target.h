// NcclBootstrap's environment parse (NcclBootstrap::from_values, megamoe/comm.h) as a fuzz target,
// shared by the libFuzzer binary (tests/fuzz/fuzz_nccl_env.cpp, scripts/fuzz.sh) and the CPU test that
// replays mutations of the seed corpus (tests/cpu/test_bootstrap_fuzz.cpp). The input is the five
// variables, one a line, in the order of EnvValues (MEGAMOE_RANK, MEGAMOE_WORLD_SIZE,
// MEGAMOE_LOCAL_RANK, MEGAMOE_NCCL_ID_FILE, MEGAMOE_NCCL_ID); missing lines are unset, later ones
// ignored. Any values give ok or an error naming a MEGAMOE_ variable; an accepted bootstrap has
// 0 <= rank < world_size <= kMaxRank, a device of -1 or in [0, kMaxRank], the values' integers
// exactly, and an id source (256 hex digits, or a file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "megamoe/comm.h"

namespace megamoe::fuzz {

inline NcclBootstrap::EnvValues nccl_env_of(const uint8_t* data, size_t size) {
  std::vector<std::string> f = split_lines(data, size);
  f.resize(5);
  return {f[0], f[1], f[2], f[3], f[4]};
}

// Decimal digits without their leading zeros ("007" -> "7", "0" -> "0").
inline std::string without_leading_zeros(const std::string& s) {
  const size_t first = s.find_first_not_of('0');
  return first == std::string::npos ? (s.empty() ? s : "0") : s.substr(first);
}

// 0 when the input was handled; aborts when an accepted bootstrap breaks an invariant.
inline int nccl_env_one_input(const uint8_t* data, size_t size) {
  const NcclBootstrap::EnvValues v = nccl_env_of(data, size);
  NcclBootstrap b;
  const Status st = NcclBootstrap::from_values(v, &b);
  if (!st.is_ok()) {
    if (st.code() != StatusCode::kInvalidArgument || st.message().find("MEGAMOE_") == std::string::npos) std::abort();
    return 0;
  }
  if (b.rank < 0 || b.rank >= b.world_size || b.world_size > NcclBootstrap::kMaxRank) std::abort();
  if (std::to_string(b.rank) != without_leading_zeros(v.rank)) std::abort();
  if (std::to_string(b.world_size) != without_leading_zeros(v.world_size)) std::abort();
  if (v.local_rank.empty() ? b.device != -1 : std::to_string(b.device) != without_leading_zeros(v.local_rank))
    std::abort();
  if (b.id_hex != v.id_hex || b.id_file != v.id_file) std::abort();
  if (b.id_hex.empty() ? b.id_file.empty() : b.id_hex.size() != NcclBootstrap::kIdHexDigits) std::abort();
  return 0;
}

}  // namespace megamoe::fuzz
