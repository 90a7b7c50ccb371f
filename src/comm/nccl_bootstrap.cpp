// NcclBootstrap's parse of the launcher's variables (megamoe/comm.h). No NCCL or CUDA here: the parse
// is tested (and fuzzed, tests/fuzz/nccl_env_fuzz_target.h) on any strings, without a GPU.
#include <cstdio>
#include <sstream>
#include <string>

#include "core/env.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

// A value as a message shows it: at most 64 characters, bytes outside printable ASCII as \xNN.
std::string shown(const std::string& v) {
  constexpr size_t kMaxChars = 64;
  std::string s;
  for (size_t i = 0; i < v.size() && i < kMaxChars; ++i) {
    const unsigned char c = static_cast<unsigned char>(v[i]);
    if (c >= 0x20 && c < 0x7f) {
      s += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      s += buf;
    }
  }
  if (v.size() > kMaxChars) s += "...";
  return s;
}

// Decimal digits only, at most NcclBootstrap::kMaxRank. False for anything else (empty included).
bool parse_count(const std::string& v, int* out) {
  if (v.empty() || v.size() > 7) return false;
  int x = 0;
  for (const char c : v) {
    if (c < '0' || c > '9') return false;
    x = 10 * x + (c - '0');
  }
  if (x > NcclBootstrap::kMaxRank) return false;
  *out = x;
  return true;
}

bool is_hex(const std::string& v) {
  for (const char c : v)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return false;
  return true;
}

}  // namespace

Status NcclBootstrap::from_values(const EnvValues& v, NcclBootstrap* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to an NcclBootstrap");
  // Unset: say what it is and who sets it; malformed: say what it must be.
  auto refuse = [](const char* name, const std::string& value, const char* what) {
    if (value.empty())
      return invalid_argument("NCCL bootstrap", name, "unset", std::string("set it to ") + what + " (megamoe launch does)");
    return invalid_argument("NCCL bootstrap", name, shown(value),
                            "must be a non-negative integer in decimal digits (no sign or space) <= " +
                                std::to_string(kMaxRank) + ": " + what);
  };
  NcclBootstrap b;
  if (!parse_count(v.rank, &b.rank)) return refuse("MEGAMOE_RANK", v.rank, "this process's rank");
  if (!parse_count(v.world_size, &b.world_size)) return refuse("MEGAMOE_WORLD_SIZE", v.world_size, "the number of ranks");
  if (b.world_size < 1)
    return invalid_argument("NCCL bootstrap", "MEGAMOE_WORLD_SIZE", shown(v.world_size), "must be >= 1");
  if (b.rank >= b.world_size)
    return invalid_argument("NCCL bootstrap", "MEGAMOE_RANK", shown(v.rank),
                            "must be below MEGAMOE_WORLD_SIZE=" + std::to_string(b.world_size));
  if (!v.local_rank.empty() && !parse_count(v.local_rank, &b.device))
    return refuse("MEGAMOE_LOCAL_RANK", v.local_rank, "the CUDA ordinal of this rank");
  if (!v.id_hex.empty() && (v.id_hex.size() != kIdHexDigits || !is_hex(v.id_hex)))
    return invalid_argument("NCCL bootstrap", "MEGAMOE_NCCL_ID", shown(v.id_hex),
                            "must be " + std::to_string(kIdHexDigits) + " hex digits (nccl_unique_id_hex()); got " +
                                std::to_string(v.id_hex.size()) + " characters");
  if (v.id_hex.empty() && v.id_file.empty())
    return invalid_argument("NCCL bootstrap", "MEGAMOE_NCCL_ID_FILE", "unset",
                            "set MEGAMOE_NCCL_ID_FILE (a fresh path all ranks see) or MEGAMOE_NCCL_ID");
  if (v.id_file.find('\0') != std::string::npos)
    return invalid_argument("NCCL bootstrap", "MEGAMOE_NCCL_ID_FILE", shown(v.id_file), "must not contain a NUL byte");
  b.id_file = v.id_file;
  b.id_hex = v.id_hex;
  *out = b;
  return Status::ok();
}

Status NcclBootstrap::from_env(NcclBootstrap* out) {
  const EnvKnobs& env = env_knobs();
  return from_values({env.rank, env.world_size, env.local_rank, env.nccl_id_file, env.nccl_id}, out);
}

std::string NcclBootstrap::to_string() const {
  std::ostringstream os;
  os << "NcclBootstrap(rank=" << rank << ", world_size=" << world_size << ", device=" << device
     << ", id_file=" << (id_file.empty() ? "-" : id_file) << ", id_hex=" << (id_hex.empty() ? "-" : "<set>") << ")";
  return os.str();
}

}  // namespace megamoe
