// gemm_weights.cpp — see gemm_weights.h.
#include "kernels/gemm/gemm_weights.h"

#include <cstring>

namespace megamoe::gemm {

int64_t swiglu_prepared_row(int64_t r, int64_t intermediate) {
  const bool up = r >= intermediate;
  const int64_t i = up ? r - intermediate : r;  // intermediate column
  return (i / 128) * 256 + (up ? 128 : 0) + i % 128;
}

void prepare_w13_for_swiglu(const uint8_t* src, int64_t num_experts, int64_t intermediate, int64_t k,
                            int64_t elem_bytes, uint8_t* dst) {
  const int64_t row_bytes = k * elem_bytes, rows = 2 * intermediate;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + (e * rows + swiglu_prepared_row(r, intermediate)) * row_bytes, src + (e * rows + r) * row_bytes,
                  static_cast<size_t>(row_bytes));
}

void prepare_w13_scales_for_swiglu(const float* src, int64_t num_experts, int64_t intermediate, int64_t k,
                                   float* dst) {
  const int64_t nb = 2 * intermediate / 128, kb = k / 128;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pb = swiglu_prepared_row(b * 128, intermediate) / 128;
      std::memcpy(dst + (e * nb + pb) * kb, src + (e * nb + b) * kb, static_cast<size_t>(kb) * sizeof(float));
    }
}

}  // namespace megamoe::gemm
