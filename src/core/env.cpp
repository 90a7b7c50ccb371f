#include "core/env.h"

#include <cstdlib>
#include <mutex>

#include "core/log.h"

namespace megamoe {
namespace {

EnvKnobs read_env() {
  EnvKnobs k;
  if (const char* v = std::getenv("MEGAMOE_KNOB_CACHE"); v && *v) {
    std::string s(v);
    if (s == "off" || s == "OFF" || s == "0") k.knob_cache_off = true;
    else k.knob_cache_path = s;
  }
  if (k.knob_cache_path.empty() && !k.knob_cache_off) {
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    std::string base = (xdg && *xdg) ? std::string(xdg) : std::string(home && *home ? home : "/tmp") + "/.cache";
    k.knob_cache_path = base + "/megamoe/knobs.json";
  }
  // A positive integer of milliseconds, else the default stays (with a warning naming the variable).
  auto read_ms = [](const char* name, int64_t* out) {
    const char* v = std::getenv(name);
    if (!v || !*v) return;
    char* end = nullptr;
    const long long ms = std::strtoll(v, &end, 10);
    if (end && *end == '\0' && ms > 0) *out = ms;
    else log_warn("ignoring %s=%s: must be a positive integer (milliseconds)", name, v);
  };
  read_ms("MEGAMOE_WAIT_TIMEOUT_MS", &k.wait_timeout_ms);
  read_ms("MEGAMOE_BARRIER_TIMEOUT_MS", &k.barrier_timeout_ms);
  if (const char* v = std::getenv("MEGAMOE_LOG"); v && *v) {
    char* end = nullptr;
    long lvl = std::strtol(v, &end, 10);
    if (end && *end == '\0' && lvl >= 0 && lvl <= 2) k.log_level = static_cast<int>(lvl);
    else log_warn("ignoring MEGAMOE_LOG=%s: must be 0, 1 or 2", v);
  }
  if (const char* v = std::getenv("MEGAMOE_MEGA_LAUNCH"); v && *v) {
    const std::string s(v);
    if (s == "plain") k.mega_plain_launch = true;
    else if (s != "cooperative") log_warn("ignoring MEGAMOE_MEGA_LAUNCH=%s: must be cooperative or plain", v);
  }
  if (const char* v = std::getenv("MEGAMOE_TILE_BUCKET"); v && *v) {
    const std::string b(v);
    if (b == "received") k.tile_bucket_received = true;
    else if (b != "local") log_warn("ignoring MEGAMOE_TILE_BUCKET=%s: must be local or received", v);
  }
  auto text = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  k.gemm_fp4_math_wg = text("MEGAMOE_GEMM_FP4_MATH_WG");
  k.gemm_fp4_ctas_per_sm = text("MEGAMOE_GEMM_FP4_CTAS_PER_SM");
  k.mxfp4_expand_rows = text("MEGAMOE_MXFP4_EXPAND_ROWS");
  k.mxfp4_expand_mib = text("MEGAMOE_MXFP4_EXPAND_MIB");
  k.nvfp4_expand_rows = text("MEGAMOE_NVFP4_EXPAND_ROWS");
  k.rank = text("MEGAMOE_RANK");
  k.world_size = text("MEGAMOE_WORLD_SIZE");
  k.local_rank = text("MEGAMOE_LOCAL_RANK");
  k.nccl_id_file = text("MEGAMOE_NCCL_ID_FILE");
  k.nccl_id = text("MEGAMOE_NCCL_ID");
  return k;
}

std::mutex g_mutex;
EnvKnobs* g_knobs = nullptr;

}  // namespace

const EnvKnobs& env_knobs() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_knobs) g_knobs = new EnvKnobs(read_env());
  return *g_knobs;
}

void reload_env_knobs() {
  EnvKnobs fresh = read_env();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_knobs) g_knobs = new EnvKnobs(fresh);
  else *g_knobs = fresh;
}

}  // namespace megamoe
