// gemm_weights.h — weight preparation for the grouped GEMM's SwiGLU epilogue.
//
// The FC1 epilogue computes h = silu(gate) * up inside one 256-column tile, so each tile must hold
// 128 gate rows and the 128 up rows of the same intermediate columns. prepare_w13_for_swiglu()
// reorders w13 [E, 2I, K] (rows [0, I) gate, [I, 2I) up, as weights.h defines it) into
//   prepared rows [256 j, 256 j + 128)       = gate rows [128 j, 128 j + 128)
//   prepared rows [256 j + 128, 256 j + 256) = up rows   [I + 128 j, I + 128 j + 128)
// and its 128x128 block scales [E, 2I/128, K/128] the same way (block 2j = gate block j,
// 2j+1 = up block I/128 + j), so every 128-row block keeps exactly one scale per K block.
// Host code; element size is a parameter (1 for e4m3, 2 for bf16); data is moved, never rounded.
#pragma once

#include <cstdint>
#include <vector>

namespace megamoe::gemm {

// src/dst: [E, 2I, K] elements of elem_bytes; intermediate = I (a multiple of 128).
void prepare_w13_for_swiglu(const uint8_t* src, int64_t num_experts, int64_t intermediate, int64_t k,
                            int64_t elem_bytes, uint8_t* dst);
// src/dst: fp32 [E, 2I/128, K/128].
void prepare_w13_scales_for_swiglu(const float* src, int64_t num_experts, int64_t intermediate, int64_t k,
                                   float* dst);
// The prepared row that holds original w13 row r (r in [0, 2I)).
int64_t swiglu_prepared_row(int64_t r, int64_t intermediate);

}  // namespace megamoe::gemm
