// sm90_quant.cuh — device fp8 quantisation shared by the kernels that write e4m3 (the dispatch's
// bf16 -> e4m3 wire, the grouped GEMM's SwiGLU + requant epilogue): the hardware conversion and a
// pair quantiser bit-identical to the host codec (megamoe/formats.h) at a fraction of its cost.
#pragma once

#include <cstdint>

#include "megamoe/formats.h"

namespace megamoe {
namespace kernels {

// e4m3 codes of (lo, hi), lo in the low byte; satfinite, round to nearest even (= fmt::float_to_e4m3
// on every non-NaN input).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// bf16 codes of (lo, hi), lo in the low half, round to nearest even: fmt::float_to_bf16's code for
// every non-NaN input and for the canonical NaN 0x7FFFFFFF (0x7FFF both); other NaN payloads differ.
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// fp32 values of two e4m3 codes (the low byte first) through the hardware conversion (e4m3 -> f16 is
// exact, f16 -> f32 too): fmt::e4m3_to_float's value for every code but the two NaNs, which give a
// NaN (a mul_rn of it is the canonical NaN either way; tests/gpu/test_formats_device.cpp).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t codes) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(codes));
  float2 f;
  asm("{\n .reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;\n}\n"
      : "=f"(f.x), "=f"(f.y)
      : "r"(h));
  return f;
}

// e4m3 codes of (v0 / s, v1 / s), v0 in the low byte, bit-identical to
// fmt::float_to_e4m3(fmt::div_rn(v, s)): one IEEE division per element, then the hardware conversion
// (equal to the codec on every non-NaN input; div_rn's NaN is the canonical one, which it maps to the
// codec's 0x7F). In the dispatch kernel (64 registers per thread) it is faster than
// quantize_e4m3_pair's multiply-and-bracket below: 204.2 against 215.5 us at 8192 tokens, 14.4
// against 15.8 at 1 (docs/perf-history/transport.md, session 6).
__device__ __forceinline__ uint32_t quantize_e4m3_pair_div(float v0, float v1, float s) {
  return cvt_e4m3x2(fmt::div_rn(v0, s), fmt::div_rn(v1, s));
}

// e4m3 codes of (v0 / s, v1 / s), v0 in the low byte, bit-identical to
// fmt::float_to_e4m3(fmt::div_rn(v, s)). q = RN(v * inv), inv = RN(1 / s), is within 3 ulp of
// RN(v / s) (relative error <= 1.5 * 2^-23; fp32 subnormal results are within 2 ulp), and the encoder
// is monotone in |v| for a fixed sign: when the codes of q -/+ 8 ulp (same sign) agree, they are the
// code of the correctly rounded quotient (cvt.rn.satfinite equals fmt::float_to_e4m3 on non-NaN
// input). Otherwise (q near an e4m3 rounding boundary, ~1e-5 of the elements; |q| >= 2^127; NaN)
// quantize_e4m3_pair_div. Power-of-two scales make inv and q exact.
// The fallback is inline: out of line (the software encoder, to keep code small) its call costs the
// GEMM's SwiGLU epilogue 16-19% on qwen3-30b-a3b's FC1 even though it almost never runs
// (docs/perf-history/gemm.md, session 6).
__device__ __forceinline__ uint32_t quantize_e4m3_pair(float v0, float v1, float s, float inv) {
  const uint32_t b0 = __float_as_uint(__fmul_rn(v0, inv)), b1 = __float_as_uint(__fmul_rn(v1, inv));
  const uint32_t a0 = b0 & 0x7FFFFFFFu, a1 = b1 & 0x7FFFFFFFu;
  const uint32_t lo0 = (b0 & 0x80000000u) | (a0 > 8u ? a0 - 8u : 0u);
  const uint32_t lo1 = (b1 & 0x80000000u) | (a1 > 8u ? a1 - 8u : 0u);
  const uint16_t lo = cvt_e4m3x2(__uint_as_float(lo0), __uint_as_float(lo1));
  const uint16_t hi = cvt_e4m3x2(__uint_as_float(b0 + 8u), __uint_as_float(b1 + 8u));
  if (lo == hi && (a0 | a1) < 0x7F000000u) return lo;
  return quantize_e4m3_pair_div(v0, v1, s);
}

}  // namespace kernels
}  // namespace megamoe
