// megamoe/formats.h — the number formats megamoe stores and sends, and their block codecs.
//
// One header for host C++ and CUDA device code (it includes no CUDA header): every function is
// `__host__ __device__` under nvcc and `inline` elsewhere, and the host and device builds of a
// function return the same bits for the same input. To make that hold:
// - bit casts use memcpy on the host and __float_as_uint / __uint_as_float on the device;
// - every fp32 multiply / divide goes through mul_rn / div_rn (IEEE round-to-nearest-even; on the
//   device __fmul_rn / __fdiv_rn, which nvcc never contracts into an FMA or approximates), whose NaN
//   results are all the canonical 0x7FFFFFFF (so a dequantised NaN element is 0x7FFFFFFF);
// - encoders work on the integer bits, so they do not depend on the fp32 rounding or flush mode.
// The codecs assume IEEE fp32 with subnormals (no -ftz / --use_fast_math, no host FTZ/DAZ).
// The hardware conversions cvt.rn.satfinite.e4m3x2.f32 and cvt.rn.bf16.f32 return the same codes as
// float_to_e4m3 / float_to_bf16 for every non-NaN input (tests/gpu/test_formats_device.cpp), so
// kernels may use them; for NaN, cvt bf16 gives 0x7FFF where float_to_bf16 keeps sign and payload.
//
// Formats (OCP 8-bit Floating Point Specification (OFP8) rev 1.0; OCP Microscaling Formats (MX)
// Specification v1.0; NVIDIA NVFP4):
//   bf16  S.8.7, bias 127. Encode: round to nearest even; overflow rounds to inf as IEEE does;
//         NaN stays NaN: quieted (mantissa bit 6 set), sign and top payload bits kept.
//   e4m3  ("e4m3fn") S.4.3, bias 7, max normal 448 = S.1111.110, min normal 2^-6, subnormals
//         m * 2^-9 (min 2^-9); S.1111.111 is NaN; no infinities. Encode: round to nearest even,
//         "satfinite": |v| > 448 (including inf) gives +-448. NaN gives 0x7F whatever its sign
//         (canonical NaN, as CUDA's __nv_cvt_float_to_fp8 does). -0 (and a negative value that
//         rounds to zero) gives 0x80.
//   e2m1  S.2.1, bias 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; no NaN, no infinities.
//         Encode: round to nearest even, |v| > 6 (including inf) gives +-6; NaN gives +6 (0x7), as
//         CUDA's __nv_cvt_float_to_fp4 does. -0 gives 0x8. Codes live in the low 4 bits.
//   e8m0  unsigned exponent-only scale: code c is 2^(c - 127) (c = 0 is 2^-127, an fp32 subnormal);
//         0xFF is NaN.
//
// Block formats (the "block" is along the contiguous dimension unless said otherwise):
//   fp8 1x128 / 128x128  e4m3 element, fp32 scale s = fp8_block_scale(block amax): value = code * s.
//                        1x128 for activations, 128x128 for weights (DeepSeek-V3 checkpoints).
//   mxfp8                e4m3 element, e8m0 scale per 32 (OCP MX rule, see mxfp8_scale_code).
//   mxfp4                e2m1 element, e8m0 scale per 32 (OCP MX rule, see mxfp4_scale_code), two
//                        elements per byte as nvfp4: value = e2m1 * 2^(code - 127).
//   nvfp4                e2m1 element, e4m3 scale per 16, fp32 global scale per tensor (per expert
//                        matrix for weights): value = e2m1 * (e4m3 scale * global scale).
// Block amax is taken over the finite elements only: an infinite element encodes as the saturated
// +-max and a NaN element as the format's NaN (e2m1: +6), without spoiling its block's scale.
// Every quantiser divides by the scale (code = encode(x / s)); every dequantiser multiplies.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MEGAMOE_FMT_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_FMT_HD inline
#endif

