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

void expand_nvfp4_to_bf16(const uint8_t* packed, const uint8_t* scales, int64_t num_experts, int64_t n, int64_t k,
                          uint16_t* out) {
  const int64_t elems = num_experts * n * k;
  for (int64_t i = 0; i < elems; ++i) {
    const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
    // exact in fp32, and then in bf16 (see the header)
    const float v = fmt::mul_rn(fmt::e2m1_to_float(code), fmt::e4m3_to_float(scales[i / fmt::kNvfp4BlockSize]));
    out[i] = fmt::float_to_bf16(v);
  }
}

void prepare_nvfp4_expert_bf16(const uint8_t* w13_packed, const uint8_t* w13_scales, const uint8_t* w2_packed,
                               const uint8_t* w2_scales, int64_t num_experts, int64_t hidden, int64_t intermediate,
                               std::vector<uint16_t>* w13_bf16, std::vector<uint16_t>* w2_bf16) {
  const int64_t E = num_experts, H = hidden, I = intermediate;
  std::vector<uint16_t> w13(static_cast<size_t>(E * 2 * I * H));
  expand_nvfp4_to_bf16(w13_packed, w13_scales, E, 2 * I, H, w13.data());
  w13_bf16->resize(w13.size());
  prepare_w13_for_swiglu(reinterpret_cast<const uint8_t*>(w13.data()), E, I, H, 2,
                         reinterpret_cast<uint8_t*>(w13_bf16->data()));
  w2_bf16->resize(static_cast<size_t>(E * H * I));
  expand_nvfp4_to_bf16(w2_packed, w2_scales, E, H, I, w2_bf16->data());
}

namespace {

// Where element (e, row, col) of an nvfp4 GEMM layout lives: its word's first byte, its code's index in
// the word and its block scale's byte (gemm_weights.h).
Fp4ElementPlace nvfp4_gemm_place(int64_t n, int64_t k, int64_t e, int64_t row, int64_t col) {
  const int64_t kb = col / kNvfp4BlockK, cb = col % kNvfp4BlockK, rs = row % 64;
  const int64_t piece = ((e * (k / kNvfp4BlockK) + kb) * (n / 64) + row / 64) * kNvfp4SlabBytes;
  const int64_t step = cb / 16, x = cb % 16, half = step / 4, hs = step % 4;
  const int64_t warp = rs / 16, g = rs % 8, hh = (rs % 16) / 8, q = (x % 8) / 2;
  const int64_t t = 32 * warp + 4 * g + q;
  Fp4ElementPlace p;
  p.word_byte = piece + 2048 * half + 16 * t + 4 * (2 * (hs / 2) + hh);
  p.code = static_cast<int>(4 * (hs % 2) + 2 * (x / 8) + x % 2);
  p.shift_byte = piece + kNvfp4SlabCodeBytes + rs * 8 + step;
  return p;
}

}  // namespace

bool prepare_nvfp4_for_gemm(const uint8_t* packed, const uint8_t* scales, const float* global_scales,
                            int64_t num_experts, int64_t n, int64_t k, Nvfp4GemmWeights* out, int64_t* bad) {
  Nvfp4GemmWeights& w = *out;
  w.num_experts = num_experts;
  w.n = n;
  w.k = k;
  w.slabs.assign(static_cast<size_t>(num_experts * (k / kNvfp4BlockK) * (n / 64) * kNvfp4SlabBytes), 0);
  w.global_scales.assign(global_scales, global_scales + num_experts);
  const int64_t groups = k / fmt::kNvfp4BlockSize;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t si = (e * n + r) * groups + gi;
        const uint8_t sc = scales[si];
        if ((sc & 0x7Fu) == 0x7Fu) {  // e4m3 NaN
          *bad = si;
          return false;
        }
        const uint8_t flip = (sc & 0x80u) ? 0x8u : 0u;  // a negative scale's sign goes to its codes
        w.slabs[static_cast<size_t>(nvfp4_gemm_place(n, k, e, r, 16 * gi).shift_byte)] = static_cast<uint8_t>(sc & 0x7Fu);
        for (int64_t x = 0; x < 16; ++x) {
          const int64_t c = 16 * gi + x, i = (e * n + r) * k + c;
          const uint8_t code = static_cast<uint8_t>(((packed[i / 2] >> ((i & 1) * 4)) & 0xFu) ^ flip);
          const Fp4ElementPlace p = nvfp4_gemm_place(n, k, e, r, c);
          uint32_t word = 0;
          std::memcpy(&word, w.slabs.data() + p.word_byte, 4);
          // pack_fp4_word's bits of code p.code: magnitude at nibble e, sign at 8e + 7 (e < 4) or 8(e - 4) + 3
          word |= static_cast<uint32_t>(code & 0x7u) << (4 * p.code);
          const int sign_bit = p.code < 4 ? 8 * p.code + 7 : 8 * (p.code - 4) + 3;
          word |= static_cast<uint32_t>((code >> 3) & 1u) << sign_bit;
          std::memcpy(w.slabs.data() + p.word_byte, &word, 4);
        }
      }
    }
  }
  return true;
}

