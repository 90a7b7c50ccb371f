// gemm_heuristic.h — tile configuration of the grouped GEMM per tokens-per-expert bucket.
// Pure host code (no CUDA), tested on the CPU (tests/cpu/test_gemm_heuristic.cpp). Tuned values
// belong in the knob cache: Knobs{block_m, block_n, num_sms} override the bucket's choice field by
// field (0 = keep the heuristic's); Knobs::gemm_cluster likewise.
#pragma once

#include <cstdint>

#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "megamoe/config.h"

namespace megamoe::gemm {

struct GemmShapeHint {
  int64_t m_per_expert = 0;  // expected rows per expert (the bucket)
  int32_t num_experts = 0;
  int32_t n = 0;
  int32_t k = 0;
  GemmEpilogue epilogue = GemmEpilogue::kStoreBf16;
  bool fp8 = true;           // dtype fp8-block (16- and 32-row tiles need it)
  int32_t num_sms = 132;     // of the device
};

// Valid for launch_grouped_gemm: block_m in {16, 32 (fp8 only), 64, 128}, block_n in {128, 256}
// dividing n, 256 for the SwiGLU epilogues, num_sms in [1, hint.num_sms]. Overrides that break a
// rule are ignored.
GemmTileConfig select_gemm_tiles(const GemmShapeHint& hint, const Knobs* overrides = nullptr);

// BLOCK_M of an mxfp4-weight GEMM (the swapped 16-, 32- and 64-row tiles; fp4_math_wg the math
// warpgroups per tile, 1 or 2): block_m when one is asked for (validated by validate_grouped_gemm),
// else the smallest tile holding m_per_expert rows, 64 above 32 with two math warpgroups. Unlike
// fp8-block's 17-32-row bf16-row GEMMs (64-row tiles: their time is the weight stream), an mxfp4 tile
// costs its expansions: a 64-row tile over 32 rows takes 1.2x a 32-row one (one H200, 2026-12-03).
int32_t select_mxfp4_block_m(int64_t m_per_expert, int32_t block_m, int32_t fp4_math_wg);

// Tiles the persistent kernel runs for `rows_per_expert` (one entry per expert), with `cfg`.
int64_t count_gemm_tiles(const int32_t* rows_per_expert, int32_t num_experts, int32_t n, const GemmTileConfig& cfg);

}  // namespace megamoe::gemm