namespace megamoe {
namespace fmt {

constexpr float kE4M3Max = 448.f;
constexpr float kE2M1Max = 6.f;
constexpr int kFp8BlockSize = 128;  // 1x128 (activations) and 128x128 (weights)
constexpr int kMxfp8BlockSize = 32;
constexpr int kMxfp4BlockSize = 32;
constexpr int kNvfp4BlockSize = 16;
// The smallest normal fp32, 2^-126: fp32 scales are clamped up to it so they are never subnormal.
constexpr float kMinNormalFp32 = 1.17549435082228750797e-38f;

// ---------------------------------------------------------------------------------------------
// Bit casts and IEEE arithmetic that agree on host and device.

MEGAMOE_FMT_HD uint32_t float_as_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

MEGAMOE_FMT_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// The canonical NaN of every NaN that mul_rn / div_rn return: NVIDIA GPUs produce 0x7FFFFFFF for any
// NaN result, x86 propagates an operand's payload; mapping both to this one value keeps host and
// device bit-identical on NaN too.
constexpr uint32_t kCanonicalNaNBits = 0x7FFFFFFFu;

MEGAMOE_FMT_HD float canonicalize_nan(float v) {
  return (float_as_bits(v) & 0x7FFFFFFFu) > 0x7F800000u ? bits_as_float(kCanonicalNaNBits) : v;
}

MEGAMOE_FMT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonicalize_nan(__fmul_rn(a, b));
#else
  return canonicalize_nan(a * b);
#endif
}

MEGAMOE_FMT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonicalize_nan(__fdiv_rn(a, b));
#else
  return canonicalize_nan(a / b);
#endif
}

// |v| for finite v, 0 for inf and NaN: the contribution of one element to a block amax.
MEGAMOE_FMT_HD float finite_abs(float v) {
  const uint32_t a = float_as_bits(v) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? bits_as_float(a) : 0.f;
}

// ---------------------------------------------------------------------------------------------
// bf16

MEGAMOE_FMT_HD float bf16_to_float(uint16_t bits) { return bits_as_float(static_cast<uint32_t>(bits) << 16); }

MEGAMOE_FMT_HD uint16_t float_to_bf16(float v) {
  uint32_t u = float_as_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is the right rounding
  // (up to the next binade, or to inf past the largest bf16).
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MEGAMOE_FMT_HD float round_to_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// ---------------------------------------------------------------------------------------------
// e4m3 (OCP e4m3fn)

MEGAMOE_FMT_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xFu;
  const uint32_t man = code & 0x7u;
  if (exp == 0xFu && man == 0x7u) return bits_as_float(sign | 0x7FC00000u);  // NaN
  if (exp == 0) {
    // Subnormal: man * 2^-9, exact in fp32 (a normal fp32 number).
    const float mag = mul_rn(static_cast<float>(man), 0.001953125f);
    return bits_as_float(sign | float_as_bits(mag));
  }
  // Normal: (1 + man/8) * 2^(exp - 7): fp32 biased exponent exp - 7 + 127.
  return bits_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

MEGAMOE_FMT_HD uint8_t float_to_e4m3(float v) {
  const uint32_t u = float_as_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7Fu;          // NaN -> canonical NaN (sign dropped)
  if (a >= 0x43E00000u) return sign | 0x7Eu;  // |v| >= 448 (incl. inf): satfinite
  const uint32_t biased = a >> 23;
  if (biased >= 121u) {
    // Normal e4m3 range [2^-6, 448): keep 3 of the 23 mantissa bits, round to nearest even. A carry
    // from the mantissa into the exponent is the correct rounding; |v| < 448 never reaches 0x7F.
    const uint32_t mant = a & 0x7FFFFFu;
    uint32_t code = ((biased - 120u) << 3) | (mant >> 20);
    const uint32_t rest = mant & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
    return sign | static_cast<uint8_t>(code);
  }
  // Subnormal e4m3 range [0, 2^-6): code = round_even(|v| * 2^9). With the implicit bit,
  // |v| = sig * 2^(biased - 150), so |v| * 2^9 = sig >> (141 - biased). Below 2^-10 (biased < 117)
  // the result is 0 (2^-10 itself is the tie between 0 and 2^-9 and goes to 0, the even code).
  if (biased < 117u) return sign;
  const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 141u - biased;  // 21..24
  uint32_t code = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (code & 1u))) ++code;  // 8 (= 2^-6, the min normal) is code 0x08
  return sign | static_cast<uint8_t>(code);
}