std::vector<uint8_t> device_image(const Nvfp4GemmWeights& w) {
  const int64_t off = nvfp4_pieces_offset(w.num_experts);
  std::vector<uint8_t> img(static_cast<size_t>(off) + w.slabs.size(), 0);
  std::memcpy(img.data(), w.global_scales.data(), w.global_scales.size() * sizeof(float));
  std::memcpy(img.data() + off, w.slabs.data(), w.slabs.size());
  return img;
}

bool prepare_nvfp4_expert_images(const uint8_t* w13_packed, const uint8_t* w13_scales, const float* w13_global,
                                 const uint8_t* w2_packed, const uint8_t* w2_scales, const float* w2_global,
                                 int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 std::vector<uint8_t>* w13_image, std::vector<uint8_t>* w2_image, std::string* what) {
  const int64_t E = num_experts, H = hidden, I = intermediate;
  int64_t bad = -1;
  {
    std::vector<uint8_t> codes(static_cast<size_t>(E * 2 * I * H / 2)), sc(static_cast<size_t>(E * 2 * I * H / 16));
    prepare_w13_for_swiglu(w13_packed, E, I, H / 2, 1, codes.data());
    prepare_w13_for_swiglu(w13_scales, E, I, H / 16, 1, sc.data());
    Nvfp4GemmWeights w;
    if (!prepare_nvfp4_for_gemm(codes.data(), sc.data(), w13_global, E, 2 * I, H, &w, &bad)) {
      // back to weights.h's row order for the message
      const int64_t per = H / 16, row = bad / per, e = row / (2 * I), pr = row % (2 * I), g = bad % per;
      int64_t orig = 0;
      for (int64_t r = 0; r < 2 * I; ++r)
        if (swiglu_prepared_row(r, I) == pr) orig = r;
      *what = "w13 block scale [expert " + std::to_string(e) + ", row " + std::to_string(orig) + ", block " +
              std::to_string(g) + "]";
      return false;
    }
    *w13_image = device_image(w);
  }
  Nvfp4GemmWeights w;
  if (!prepare_nvfp4_for_gemm(w2_packed, w2_scales, w2_global, E, H, I, &w, &bad)) {
    const int64_t per = I / 16;
    *what = "w2 block scale [expert " + std::to_string(bad / per / H) + ", row " + std::to_string((bad / per) % H) +
            ", block " + std::to_string(bad % per) + "]";
    return false;
  }
  *w2_image = device_image(w);
  return true;
}

uint16_t nvfp4_gemm_bf16(const Nvfp4GemmWeights& w, int64_t e, int64_t row, int64_t col) {
  const Fp4ElementPlace p = nvfp4_gemm_place(w.n, w.k, e, row, col);
  uint32_t word = 0;
  std::memcpy(&word, w.slabs.data() + p.word_byte, 4);
  uint32_t pairs[4];
  fmt::fp4_word_to_bf16x2_pow120(word, pairs);
  const uint32_t pair = pairs[p.code / 2];
  const uint16_t mag = static_cast<uint16_t>((pair >> (16 * (p.code % 2))) & 0xFFFFu);
  // the scale's bf16 as the device builds it (byte j of the row's word of four: steps 0-3 or 4-7)
  const int64_t word0 = p.shift_byte - (p.shift_byte - kNvfp4SlabCodeBytes) % 4;
  uint32_t scale_word = 0;
  std::memcpy(&scale_word, w.slabs.data() + word0, 4);
  const uint32_t s2 = fmt::nvfp4_scale_bf16x2(scale_word, static_cast<int>((p.shift_byte - word0)));
  // the device's bf16 multiply: the product is exact (gemm_weights.h), so the fp32 product's bf16
  return fmt::float_to_bf16(fmt::mul_rn(fmt::bf16_to_float(mag), fmt::bf16_to_float(static_cast<uint16_t>(s2 & 0xFFFFu))));
}

