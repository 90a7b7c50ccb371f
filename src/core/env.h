// Environment knobs: every MEGAMOE_* variable is read here and nowhere else (listed in README.md).
#pragma once

#include <cstdint>
#include <string>

namespace megamoe {

struct EnvKnobs {
  // MEGAMOE_KNOB_CACHE: path of the knob cache JSON, or "off". Default ~/.cache/megamoe/knobs.json
  // ($XDG_CACHE_HOME/megamoe/knobs.json when set).
  std::string knob_cache_path;
  bool knob_cache_off = false;
  // MEGAMOE_WAIT_TIMEOUT_MS: bound of every cross-rank wait (host threads and device), default 10000.
  int64_t wait_timeout_ms = 10000;
  // MEGAMOE_BARRIER_TIMEOUT_MS: bound of the host barrier between launched processes (`megamoe
  // launch`; the benches' lockstep), default 120000: ranks may reach it after setups of different
  // lengths, so it is apart from (and longer than) the wait bound above.
  int64_t barrier_timeout_ms = 120000;
  // MEGAMOE_MEGA_LAUNCH: how the mega kernel is launched on a GPU of its own: "cooperative" (default:
  // the driver guarantees every CTA resident) or "plain" (the warmup's residency check only; a GPU
  // shared by logical ranks always launches plainly).
  bool mega_plain_launch = false;
  // MEGAMOE_TILE_BUCKET: where the routed GEMMs' tile bucket comes from: "local" (default: this rank's
  // T, host-known) or "received" (the rows this rank received, decided on the device: two launches
  // per GEMM where the two buckets differ). "received" is off by default until measured on a GPU.
  bool tile_bucket_received = false;
  // MEGAMOE_GEMM_FP4_MATH_WG: the routed GEMMs' math warpgroups per tile with mxfp4 weights, "1" or "2"
  // (default 2). Kept as given; empty = unset. routed_fp4_math_wg() validates it at the layer's warmup
  // and names the variable.
  std::string gemm_fp4_math_wg;
  // MEGAMOE_GEMM_FP4_CTAS_PER_SM: the CTAs per SM of the routed mxfp4 GEMMs' 16-row tiles, "1" or "2"
  // (default: gemm::kDefaultFp4CtasPerSm). Kept as given; empty = unset. routed_fp4_ctas_per_sm()
  // validates it at the layer's warmup and names the variable.
  std::string gemm_fp4_ctas_per_sm;
  // MEGAMOE_MXFP4_EXPAND_ROWS: from how many rows per expert (the routed GEMMs' bucket) a routed mxfp4
  // layer expands its weights to fp8-block each forward and runs fp8-block's GEMM tiles, "off" or a
  // positive integer (default: routed_mxfp4_expand_rows's). Kept as given; empty = unset; validated
  // by routed_mxfp4_expand_rows() at the layer's warmup, naming the variable.
  std::string mxfp4_expand_rows;
  // MEGAMOE_MXFP4_EXPAND_MIB: the bound of that expansion's scratch in MiB, a positive integer
  // (default 1024): more local experts than fit are expanded and multiplied a chunk at a time. Kept
  // as given; validated by routed_mxfp4_expand_bytes() at the layer's warmup, naming the variable.
  std::string mxfp4_expand_mib;
  // MEGAMOE_NVFP4_EXPAND_ROWS: from how many rows per expert a routed nvfp4 layer expands its weights
  // to bf16 each forward and runs bf16's GEMM tiles, "off" or a positive integer (default:
  // routed_nvfp4_expand_rows's); the scratch is bounded by MEGAMOE_MXFP4_EXPAND_MIB as mxfp4's.
  // Kept as given; validated by routed_nvfp4_expand_rows() at the layer's warmup, naming the variable.
  std::string nvfp4_expand_rows;
  // MEGAMOE_LOG: 0 quiet, 1 warnings and selection (default), 2 verbose.
  int log_level = 1;
  // One process per GPU (comm.h NcclBootstrap::from_env, set by `megamoe launch` or an engine's
  // launcher). Kept as given; empty = unset. NcclBootstrap validates them and names the variable.
  std::string rank;          // MEGAMOE_RANK
  std::string world_size;    // MEGAMOE_WORLD_SIZE
  std::string local_rank;    // MEGAMOE_LOCAL_RANK (CUDA ordinal; default: the rank)
  std::string nccl_id_file;  // MEGAMOE_NCCL_ID_FILE
  std::string nccl_id;       // MEGAMOE_NCCL_ID (256 hex digits; wins over the file)
};

// Read once (first call) from the process environment.
const EnvKnobs& env_knobs();
// Re-read the environment (tests that set variables call this).
void reload_env_knobs();

}  // namespace megamoe
