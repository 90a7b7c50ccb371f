// gemm_weights.cpp — see gemm_weights.h.
#include "kernels/gemm/gemm_weights.h"

#include <algorithm>
#include <cstring>

#include "megamoe/formats.h"

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

Fp4ElementPlace mxfp4_gemm_place(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col) {
  const int64_t slab = row / kFp4SlabRows, r = row % kFp4SlabRows, kb = col / 128, kl = col % 128;
  const int64_t piece = ((e * (w.k / 128) + kb) * (w.n / kFp4SlabRows) + slab) * kFp4SlabBytes;
  const int64_t step = kl / 32, kk = kl % 32;
  const int64_t nib = (kk / 16) * 4 + kk % 4;  // nibble in the word
  const int64_t q = (kk % 16) / 4;
  const int64_t warp = r / 16, which = (r % 16) / 8;  // which: row m0 (0) or m0 + 8 (1)
  const int64_t t = 32 * warp + 4 * (r % 8) + q;
  const int64_t word = (step % 2) * 2 + which;
  Fp4ElementPlace p;
  p.code_byte = piece + (step / 2) * 2048 + 16 * t + 4 * word + nib / 2;
  p.nibble = static_cast<int>(nib % 2);
  p.shift_byte = piece + kFp4SlabCodeBytes + r * 4 + step;
  return p;
}

void prepare_mxfp4_for_gemm(const uint8_t* packed, const uint8_t* scales, int64_t num_experts, int64_t n, int64_t k,
                            Mxfp4GemmWeights* out) {
  Mxfp4GemmWeights& w = *out;
  w.num_experts = num_experts;
  w.n = n;
  w.k = k;
  w.slabs.assign(static_cast<size_t>(num_experts * (k / 128) * (n / kFp4SlabRows) * kFp4SlabBytes), 0);
  w.block_scales.assign(static_cast<size_t>(num_experts * (n / 128) * (k / 128)), 0.f);
  const int64_t groups = k / fmt::kMxfp4BlockSize;
  for (int64_t e = 0; e < num_experts; ++e) {
    const uint8_t* pe = packed + e * n * k / 2;
    const uint8_t* se = scales + e * n * groups;
    for (int64_t br = 0; br < n / 128; ++br) {
      for (int64_t kb = 0; kb < k / 128; ++kb) {
        uint8_t cmax = 0;
        for (int64_t r = br * 128; r < br * 128 + 128; ++r)
          for (int64_t g = 4 * kb; g < 4 * kb + 4; ++g) cmax = std::max(cmax, se[r * groups + g]);
        w.block_scales[(e * (n / 128) + br) * (k / 128) + kb] = fmt::mxfp4_e4m3_block_scale(cmax);
        for (int64_t r = br * 128; r < br * 128 + 128; ++r) {
          for (int64_t s = 0; s < 4; ++s) {
            const int32_t shift = fmt::mxfp4_e4m3_shift(se[r * groups + 4 * kb + s], cmax);
            w.slabs[static_cast<size_t>(mxfp4_gemm_place(w, e, r, 128 * kb + 32 * s).shift_byte)] =
                static_cast<uint8_t>(shift - fmt::kMxfp4MinShift);
          }
          for (int64_t c = 128 * kb; c < 128 * kb + 128; ++c) {
            const uint8_t code = static_cast<uint8_t>((pe[(r * k + c) / 2] >> (((r * k + c) & 1) * 4)) & 0xFu);
            const Fp4ElementPlace p = mxfp4_gemm_place(w, e, r, c);
            w.slabs[static_cast<size_t>(p.code_byte)] |= static_cast<uint8_t>(code << (4 * p.nibble));
          }
        }
      }
    }
  }
}

uint8_t mxfp4_gemm_e4m3(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col) {
  const Fp4ElementPlace p = mxfp4_gemm_place(w, e, row, col);
  // The element's 32-bit word, expanded as the device does.
  const int64_t word_byte = p.code_byte - (p.code_byte % 4);
  uint32_t word = 0;
  std::memcpy(&word, w.slabs.data() + word_byte, 4);
  const int32_t shift = static_cast<int32_t>(w.slabs[static_cast<size_t>(p.shift_byte)]) + fmt::kMxfp4MinShift;
  uint32_t row_lo, row_hi, lo, hi;
  fmt::mxfp4_shift_table_row(shift, &row_lo, &row_hi);
  fmt::fp4_word_to_e4m3(word, row_lo, row_hi, &lo, &hi);
  const int nib = static_cast<int>((p.code_byte % 4) * 2 + p.nibble);
  return static_cast<uint8_t>(((nib < 4 ? lo : hi) >> (8 * (nib % 4))) & 0xFFu);
}

}  // namespace megamoe::gemm
