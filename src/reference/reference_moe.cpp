#include "reference/reference_moe.h"

#include <cmath>
#include <vector>

namespace megamoe {
namespace reference {

void reference_moe(const MoeGeometry& g, int64_t num_tokens, const float* x, const int32_t* topk_ids,
                   const float* topk_weights, const float* w13, const float* w2, double* y) {
  const int64_t H = g.hidden, I = g.intermediate, k = g.top_k;
  std::vector<double> h(I);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* xt = x + t * H;
    double* yt = y + t * H;
    for (int64_t c = 0; c < H; ++c) yt[c] = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_ids[t * k + j];
      if (e < 0) continue;
      const float* gate_rows = w13 + e * 2 * I * H;
      const float* up_rows = gate_rows + I * H;
      for (int64_t i = 0; i < I; ++i) {
        double gate = 0.0, up = 0.0;
        for (int64_t c = 0; c < H; ++c) {
          gate += static_cast<double>(xt[c]) * gate_rows[i * H + c];
          up += static_cast<double>(xt[c]) * up_rows[i * H + c];
        }
        h[i] = gate / (1.0 + std::exp(-gate)) * up;
      }
      const double weight = topk_weights[t * k + j];
      const float* down = w2 + e * H * I;
      for (int64_t c = 0; c < H; ++c) {
        double acc = 0.0;
        for (int64_t i = 0; i < I; ++i) acc += h[i] * down[c * I + i];
        yt[c] += weight * acc;
      }
    }
  }
}

double rel_l2(const float* y, const double* ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(y[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs_error(const float* y, const double* ref, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(y[i]) - ref[i]);
    if (!(d <= m)) m = d;  // a NaN propagates
  }
  return m;
}

}  // namespace reference
}  // namespace megamoe
