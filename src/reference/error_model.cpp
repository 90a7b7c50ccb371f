#include "reference/error_model.h"

#include <cmath>

namespace megamoe {
namespace reference {
namespace {

// Relative RMS of one rounding, 0.425 * 2^-(m+1).
constexpr double kBf16Rms = 0.00166;  // bf16, m = 7
constexpr double kFp8Rms = 0.0265;    // e4m3, m = 3 (fp8 1x128: the scale puts each block's max at 448)
// mxfp8: e4m3 under a power-of-two scale (the same element rounding), plus the OCP rule clamping
// elements with |x| / X in (448, 512) to 448 (up to 1/8 off for a block's largest values).
constexpr double kMxfp8Rms = 0.032;
constexpr double kNvfp4Rms = 0.106;   // e2m1, m = 1, under e4m3 block scales per 16 values

}  // namespace

ErrorBound error_bound(const MoeConfig& c, int64_t top_k) {
  double sum_sq = kBf16Rms * kBf16Rms;  // y rounded to bf16
  std::string what = "bf16 output";
  if (c.intermediate_format() == DispatchFormat::kFp8Block) {
    sum_sq += kFp8Rms * kFp8Rms;
    what += " + fp8 e4m3 1x128 intermediate";
  } else {
    sum_sq += kBf16Rms * kBf16Rms;
    what += " + bf16 intermediate";
  }
  switch (c.combine_dtype) {
    case CombineDtype::kBf16:
      sum_sq += kBf16Rms * kBf16Rms;
      what += c.in_kernel_fc2_reduce ? " + bf16 in-kernel reduce (one rounding per add)" : " + bf16 combine wire";
      // In-kernel reduce: y = bf16(y + partial) per slot, k roundings of which the last is y's own.
      if (c.in_kernel_fc2_reduce) sum_sq += static_cast<double>(top_k - 1) * kBf16Rms * kBf16Rms;
      break;
    case CombineDtype::kMxfp8:
      sum_sq += kMxfp8Rms * kMxfp8Rms;
      what += " + mxfp8 combine wire";
      break;
    case CombineDtype::kNvfp4:
      sum_sq += kNvfp4Rms * kNvfp4Rms;
      what += " + nvfp4 combine wire";
      break;
  }
  // Owner reduce: the wire rounds each owner's fp32 sum of its partials once, still one rounding term.
  if (c.uses_owner_reduce()) what += " (one sum per owner rank)";
  ErrorBound b;
  b.rel_l2 = 2.0 * std::sqrt(sum_sq);
  b.derivation = what + ", 2x the root-sum-square of the per-rounding relative RMS";
  return b;
}

ErrorBound same_points_bound(CombineDtype combine) {
  ErrorBound b;
  switch (combine) {
    case CombineDtype::kBf16:
      b.rel_l2 = kSamePointsRelL2;
      b.derivation = "same quantisation points, bf16 wire";
      break;
    case CombineDtype::kMxfp8:
      b.rel_l2 = std::sqrt(0.125 * kSamePointsRelL2);
      b.derivation = "same quantisation points, through an e4m3 (mxfp8) wire: sqrt(2^-3 * 5e-3)";
      break;
    case CombineDtype::kNvfp4:
      b.rel_l2 = std::sqrt(0.5 * kSamePointsRelL2);
      b.derivation = "same quantisation points, through an e2m1 (nvfp4) wire: sqrt(2^-1 * 5e-3)";
      break;
  }
  return b;
}

ErrorBound same_points_bound_one_forward(CombineDtype combine, int64_t tokens) {
  ErrorBound b = same_points_bound(combine);
  const double n = static_cast<double>(tokens > 0 ? tokens : 1);
  b.rel_l2 *= 1.0 + 3.0 / std::sqrt(n);
  b.derivation += ", one forward of " + std::to_string(tokens > 0 ? tokens : 1) + " token(s): x (1 + 3 / sqrt(tokens))";
  return b;
}

ErrorBound in_kernel_reduce_bound_one_forward(int64_t top_k, int64_t tokens) {
  ErrorBound b = same_points_bound_one_forward(CombineDtype::kBf16, tokens);
  const double adds = 2.0 * static_cast<double>(top_k > 1 ? top_k - 1 : 0);
  const double order = 2.0 * std::sqrt(adds) * kBf16Rms;
  b.rel_l2 = std::sqrt(b.rel_l2 * b.rel_l2 + order * order);
  b.derivation += "; in-kernel reduce: + 2 x sqrt(2 (top_k - 1)) bf16 roundings of another add order";
  return b;
}

}  // namespace reference
}  // namespace megamoe
