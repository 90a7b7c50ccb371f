// Comparing a layer's output with the float64 reference (`megamoe check`, and `megamoe tune` before it
// accepts a winner): x as the layer consumed it, the error sums, and the reference of chosen tokens
// computed expert by expert from the weights as the layer computes with them.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "reference/problem.h"

namespace megamoe::tool {

// x as the layer consumed it (ep_protocol.h, quantisation points 1-2): fp8-block dispatch quantises
// each bf16 row with fmt::quantize_fp8_1x128 (pow2 scales per config) and FC1 reads it dequantised;
// a bf16 dispatch passes the bf16 values through.
std::vector<float> consumed_x(const MoeConfig& c, const uint16_t* x_bf16, int64_t T, int64_t H);

// Sums of an output's error against its reference.
struct ErrorSums {
  int64_t tokens = 0;
  double sum_sq_err = 0, sum_sq_ref = 0, max_abs = 0;
  int64_t non_finite = 0;
  double rel_l2() const;  // ||y - ref|| / ||ref|| (||y - ref|| when ||ref|| == 0)
  void add(const ErrorSums& o);
};
// y: n bf16 bits; ref: n float64 values. A non-finite y counts in non_finite, not in the sums.
ErrorSums compare_output(const uint16_t* y, const double* ref, int64_t n);

// Writes global expert e's weights as the layer computes with them: w13 [2I, H] and w2 [H, I] fp32.
using ExpertWeightsFn = std::function<Status(int64_t expert, float* w13, float* w2)>;

// The float64 reference of tokens `rows` (indices into `in`) of one rank: ref [rows.size(), H].
// Computed expert by expert (only the experts those tokens reach, each dequantised once), on up to
// `threads` threads.
Status reference_rows(const MoeGeometry& g, const MoeConfig& c, const reference::RankInputs& in,
                      const std::vector<int64_t>& rows, const ExpertWeightsFn& expert_weights, int threads,
                      std::vector<double>* ref);

// n token indices spread over [0, T): 0, T-1 and evenly between (all of them when n >= T).
std::vector<int64_t> spread_rows(int64_t T, int64_t n);

}  // namespace megamoe::tool
