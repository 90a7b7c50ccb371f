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

// Tiles the persistent kernel runs for `rows_per_expert` (one entry per expert), with `cfg`.
int64_t count_gemm_tiles(const int32_t* rows_per_expert, int32_t num_experts, int32_t n, const GemmTileConfig& cfg);

}  // namespace megamoe::gemm