Fp4ElementPlace mxfp4_gemm_place(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col) {
  const int64_t slab = row / kFp4SlabRows, r = row % kFp4SlabRows, kb = col / 128, kl = col % 128;
  const int64_t piece = ((e * (w.k / 128) + kb) * (w.n / kFp4SlabRows) + slab) * kFp4SlabBytes;
  const int64_t step = kl / 32, kk = kl % 32;
  const int64_t code = (kk / 16) * 4 + kk % 4;  // index in the word
  const int64_t q = (kk % 16) / 4;
  const int64_t warp = r / 16, which = (r % 16) / 8;  // which: row m0 (0) or m0 + 8 (1)
  const int64_t t = 32 * warp + 4 * (r % 8) + q;
  const int64_t word = (step % 2) * 2 + which;
  Fp4ElementPlace p;
  p.word_byte = piece + (step / 2) * 2048 + 16 * t + 4 * word;
  p.code = static_cast<int>(code);
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
                static_cast<uint8_t>(8 * (shift - fmt::kMxfp4MinShift));
          }
          // Each fragment word: its 8 codes gathered, then packed.
          for (int64_t s = 0; s < 4; ++s) {
            for (int64_t q = 0; q < 4; ++q) {
              uint8_t codes[8];
              for (int64_t i = 0; i < 8; ++i) {
                const int64_t c = 128 * kb + 32 * s + (i < 4 ? 4 * q + i : 16 + 4 * q + i - 4);
                codes[i] = static_cast<uint8_t>((pe[(r * k + c) / 2] >> (((r * k + c) & 1) * 4)) & 0xFu);
              }
              const Fp4ElementPlace p = mxfp4_gemm_place(w, e, r, 128 * kb + 32 * s + 4 * q);
              const uint32_t word = fmt::pack_fp4_word(codes);
              std::memcpy(w.slabs.data() + p.word_byte, &word, 4);
            }
          }
        }
      }
    }
  }
}

void prepare_mxfp4_expert_images(const uint8_t* w13_packed, const uint8_t* w13_scales, const uint8_t* w2_packed,
                                 const uint8_t* w2_scales, int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 std::vector<uint8_t>* w13_image, std::vector<uint8_t>* w2_image) {
  const int64_t E = num_experts, H = hidden, I = intermediate;
  std::vector<uint8_t> codes(static_cast<size_t>(E * 2 * I * H / 2)), scales(static_cast<size_t>(E * 2 * I * H / 32));
  prepare_w13_for_swiglu(w13_packed, E, I, H / 2, 1, codes.data());
  prepare_w13_for_swiglu(w13_scales, E, I, H / 32, 1, scales.data());
  {
    Mxfp4GemmWeights w;
    prepare_mxfp4_for_gemm(codes.data(), scales.data(), E, 2 * I, H, &w);
    *w13_image = device_image(w);
  }
  Mxfp4GemmWeights w;
  prepare_mxfp4_for_gemm(w2_packed, w2_scales, E, H, I, &w);
  *w2_image = device_image(w);
}

std::vector<uint8_t> device_image(const Mxfp4GemmWeights& w) {
  const int64_t off = mxfp4_pieces_offset(w.num_experts, w.n, w.k);
  std::vector<uint8_t> img(static_cast<size_t>(off) + w.slabs.size(), 0);
  std::memcpy(img.data(), w.block_scales.data(), w.block_scales.size() * sizeof(float));
  std::memcpy(img.data() + off, w.slabs.data(), w.slabs.size());
  return img;
}

uint8_t mxfp4_gemm_e4m3(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col) {
  const Fp4ElementPlace p = mxfp4_gemm_place(w, e, row, col);
  // The element's fragment word, expanded as the device does.
  uint32_t word = 0;
  std::memcpy(&word, w.slabs.data() + p.word_byte, 4);
  const int32_t shift = static_cast<int32_t>(w.slabs[static_cast<size_t>(p.shift_byte)]) / 8 + fmt::kMxfp4MinShift;
  uint32_t row_lo, row_hi, lo, hi;
  fmt::mxfp4_shift_table_row(shift, &row_lo, &row_hi);
  fmt::fp4_word_to_e4m3(word, row_lo, row_hi, &lo, &hi);
  return static_cast<uint8_t>(((p.code < 4 ? lo : hi) >> (8 * (p.code % 4))) & 0xFFu);
}

}  // namespace megamoe::gemm
