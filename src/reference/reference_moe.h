// The plain float64 MoE reference: no EP, no quantisation, no workspace. What every backend's output
// is measured against (relative L2 error).
//   y[t] = sum_j topk_weights[t, j] * w2[e] · (silu(w13[e][0:I] · x_t) * (w13[e][I:2I] · x_t)),
//   e = topk_ids[t, j], slots with e == -1 skipped; everything in fp64.
#pragma once

#include <cstdint>

#include "megamoe/config.h"

namespace megamoe {
namespace reference {

// x [T, H], topk_ids / topk_weights [T, k], w13 [E, 2I, H] and w2 [E, H, I] for ALL E experts
// (g.num_experts; ep_size and ep_rank are ignored), y [T, H]. Ids must be in [-1, E).
void reference_moe(const MoeGeometry& g, int64_t num_tokens, const float* x, const int32_t* topk_ids,
                   const float* topk_weights, const float* w13, const float* w2, double* y);

// ||y - ref||_2 / ||ref||_2 (plain ||y - ref|| when ||ref|| == 0).
double rel_l2(const float* y, const double* ref, int64_t n);
// max_i |y[i] - ref[i]|.
double max_abs_error(const float* y, const double* ref, int64_t n);

}  // namespace reference
}  // namespace megamoe