// ---------------------------------------------------------------------------------------------
// e2m1 (OCP FP4)

MEGAMOE_FMT_HD float e2m1_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x8u) << 28;
  const uint32_t exp = (code >> 1) & 0x3u;
  const uint32_t man = code & 0x1u;
  if (exp == 0) return bits_as_float(sign | (man ? 0x3F000000u : 0u));  // 0 or 0.5
  return bits_as_float(sign | ((exp + 126u) << 23) | (man << 22));      // (1 + man/2) * 2^(exp-1)
}

MEGAMOE_FMT_HD uint8_t float_to_e2m1(float v) {
  const uint32_t u = float_as_bits(v);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7u;  // NaN -> +6
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  // Nearest of the 8 magnitudes: the code is the number of midpoints |v| lies above. A midpoint
  // (compared as fp32 bits, exact for non-negative floats) goes to the even code, so it counts when
  // the code above it is even (>=) and not when the code below is (>). Above 5 (and inf) it is 6.
  const uint8_t code = static_cast<uint8_t>((a > 0x3E800000u) +   // 0.25: 0   | 0.5, tie -> 0
                                            (a >= 0x3F400000u) +  // 0.75: 0.5 | 1,   tie -> 1
                                            (a > 0x3FA00000u) +   // 1.25: 1   | 1.5, tie -> 1
                                            (a >= 0x3FE00000u) +  // 1.75: 1.5 | 2,   tie -> 2
                                            (a > 0x40200000u) +   // 2.5:  2   | 3,   tie -> 2
                                            (a >= 0x40600000u) +  // 3.5:  3   | 4,   tie -> 4
                                            (a > 0x40A00000u));   // 5:    4   | 6,   tie -> 4
  return sign | code;
}

// ---------------------------------------------------------------------------------------------
// e8m0 (OCP MX scale)

MEGAMOE_FMT_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xFFu) return bits_as_float(0x7FC00000u);
  if (code == 0) return bits_as_float(0x00400000u);  // 2^-127 (fp32 subnormal)
  return bits_as_float(static_cast<uint32_t>(code) << 23);
}

// ---------------------------------------------------------------------------------------------
// Scale rules

