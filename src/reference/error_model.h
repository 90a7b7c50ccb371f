// The error model of a forward against the float64 reference: which roundings a configuration does
// after FC1 and how large the rel-L2 they cause may be. Shared by `megamoe check` and the tests.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/config.h"

namespace megamoe {
namespace reference {

// The reference runs in float64 on the weights exactly as the layer computes with them (the
// dequantised prepared weights) and on x exactly as the layer consumed it (after the dispatch
// format), so weight and dispatch quantisation cancel. What remains are the roundings the layer does
// after FC1 (ep_protocol.h, quantisation points 4-8):
//   - the SwiGLU output h is requantised to fp8 e4m3 1x128 (fp8-family weights) or rounded to bf16;
//   - each partial (with the owner reduce, each owner's fp32 sum of a token's partials) goes over the
//     combine wire as bf16, mxfp8 or nvfp4;
//   - y is rounded to bf16.
// Per rounding to a format with m mantissa bits (round to nearest even), a value M * 2^e (M in [1, 2))
// gets an absolute error uniform in +-2^(e-m-1), a relative error U(+-2^-(m+1)) / M; with M spread
// log-uniformly over a binade, E[1/M^2] = 0.541, so the relative RMS is 2^-(m+1) / sqrt(3) *
// sqrt(0.541) = 0.425 * 2^-(m+1). A dot product of many values with independent rounding errors keeps
// that relative RMS, and independent roundings add in quadrature, so the rel-L2 of y is about the
// root-sum-square of one term per rounding. Each bound is 2x that estimate: a correct layer passes for
// every seed and shape (measured on tiny, EP1/EP2, 3 seeds: 0.0029 all-bf16, 0.023 fp8 intermediate,
// 0.038 + mxfp8 combine, 0.098 + nvfp4 combine, about half of the bound each), while a wrong scale, a
// dropped slot or a misrouted token (rel-L2 ~ 1) fails.
struct ErrorBound {
  double rel_l2 = 0;
  std::string derivation;  // which roundings the bound covers
};

ErrorBound error_bound(const MoeConfig& c, int64_t top_k);

// Two implementations with the same quantisation points (a GPU backend against the cpu backend) differ
// only where their fp32 accumulations differ; the fp8 tensor core keeps fewer bits than the cpu
// backend's float64 sums, so about 0.7% of the requantised e4m3 intermediate codes land one step
// apart. kSamePointsRelL2 (5e-3) bounds the rel-L2 between the two outputs with a bf16 wire; a
// wire only adds differences, so it bounds their difference before the wire too.
// A quantised wire amplifies it: inputs that differ by e round to codes a spacing s apart with
// probability ~|e|/s, so E[delta^2] = E[|e| s] <= max(s/|v|) E[|e||v|] <= max(s/|v|) rel_l2(e) E[v^2]
// (Cauchy-Schwarz), i.e. rel_l2(out) <= sqrt(max(s/|v|) * rel_l2(in)), with s/|v| <= 2^-3 for e4m3
// (mxfp8) and 2^-1 for e2m1 (nvfp4) on normal values. Checked with the codecs in
// tests/cpu/test_error_model.cpp: inputs 5e-3 apart come out 1.9e-2 (mxfp8) and 4.8e-2 (nvfp4) apart.
// For nvfp4 that is 0.97 of the bound: e2m1's subnormal step and the small values of a 16-value block
// have a larger relative spacing than 2^-1, so the nvfp4 bound is an estimate, not a guarantee.
constexpr double kSamePointsRelL2 = 5e-3;
ErrorBound same_points_bound(CombineDtype combine);

// The same comparison on ONE forward of `tokens` output rows. The bound above holds for the rel-L2
// pooled over many outputs; one forward's rel-L2 is the same ratio over its own tokens, whose errors
// come from a few flipped intermediate codes of heavy-tailed size (SwiGLU outputs times routing
// weights), so it spreads around the pooled value about as 1 / sqrt(tokens). Measured on one H200
// (2026-12-02, bf16 wire): single forwards of 8 to 96 tokens 1.3e-3 to 5.6e-3, pooled over 300
// random forwards 3.8e-3 to 3.9e-3, the worst of those 300 (down to one token) 1.46e-2 = 3.8x pooled.
// same_points_bound * (1 + 3 / sqrt(tokens)) covers them (1.43x at 48 tokens, 4x at one) and still
// fails a forward that loses one (token, slot) pair of T * top_k, whose rel-L2 is about
// 1 / sqrt(T * top_k): 6e-2 against a bound of 6.9e-3 at 64 tokens of top-4.
ErrorBound same_points_bound_one_forward(CombineDtype combine, int64_t tokens);
// The in-kernel FC2 reduce (bf16 wire) against the cpu backend's: both add a token's top_k partials
// into a zeroed bf16 row, rounding once per add, but in different orders (the GPU's adds race), so
// beyond the same-points difference the two sums differ by their top_k - 1 roundings each:
// 2 (top_k - 1) independent bf16 roundings, RMS 0.425 * 2^-8 each relative to the partial sum.
// Bound: the one-forward same-points bound and 2x that term, in quadrature.
ErrorBound in_kernel_reduce_bound_one_forward(int64_t top_k, int64_t tokens);

}  // namespace reference
}  // namespace megamoe
