// The routed backend's two grouped GEMMs as a pure function of the geometry, the config, the
// workspace layout and the buffers' addresses: built once at warmup (so a bad knob or shape fails
// there, never between dispatch and combine) and testable without a GPU (tests/cpu/
// test_routed_gemm_args.cpp runs the real validate_grouped_gemm over the presets).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "megamoe/config.h"
#include "megamoe/workspace.h"

namespace megamoe {

// What the routed GEMMs read and write (device addresses).
struct RoutedGemmBuffers {
  char* workspace = nullptr;  // this rank's copy (regions by WorkspaceLayout offsets)
  const void* w13 = nullptr;  // prepared for the SwiGLU epilogue (gemm_weights.h)
  const float* w13_scales = nullptr;
  const void* w2 = nullptr;
  const float* w2_scales = nullptr;
  const float* w13_expert_scale = nullptr;  // nvfp4: fp32 [E_local] w13 global scales (FC1's scaled SwiGLU
                                            // on the bf16 expansion; the nvfp4 GEMM reads its image's)
  // nvfp4: w13 / w2 are the bf16 expansion (make_routed_expanded_gemm_args), not the GEMM's images
  bool nvfp4_bf16 = false;
  float* a_scales = nullptr;      // fp8: the pool's activation scales M-major, [H/128][pool_rows]
  void* expert_out = nullptr;     // FC2's bf16 rows when the combine reads them here
  int32_t* tile_counters = nullptr;  // [4]: FC1's pair, then FC2's (per layer)
  // FC2 writing the weighted rows into the source ranks' combine regions (bf16 wire, one row per
  // slot): EpTransport::CombineTargets.
  const int32_t* pool_dst = nullptr;
  const float* pool_weight = nullptr;
  void* peer_combine[8] = {};
  int num_ranks = 0;
  int64_t rows_per_rank = 0;
};

// FC2's epilogue writes the per-slot bf16 combine rows itself (no expert_out).
bool routed_fc2_writes_combine(const MoeConfig& config);

// The GEMMs' tile bucket (rows a busy expert gets) for a pool of `rows` received (token, expert)
// pairs: mean + 2 standard deviations (Poisson) of rows / E_l, since a tile must hold an expert's
// rows rather than their mean.
int64_t routed_rows_per_expert(const MoeGeometry& geometry, int64_t rows);

// The mxfp4 GEMMs' math warpgroups per tile (GemmTileConfig::fp4_math_wg) from MEGAMOE_GEMM_FP4_MATH_WG
// as given (EnvKnobs::gemm_fp4_math_wg): "1" or "2"; empty (unset): gemm::kDefaultFp4MathWG. Anything
// else: kInvalidArgument naming the variable, the value and the rule.
Status routed_fp4_math_wg(const std::string& knob, int32_t* out);

// The CTAs per SM of the mxfp4 GEMMs' 16-row tiles (GemmTileConfig::ctas_per_sm) from
// MEGAMOE_GEMM_FP4_CTAS_PER_SM as given (EnvKnobs::gemm_fp4_ctas_per_sm): "1" or "2"; empty (unset): 0,
// chosen per forward (routed_fp4_auto_ctas_per_sm). Anything else: kInvalidArgument naming the
// variable, the value and the rule.
Status routed_fp4_ctas_per_sm(const std::string& knob, int32_t* out);

// Two CTAs per SM pay off from this many 16-row tiles per SM (measured on the H200, deepseek-v3 dims,
// docs/perf-history/2026-12-03-mxfp4-two-ctas-per-sm.md): with 784-2600 tiles on 132 SMs they ran
// 5-11% faster; with 448-512 the same to 7% slower and unstable (two CTAs of one SM may take the last
// tiles while others idle); with 128, 36% slower (pairs of tiles on one SM, other SMs empty).
constexpr int64_t kFp4TwoCtasMinTilesPerSm = 5;
// The expected 16-row tiles of one mxfp4 GEMM of `n` output columns over `rows` routed rows on this
// rank's experts (each row one expert, uniformly: E_l (1 - (1 - 1/E_l)^rows) experts hit, ceil(rows
// per hit expert / 16) m-blocks each, n / 256 n-blocks).
double routed_fp4_expected_tiles(const MoeGeometry& geometry, int64_t rows, int64_t n);
// CTAs per SM for that GEMM: 2 from kFp4TwoCtasMinTilesPerSm x sms expected tiles on, else 1.
int32_t routed_fp4_auto_ctas_per_sm(const MoeGeometry& geometry, int64_t rows, int64_t n, int sms);

// Prefill with mxfp4 weights: from this many rows per expert (routed_rows_per_expert of the forward's
// T) the layer expands both weight images to fp8-block e4m3 in a scratch of its workspace key
// (gemm::launch_expand_mxfp4, before each GEMM) and runs fp8-block's GEMM on them: the same products
// (the expansion is the mxfp4 GEMM's own), with fp8-block's 128 x 256 tiles instead of the swapped
// 16- to 64-row ones, which reach about half fp8-block's MMA rate. Measured crossover: docs/PERF.md.
constexpr int64_t kDefaultMxfp4ExpandRows = 256;

// MEGAMOE_MXFP4_EXPAND_ROWS as given (EnvKnobs::mxfp4_expand_rows): a positive integer, or "off" (*out
// 0: never expand); empty (unset): kDefaultMxfp4ExpandRows. Anything else: kInvalidArgument naming
// the variable, the value and the rule.
Status routed_mxfp4_expand_rows(const std::string& knob, int64_t* out);

// The expansion's scratch bound by default: a layer whose local experts' w13 exceeds it expands and
// multiplies them in chunks of routed_mxfp4_expand_chunk experts (one GEMM launch per chunk), so an
// engine at EP1 with 256 experts holds 1 GiB of e4m3 rather than 7.5 GB.
constexpr int64_t kDefaultMxfp4ExpandBytes = int64_t(1) << 30;

// MEGAMOE_MXFP4_EXPAND_MIB as given (EnvKnobs::mxfp4_expand_mib): a positive integer of MiB (*out in
// bytes); empty (unset): kDefaultMxfp4ExpandBytes. Anything else: kInvalidArgument naming the
// variable, the value and the rule.
Status routed_mxfp4_expand_bytes(const std::string& knob, int64_t* out);

// Experts per chunk: as many whole experts' w13 (2I x H e4m3 bytes) as fit in max_bytes, at least 1,
// at most the local experts.
int64_t routed_mxfp4_expand_chunk(const MoeGeometry& geometry, int64_t max_bytes);

// What a routed mxfp4 layer of this geometry does at prefill, from the two knobs as given (EnvKnobs::
// mxfp4_expand_rows, mxfp4_expand_mib): the layer's warmup allocates scratch_bytes and `megamoe info`
// prints them. Errors: the knobs' (kInvalidArgument naming the variable).
struct RoutedMxfp4Expansion {
  int64_t threshold_rows = 0;  // rows per expert from which a forward expands; 0: off
  int64_t t_max_rows = 0;      // routed_rows_per_expert at max_tokens_per_rank (the largest bucket)
  int64_t chunk_experts = 1;   // routed_mxfp4_expand_chunk
  int64_t scratch_bytes = 0;   // chunk_experts x 2I x H; 0 when no forward expands (off, or T_max below)
  bool expands() const { return scratch_bytes > 0; }
};
Status routed_mxfp4_expansion(const MoeGeometry& geometry, const std::string& rows_knob, const std::string& mib_knob,
                              RoutedMxfp4Expansion* out);

// Prefill with nvfp4 weights (FP4 in HBM: the GEMM's images, gemm_weights.h): from this many rows
// per expert the layer expands both images to bf16 in the same kind of scratch (gemm::
// launch_expand_nvfp4, before each GEMM; twice mxfp4's bytes per expert, chunked under the same
// MEGAMOE_MXFP4_EXPAND_MIB bound) and runs the bf16 GEMM's 64- and 128-row tiles on them: the same
// products (the expansion is the nvfp4 GEMM's own), where the in-pipeline 16- and 32-row tiles would
// expand every weight once per 32 rows. Measured on one H200 (docs/PERF.md): the in-pipeline path is
// faster at 128 rows per expert (deepseek-v3 dims on 32 experts 1656 vs 1986 us, qwen3-30b-a3b 802
// vs 917), the expansion at 256 (2344 vs 2959, 1143 vs 1477); the lines cross at 161-173 rows.
constexpr int64_t kDefaultNvfp4ExpandRows = 160;

// MEGAMOE_NVFP4_EXPAND_ROWS as given (EnvKnobs::nvfp4_expand_rows): as routed_mxfp4_expand_rows, with
// kDefaultNvfp4ExpandRows when unset.
Status routed_nvfp4_expand_rows(const std::string& knob, int64_t* out);

// What a routed nvfp4 layer of this geometry does at prefill (as routed_mxfp4_expansion: chunk_experts
// whole experts' w13 as bf16, 2I x H x 2 bytes, within the MiB bound).
Status routed_nvfp4_expansion(const MoeGeometry& geometry, const std::string& rows_knob, const std::string& mib_knob,
                              RoutedMxfp4Expansion* out);

// fc1: pool_x -> SwiGLU (+ fp8 requant) -> intermediate; fc2: intermediate -> combine rows or
// expert_out. gemm_sms > 0 bounds both grids (a shared device's SM budget). fp4_math_wg: mxfp4
// weights' math warpgroups per tile for both (1 or 2; 0: the GEMM's default); ignored for other
// formats. Both validated.
Status make_routed_gemm_args(const MoeGeometry& geometry, const MoeConfig& config, const WorkspaceLayout& layout,
                             const RoutedGemmBuffers& buffers, int gemm_sms, int32_t fp4_math_wg,
                             gemm::GroupedGemmArgs* fc1, gemm::GroupedGemmArgs* fc2);

// The two GEMMs of an mxfp4 layer on its weights expanded into `expanded` (gemm::launch_expand_mxfp4
// of buffers.w13, then of buffers.w2, into the same bytes): fp8-block GEMMs with b = expanded and
// b_scales = the images' own block scales; everything else as make_routed_gemm_args makes it for
// fp8-block weights. nvfp4 (gemm::launch_expand_nvfp4): bf16 GEMMs with b = expanded, FC1's scaled
// SwiGLU with b_expert_scale = buffers.w13_expert_scale. Validated.
Status make_routed_expanded_gemm_args(const MoeGeometry& geometry, const MoeConfig& config,
                                      const WorkspaceLayout& layout, const RoutedGemmBuffers& buffers,
                                      const void* expanded, int gemm_sms, gemm::GroupedGemmArgs* fc1,
                                      gemm::GroupedGemmArgs* fc2);

}  // namespace megamoe