// fp32 scale of an fp8 block with max |x| = amax such that amax / s <= 448:
//   pow2 = false: s = amax / 448 (so the amax element lands on 448);
//   pow2 = true : the smallest power of two with amax <= 448 * s (DeepSeek "ue8m0" scales).
// amax == 0 (or negative / NaN) gives 1. s is clamped up to 2^-126 (never subnormal), which keeps
// amax / s <= 448. amax = +inf gives +inf; the block codecs never pass one (amax over finite values).
MEGAMOE_FMT_HD float fp8_block_scale(float amax, bool pow2) {
  if (!(amax > 0.f)) return 1.f;
  const uint32_t a = float_as_bits(amax);
  if (a >= 0x7F800000u) return amax;
  if (!pow2) {
    const float s = div_rn(amax, kE4M3Max);
    return s < kMinNormalFp32 ? kMinNormalFp32 : s;
  }
  if (a < 0x00800000u) return kMinNormalFp32;  // subnormal amax
  // amax = m * 2^e, m in [1, 2); 448 = 1.75 * 2^8. amax <= 448 * 2^k  <=>  m <= 1.75 * 2^(k + 8 - e),
  // smallest k: e - 8 when m <= 1.75 (mantissa field <= 0x600000), else e - 7.
  int32_t biased = static_cast<int32_t>(a >> 23) - 8 + ((a & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  if (biased < 1) biased = 1;
  return bits_as_float(static_cast<uint32_t>(biased) << 23);
}

// e8m0 code of the shared scale of an mxfp8 block (OCP MX v1.0, section 6.3):
//   X = 2^(floor(log2(amax)) - 8), 8 = emax of e4m3, code = floor(log2(amax)) - 8 + 127 clamped to
//   [0, 254]. The elements are then encoded as e4m3(x / X) with saturation, so elements with
//   |x| / X in (448, 512) clamp to 448 (relative error up to 1/8): that is the spec's rule.
// amax == 0 (or negative) gives 127 (X = 1); NaN gives 0xFF; +inf gives 254. Finite amax gives
// codes in [0, 246].
MEGAMOE_FMT_HD uint8_t mxfp8_scale_code(float amax) {
  if (amax != amax) return 0xFFu;
  if (!(amax > 0.f)) return 127u;
  const uint32_t a = float_as_bits(amax);
  if (a >= 0x7F800000u) return 254u;
  // Normal amax: floor(log2(amax)) + 127 is the biased exponent. Subnormal amax (biased 0) has
  // floor(log2) < -126, so its code clamps to 0 either way.
  const int32_t code = static_cast<int32_t>(a >> 23) - 8;
  return static_cast<uint8_t>(code < 0 ? 0 : code);
}

// e8m0 code of the shared scale of an mxfp4 block (OCP MX v1.0, section 6.3, emax of e2m1 = 2):
//   X = 2^(floor(log2(amax)) - 2), code = floor(log2(amax)) - 2 + 127 clamped to [0, 254]; the
//   elements are e2m1(x / X) with saturation, so |x| / X in (6, 8) clamps to 6 (relative error up to
//   1/4): the spec's rule. amax == 0 (or negative) gives 127; NaN gives 0xFF; +inf gives 254. Finite
//   amax gives codes in [0, 252].
MEGAMOE_FMT_HD uint8_t mxfp4_scale_code(float amax) {
  if (amax != amax) return 0xFFu;
  if (!(amax > 0.f)) return 127u;
  const uint32_t a = float_as_bits(amax);
  if (a >= 0x7F800000u) return 254u;
  const int32_t code = static_cast<int32_t>(a >> 23) - 2;
  return static_cast<uint8_t>(code < 0 ? 0 : code);
}

// fp32 global scale of an nvfp4 tensor: amax / (448 * 6), so that the largest block scale
// (block amax / 6) / global fits e4m3. amax == 0 (or negative / NaN) gives 1; clamped up to 2^-126.
MEGAMOE_FMT_HD float nvfp4_global_scale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  const float s = div_rn(amax, kE4M3Max * kE2M1Max);
  return s < kMinNormalFp32 ? kMinNormalFp32 : s;
}

// max over i < n of finite_abs(x[i]) (0 for n == 0 or no finite element).
MEGAMOE_FMT_HD float amax_finite(const float* x, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = finite_abs(x[i]);
    if (a > m) m = a;
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Contiguous block codecs. Preconditions: n (or rows, cols) a multiple of the block size; output
// arrays sized as stated; global_scale finite and > 0.

// fp8 1x128: q[n] e4m3, scales[n / 128] fp32 (fp8_block_scale of each block's amax).
MEGAMOE_FMT_HD void quantize_fp8_1x128(const float* x, int64_t n, uint8_t* q, float* scales, bool pow2) {
  for (int64_t b = 0; b < n / kFp8BlockSize; ++b) {
    const float* xb = x + b * kFp8BlockSize;
    const float s = fp8_block_scale(amax_finite(xb, kFp8BlockSize), pow2);
    scales[b] = s;
    for (int i = 0; i < kFp8BlockSize; ++i) q[b * kFp8BlockSize + i] = float_to_e4m3(div_rn(xb[i], s));
  }
}

MEGAMOE_FMT_HD void dequantize_fp8_1x128(const uint8_t* q, const float* scales, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = mul_rn(e4m3_to_float(q[i]), scales[i / kFp8BlockSize]);
}

// fp8 128x128: w row-major [rows, cols], q [rows, cols] e4m3, scales [rows/128, cols/128] fp32.
MEGAMOE_FMT_HD void quantize_fp8_128x128(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scales,
                                         bool pow2) {
  const int64_t scale_cols = cols / kFp8BlockSize;
  for (int64_t br = 0; br < rows / kFp8BlockSize; ++br) {
    for (int64_t bc = 0; bc < scale_cols; ++bc) {
      const int64_t r0 = br * kFp8BlockSize, c0 = bc * kFp8BlockSize;
      float amax = 0.f;
      for (int64_t r = r0; r < r0 + kFp8BlockSize; ++r) {
        const float a = amax_finite(w + r * cols + c0, kFp8BlockSize);
        if (a > amax) amax = a;
      }
      const float s = fp8_block_scale(amax, pow2);
      scales[br * scale_cols + bc] = s;
      for (int64_t r = r0; r < r0 + kFp8BlockSize; ++r) {
        for (int64_t c = c0; c < c0 + kFp8BlockSize; ++c) q[r * cols + c] = float_to_e4m3(div_rn(w[r * cols + c], s));
      }
    }
  }
}

MEGAMOE_FMT_HD void dequantize_fp8_128x128(const uint8_t* q, const float* scales, int64_t rows, int64_t cols,
                                           float* out) {
  const int64_t scale_cols = cols / kFp8BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales + (r / kFp8BlockSize) * scale_cols;
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = mul_rn(e4m3_to_float(q[r * cols + c]), srow[c / kFp8BlockSize]);
  }
}

// mxfp8: q[n] e4m3, scales[n / 32] e8m0 (mxfp8_scale_code of each block's amax).
MEGAMOE_FMT_HD void quantize_mxfp8(const float* x, int64_t n, uint8_t* q, uint8_t* scales) {
  for (int64_t b = 0; b < n / kMxfp8BlockSize; ++b) {
    const float* xb = x + b * kMxfp8BlockSize;
    const uint8_t code = mxfp8_scale_code(amax_finite(xb, kMxfp8BlockSize));
    scales[b] = code;
    const float s = e8m0_to_float(code);
    for (int i = 0; i < kMxfp8BlockSize; ++i) q[b * kMxfp8BlockSize + i] = float_to_e4m3(div_rn(xb[i], s));
  }
}

MEGAMOE_FMT_HD void dequantize_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = mul_rn(e4m3_to_float(q[i]), e8m0_to_float(scales[i / kMxfp8BlockSize]));
}

