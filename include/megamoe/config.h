// megamoe/config.h — what the layer is (MoeGeometry) and how it runs (MoeConfig).
//
// Contract:
// - validate() returns ok or kInvalidArgument whose message names the field, its value and the rule
//   ("invalid geometry: hidden=2880, must be a multiple of 128 (pad to 2944 with padded())").
// - max_tokens_per_rank is the per-rank bound of one forward's tokens; it sizes every buffer. No
//   dp/ep factor is ever applied to it.
// - to_string() prints "MoeGeometry(hidden=7168, ...)".
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe {

// Hidden and intermediate sizes must be multiples of this (one fp8 1x128 scale block).
constexpr int64_t kDimAlignment = 128;
// MoeConfig::mega_max_tokens_per_rank unless set (a measured crossover from the knob cache replaces it):
// the largest size at which mega was measured faster than routed on every preset timed (one H200, EP1:
// qwen3-30b-a3b 0.83-0.97x routed at 1-512 tokens, deepseek-v3 at 1-128; docs/PERF.md, "Mega backend").
constexpr int64_t kDefaultMegaMaxTokensPerRank = 512;

struct MoeGeometry {
  int64_t hidden = 0;                // H
  int64_t intermediate = 0;          // I (per expert; w13 has 2I rows)
  int64_t num_experts = 0;           // E (global)
  int64_t top_k = 0;                 // k
  int64_t ep_size = 1;               // R
  int64_t ep_rank = 0;               // r in [0, R)
  int64_t max_tokens_per_rank = 0;   // T_max (per rank, per forward)

  Status validate() const;
  std::string to_string() const;

  int64_t experts_per_rank() const { return ep_size > 0 ? num_experts / ep_size : 0; }
  int64_t first_local_expert() const { return ep_rank * experts_per_rank(); }
  // The rank that owns global expert e.
  int64_t owner_of(int64_t expert) const { return expert / experts_per_rank(); }
  // The same geometry with hidden and intermediate rounded up to a multiple of `multiple`.
  // A padded layer computes the same function when x and the weights are zero-padded.
  MoeGeometry padded(int64_t multiple = kDimAlignment) const;
  // The same geometry seen from another rank.
  MoeGeometry for_rank(int64_t rank) const {
    MoeGeometry g = *this;
    g.ep_rank = rank;
    return g;
  }
  bool same_shape(const MoeGeometry& o) const {
    return hidden == o.hidden && intermediate == o.intermediate && num_experts == o.num_experts &&
           top_k == o.top_k && ep_size == o.ep_size && max_tokens_per_rank == o.max_tokens_per_rank;
  }
};

// Tuning knobs. 0 means "let the heuristic / knob cache decide". Tuned values belong in the knob
// cache (megamoe/knobs.h), not in code.
struct Knobs {
  int32_t block_m = 0;  // GEMM M tile: 0, 16, 32, 64 or 128
  int32_t block_n = 0;  // GEMM N tile: 0, 64, 128, 256 (GPU backends)
  int32_t num_sms = 0;  // SMs a persistent kernel may use: 0 = all (GPU backends)
  // Recv-row groups of the one-kernel combine (routed backend, mxfp8 / nvfp4 wire), 1..8: the
  // reduce of a group's tokens overlaps the later groups' sends. 0 = by the token count.
  int32_t combine_groups = 0;
  // CTAs per cluster of the fp8 GEMM's 128 x 256 tiles: 2 = pairs of CTAs sharing each weight tile by
  // TMA multicast, 1 = none, 0 = the heuristic's choice (2 for long K). Ignored by other tiles.
  int32_t gemm_cluster = 0;
  // Order in which the persistent GEMM's CTAs take their tiles: 1 = from a global counter, 2 =
  // round-robin, 0 = the heuristic's choice (round-robin for short launches of several m-blocks).
  int32_t gemm_tile_order = 0;

  Status validate() const;
  std::string to_string() const;
  bool operator==(const Knobs& o) const {
    return block_m == o.block_m && block_n == o.block_n && num_sms == o.num_sms && combine_groups == o.combine_groups &&
           gemm_cluster == o.gemm_cluster && gemm_tile_order == o.gemm_tile_order;
  }
  bool operator!=(const Knobs& o) const { return !(*this == o); }
};

struct MoeConfig {
  Backend backend = Backend::kAuto;
  WeightFormat weight_format = WeightFormat::kFp8Block;
  DispatchFormat dispatch_format = DispatchFormat::kFp8Block;
  CombineDtype combine_dtype = CombineDtype::kBf16;
  // Power-of-two (ue8m0) fp32 scales for the fp8-block formats (DeepSeek-V3 "scale_fmt: ue8m0").
  bool pow2_scales = false;
  // FC2's epilogue adds the weighted bf16 partials into the source rank's bf16 accumulation row of
  // each token (one rounding per add), copied to y in the same launch: no per-slot combine rows to
  // stage and read back. bf16 wire only, no owner reduce; the mega backend only (routed refuses it,
  // and `auto` then picks mega at any max_tokens_per_rank); the sum's order depends on arrival, so
  // results are not bitwise reproducible (bound: reference::in_kernel_reduce_bound_one_forward).
  bool in_kernel_fc2_reduce = false;
  // Each owner rank sums the weighted partials of its experts for a token (fp32, in slot order) and
  // sends one combine row per (token, owner rank) instead of one per (token, slot): k / (ranks a token
  // touches) times fewer combine bytes (4x for top-8 on 2 ranks), and fewer wire roundings. The source
  // sums the owners' rows in rank order: bitwise reproducible, but the bits depend on ep_size (the
  // per-slot combine's do not). kAuto: on with a quantised combine wire (mxfp8, nvfp4), off with bf16;
  // kOn is refused with in_kernel_fc2_reduce. Measured (2 x H200, docs/perf-history/routed.md and
  // transport.md, session 9; off vs on): whenever the combine sends after FC2 anyway it pays (a
  // quantised wire: qwen3-30b-a3b routed EP2 with mxfp8, 282 vs 265 us at 1024 tokens, 661 vs 607 at
  // 4096; deepseek-v3 1771 vs 1710, 4008 vs 3820; a caller of the transport's send_and_combine: 34 vs
  // 16 us at 128 tokens, 1402 vs 457 us at 8192 for deepseek-v3's bf16 rows). With a bf16 wire the
  // routed FC2 writes the per-slot rows itself, behind its GEMM: deepseek-v3's routed layer is 1-2%
  // faster that way at 1024-4096 tokens, qwen3-30b-a3b's 5% slower at 4096 (kOn for it).
  OwnerReduce owner_reduce = OwnerReduce::kAuto;
  // Multiplies the layer's output (SGLang's routed_scaling_factor): every topk weight is scaled by it
  // in fp32 before the forward uses it (layer.h). Must be finite.
  float output_scale = 1.0f;
  // auto: mega when 0 < max_tokens_per_rank <= this, routed above (mega also above it where routed
  // cannot run the configuration; 0: never mega). Overridden by a measured crossover from the knob
  // cache when one exists.
  int64_t mega_max_tokens_per_rank = kDefaultMegaMaxTokensPerRank;
  // Layers of equal geometry and options share one workspace and its scratch, and so must run one
  // after another on one stream. An engine that overlaps two such layers (micro-batches on two
  // streams, a speculative-decoding draft beside the target) gives them different lanes, 0..255:
  // layers of different lanes share nothing mutable.
  int32_t workspace_lane = 0;
  Knobs knobs;

  Status validate() const;
  // Rules that need the geometry too (e.g. the nvfp4 combine wire needs hidden % 16 == 0).
  Status validate(const MoeGeometry& geometry) const;
  std::string to_string() const;

  // owner_reduce resolved: kOn, or kAuto with a quantised combine wire and no in-kernel FC2 reduce.
  bool uses_owner_reduce() const;

  // Format of the SwiGLU output that FC2 consumes: bf16 for bf16 weights and for nvfp4 weights with
  // dispatch_format=bf16 (the GPU backends run those on the bf16 GEMM); fp8-block otherwise
  // (requantised in the FC1 epilogue).
  DispatchFormat intermediate_format() const;
};

}  // namespace megamoe
