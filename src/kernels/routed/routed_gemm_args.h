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
  const float* w13_expert_scale = nullptr;  // nvfp4: fp32 [E_local] w13 global scales (FC1's scaled SwiGLU)
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

// fc1: pool_x -> SwiGLU (+ fp8 requant) -> intermediate; fc2: intermediate -> combine rows or
// expert_out. gemm_sms > 0 bounds both grids (a shared device's SM budget). fp4_math_wg: mxfp4
// weights' math warpgroups per tile for both (1 or 2; 0: the GEMM's default); ignored for other
// formats. Both validated.
Status make_routed_gemm_args(const MoeGeometry& geometry, const MoeConfig& config, const WorkspaceLayout& layout,
                             const RoutedGemmBuffers& buffers, int gemm_sms, int32_t fp4_math_wg,
                             gemm::GroupedGemmArgs* fc1, gemm::GroupedGemmArgs* fc2);

}  // namespace megamoe