// mxfp4: packed[n / 2] (element 2i in the low nibble of byte i), scales[n / 32] e8m0
// (mxfp4_scale_code of each block's amax); value = e2m1 * 2^(code - 127).
MEGAMOE_FMT_HD void quantize_mxfp4(const float* x, int64_t n, uint8_t* packed, uint8_t* scales) {
  for (int64_t b = 0; b < n / kMxfp4BlockSize; ++b) {
    const float* xb = x + b * kMxfp4BlockSize;
    const uint8_t code = mxfp4_scale_code(amax_finite(xb, kMxfp4BlockSize));
    scales[b] = code;
    const float s = e8m0_to_float(code);
    for (int i = 0; i < kMxfp4BlockSize; i += 2) {
      const uint8_t lo = float_to_e2m1(div_rn(xb[i], s));
      const uint8_t hi = float_to_e2m1(div_rn(xb[i + 1], s));
      packed[(b * kMxfp4BlockSize + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

MEGAMOE_FMT_HD void dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
    out[i] = mul_rn(e2m1_to_float(code), e8m0_to_float(scales[i / kMxfp4BlockSize]));
  }
}

// ---------------------------------------------------------------------------------------------
// mxfp4 as e4m3 under a power-of-two scale per 128 x 128 block: how the GPU computes with mxfp4
// (the weight tile expands to e4m3 in the GEMM pipeline and the block scale is applied like an
// fp8-block weight scale).
//
// A block of 128 rows x 128 columns holds 128 x 4 e8m0 codes; with cmax the largest of them, the
// block scale is S = 2^(max(cmax, 7) - 133), a normal fp32 (for cmax >= 7: 2^(cmax - 127 - 6)), and
// each element e2m1 * 2^(c - 127) becomes e4m3(e2m1 * 2^d) * S with the shift d = c - max(cmax, 7) + 6
// <= 6 (6 * 2^6 = 384 <= 448: never saturates). This is exact while d >= -8, i.e. while the block's
// scales span at most 15 binades (cmax - c <= 14): e4m3's subnormals (step 2^-9) hold 0.5 * 2^-8 and
// 1.5 * 2^-8. A group with d < -8 is rounded to e4m3 (RNE, to zero below 2^-10): each of its elements
// then errs by at most 2^-10 * S, 2^-10 / 384 of the largest value the block can hold.
constexpr int kMxfp4MinExactShift = -8;
// Shifts below this encode every element as 0 (6 * 2^-14 < 2^-10 rounds to zero).
constexpr int kMxfp4MinShift = -14;

MEGAMOE_FMT_HD float mxfp4_e4m3_block_scale(uint8_t cmax) {
  const int32_t c = cmax < 7 ? 7 : cmax;
  return bits_as_float(static_cast<uint32_t>(c - 6) << 23);  // 2^(c - 6 - 127)
}

// The shift d of an element group with scale code `code` in a block whose largest code is cmax
// (code <= cmax), clamped below at kMxfp4MinShift.
MEGAMOE_FMT_HD int32_t mxfp4_e4m3_shift(uint8_t code, uint8_t cmax) {
  const int32_t d = static_cast<int32_t>(code) - (cmax < 7 ? 7 : cmax) + 6;
  return d < kMxfp4MinShift ? kMxfp4MinShift : d;
}

// The e4m3 code of e2m1 code `e2m1` (low 4 bits) times 2^shift, shift in [kMxfp4MinShift, 6].
MEGAMOE_FMT_HD uint8_t mxfp4_element_as_e4m3(uint8_t e2m1, int32_t shift) {
  const float pow2 = bits_as_float(static_cast<uint32_t>(127 + shift) << 23);
  return float_to_e4m3(mul_rn(e2m1_to_float(e2m1), pow2));  // the product is exact in fp32
}

// packed [rows, cols / 2] and scales [rows, cols / 32] (mxfp4) -> q [rows, cols] e4m3 and
// block_scales [rows / 128, cols / 128] fp32 (rows, cols multiples of 128).
MEGAMOE_FMT_HD void mxfp4_to_fp8_128x128(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols,
                                         uint8_t* q, float* block_scales) {
  const int64_t groups = cols / kMxfp4BlockSize;
  for (int64_t br = 0; br < rows / kFp8BlockSize; ++br) {
    for (int64_t bc = 0; bc < cols / kFp8BlockSize; ++bc) {
      uint8_t cmax = 0;
      for (int64_t r = br * kFp8BlockSize; r < (br + 1) * kFp8BlockSize; ++r)
        for (int64_t g = bc * 4; g < bc * 4 + 4; ++g) cmax = scales[r * groups + g] > cmax ? scales[r * groups + g] : cmax;
      block_scales[br * (cols / kFp8BlockSize) + bc] = mxfp4_e4m3_block_scale(cmax);
      for (int64_t r = br * kFp8BlockSize; r < (br + 1) * kFp8BlockSize; ++r) {
        for (int64_t c = bc * kFp8BlockSize; c < (bc + 1) * kFp8BlockSize; ++c) {
          const int64_t i = r * cols + c;
          const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
          q[i] = mxfp4_element_as_e4m3(code, mxfp4_e4m3_shift(scales[r * groups + c / kMxfp4BlockSize], cmax));
        }
      }
    }
  }
}

// The GPU's expansion of eight e2m1 codes c[0..7] held in one 32-bit "fragment word" under a shift d.
// The word stores each code's 3 magnitude bits in nibble e (bits [4e, 4e + 3)) and its sign where the
// expansion wants it: the sign of c[e] (e < 4) at bit 8e + 7, of c[4 + e] at bit 8e + 3 (the spare
// bit 3 of each nibble; pack_fp4_word). `row` is the table row of d, the e4m3 codes of the eight
// magnitudes 0, 0.5, ... 6 times 2^d (mxfp4_shift_table_row), bytes 0..7 of (row_lo, row_hi).
// out_lo gets c[0..3] (byte j = c[j]), out_hi c[4..7]. Eight byte permutes and logic operations, the
// same bits on host and device:
//   out_lo = PRMT(row_lo, row_hi, w & 0x7777) | (w & 0x80808080)          (3: LOP3, PRMT, LOP3)
//   out_hi = PRMT(row_lo, row_hi, (w >> 16) & 0x7777) | ((w << 4) & 0x80808080)   (5)
// (PRMT reads bit 3 of a selector nibble as its sign-replicate mode: the selectors are masked.)
MEGAMOE_FMT_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t out = 0;
  for (int j = 0; j < 4; ++j) {
    const uint32_t sel = (s >> (4 * j)) & 0xFu;
    uint32_t b = static_cast<uint32_t>(v >> (8 * (sel & 7u))) & 0xFFu;
    if (sel & 8u) b = (b & 0x80u) ? 0xFFu : 0u;  // sign-replicate mode
    out |= b << (8 * j);
  }
  return out;
#endif
}

MEGAMOE_FMT_HD void mxfp4_shift_table_row(int32_t shift, uint32_t* row_lo, uint32_t* row_hi) {
  uint32_t lo = 0, hi = 0;
  for (int m = 0; m < 4; ++m) {
    lo |= static_cast<uint32_t>(mxfp4_element_as_e4m3(static_cast<uint8_t>(m), shift)) << (8 * m);
    hi |= static_cast<uint32_t>(mxfp4_element_as_e4m3(static_cast<uint8_t>(m + 4), shift)) << (8 * m);
  }
  *row_lo = lo;
  *row_hi = hi;
}

MEGAMOE_FMT_HD void fp4_word_to_e4m3(uint32_t w, uint32_t row_lo, uint32_t row_hi, uint32_t* out_lo, uint32_t* out_hi) {
  *out_lo = byte_perm(row_lo, row_hi, w & 0x7777u) | (w & 0x80808080u);
  *out_hi = byte_perm(row_lo, row_hi, (w >> 16) & 0x7777u) | ((w << 4) & 0x80808080u);
}

// ---- nvfp4 weights in the grouped GEMM (gemm_weights.h): a fragment word to bf16 -----------------------
//
// The word is pack_fp4_word's (codes e0..e7); the four bf16x2 results are (e0, e1), (e2, e3), (e4, e5),
// (e6, e7), each the code's e2m1 value times 2^120 with its sign: kNvfp4Bf16Mag{Lo,Hi}{0,1} are the low
// and high bytes of the eight magnitudes' bf16 (0, 0.5, 1, 1.5, 2, 3, 4, 6) x 2^120, codes 0..3 and 4..7.
// A block scale byte b (an e4m3 code with sign 0, not NaN: gemm_weights.h folds the sign into the codes)
// is the bf16 bits b << 4 = e4m3(b) x 2^-120 exactly (the e4m3 exponent and mantissa bits land on
// bf16's; e4m3 subnormals on bf16 subnormals), so one bf16 multiply per pair gives e2m1 x scale, which
// has at most 6 significant bits and lies in [2^-10, 2688]: exact in bf16, as expand_nvfp4_to_bf16's.
// Twelve byte permutes and logic operations per word, the same bits on host and device:
//   lo = PRMT(kLo0, kLo1, sel), hi = PRMT(kHi0, kHi1, sel) | signs, pairs = PRMT(lo, hi, 0x5140 / 0x7362)
constexpr uint32_t kNvfp4Bf16MagLo0 = 0xC0800000u, kNvfp4Bf16MagLo1 = 0xC0804000u;
constexpr uint32_t kNvfp4Bf16MagHi0 = 0x7B7B7B00u, kNvfp4Bf16MagHi1 = 0x7C7C7C7Cu;
MEGAMOE_FMT_HD void fp4_word_to_bf16x2_pow120(uint32_t w, uint32_t (&out)[4]) {
  const uint32_t s0 = w & 0x7777u, s1 = (w >> 16) & 0x7777u;
  const uint32_t lo0 = byte_perm(kNvfp4Bf16MagLo0, kNvfp4Bf16MagLo1, s0);
  const uint32_t hi0 = byte_perm(kNvfp4Bf16MagHi0, kNvfp4Bf16MagHi1, s0) | (w & 0x80808080u);
  const uint32_t lo1 = byte_perm(kNvfp4Bf16MagLo0, kNvfp4Bf16MagLo1, s1);
  const uint32_t hi1 = byte_perm(kNvfp4Bf16MagHi0, kNvfp4Bf16MagHi1, s1) | ((w << 4) & 0x80808080u);
  out[0] = byte_perm(lo0, hi0, 0x5140u);
  out[1] = byte_perm(lo0, hi0, 0x7362u);
  out[2] = byte_perm(lo1, hi1, 0x5140u);
  out[3] = byte_perm(lo1, hi1, 0x7362u);
}
// Block scale byte j of a word of four, as the bf16x2 (b << 4, b << 4) the pairs are multiplied by.
MEGAMOE_FMT_HD uint32_t nvfp4_scale_bf16x2(uint32_t scale_word, int j) {
  return byte_perm(scale_word, 0u, 0x4040u | (static_cast<uint32_t>(j) << 8) | static_cast<uint32_t>(j)) << 4;
}

// The fragment word of codes c[0..7] (each in the low 4 bits: sign at bit 3), and code e of a word.
MEGAMOE_FMT_HD uint32_t pack_fp4_word(const uint8_t* c) {
  uint32_t w = 0;
  for (int e = 0; e < 8; ++e) w |= static_cast<uint32_t>(c[e] & 0x7u) << (4 * e);
  for (int e = 0; e < 4; ++e) {
    w |= static_cast<uint32_t>((c[e] >> 3) & 1u) << (8 * e + 7);
    w |= static_cast<uint32_t>((c[4 + e] >> 3) & 1u) << (8 * e + 3);
  }
  return w;
}

MEGAMOE_FMT_HD uint8_t fp4_word_code(uint32_t w, int e) {
  const uint32_t sign_bit = e < 4 ? 8 * e + 7 : 8 * (e - 4) + 3;
  return static_cast<uint8_t>(((w >> (4 * e)) & 0x7u) | (((w >> sign_bit) & 1u) << 3));
}

// nvfp4 block scale code: e4m3((block_amax / 6) / global_scale).
MEGAMOE_FMT_HD uint8_t nvfp4_block_scale_code(float block_amax, float global_scale) {
  return float_to_e4m3(div_rn(div_rn(block_amax, kE2M1Max), global_scale));
}

// The divisor of an nvfp4 block: decoded block scale * global scale.
MEGAMOE_FMT_HD float nvfp4_block_divisor(uint8_t scale_code, float global_scale) {
  return mul_rn(e4m3_to_float(scale_code), global_scale);
}

// One nvfp4 element: e2m1(x / divisor); a block whose divisor is 0 (its scale encoded to 0: an
// all-zero block, or one far below the global amax) stores code 0 for every element.
MEGAMOE_FMT_HD uint8_t nvfp4_encode_element(float x, float divisor) {
  return divisor > 0.f ? float_to_e2m1(div_rn(x, divisor)) : static_cast<uint8_t>(0);
}

// nvfp4: packed[n / 2] (element 2i in the low nibble of byte i, 2i+1 in the high nibble),
// scales[n / 16] e4m3 block scales; value = e2m1 * (e4m3 scale * global_scale).
MEGAMOE_FMT_HD void quantize_nvfp4(const float* x, int64_t n, float global_scale, uint8_t* packed, uint8_t* scales) {
  for (int64_t b = 0; b < n / kNvfp4BlockSize; ++b) {
    const float* xb = x + b * kNvfp4BlockSize;
    const uint8_t code = nvfp4_block_scale_code(amax_finite(xb, kNvfp4BlockSize), global_scale);
    scales[b] = code;
    const float divisor = nvfp4_block_divisor(code, global_scale);
    for (int i = 0; i < kNvfp4BlockSize; i += 2) {
      const uint8_t lo = nvfp4_encode_element(xb[i], divisor);
      const uint8_t hi = nvfp4_encode_element(xb[i + 1], divisor);
      packed[(b * kNvfp4BlockSize + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

MEGAMOE_FMT_HD void dequantize_nvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n,
                                     float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
    out[i] = mul_rn(e2m1_to_float(code), nvfp4_block_divisor(scales[i / kNvfp4BlockSize], global_scale));
  }
}

}  // namespace fmt
}  // namespace megamoe
