// Tests of megamoe/formats.h: every code of every element format decoded against the spec's formula
// (computed here independently with ldexp), encoders against a brute-force nearest-value reference
// and against NVIDIA's own converters (cuda_fp8.h / cuda_fp4.h host paths), the scale rules, and the
// block codecs on random data within error bounds derived from the formats.
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megamoe/formats.h"

namespace megamoe {
namespace {

using fmt::kE2M1Max;
using fmt::kE4M3Max;

uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- independent references (double precision, straight from the specs) ----

// OCP e4m3fn: S.EEEE.MMM, bias 7; E = 0 subnormal m * 2^-9; S.1111.111 NaN.
double ref_e4m3(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}
// OCP e2m1: S.EE.M, bias 1; E = 0 subnormal m * 0.5.
double ref_e2m1(int code) {
  const int s = (code >> 3) & 1, e = (code >> 1) & 3, m = code & 1;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(2 + m, e - 2);
  return s ? -mag : mag;
}
// Nearest code among the non-negative finite codes [0, max_code] of a format, ties to the even code,
// beyond the largest value saturating to it; sign re-applied (also for results of zero).
template <typename Decode>
int ref_encode(float v, int max_code, int sign_bit, Decode decode) {
  const double a = std::fabs(static_cast<double>(v));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= max_code; ++c) {
    const double err = std::fabs(decode(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  if (a > decode(max_code)) best = max_code;
  return std::signbit(v) ? (best | sign_bit) : best;
}
int ref_float_to_e4m3(float v) {
  if (std::isnan(v)) return 0x7F;
  return ref_encode(v, 0x7E, 0x80, ref_e4m3);
}
int ref_float_to_e2m1(float v) {
  if (std::isnan(v)) return 0x7;
  return ref_encode(v, 0x7, 0x8, ref_e2m1);
}
// bf16 in double: round |v| to 8 significant bits (quantum 2^(max(ilogb v, -126) - 7), subnormals
// included) with nearbyint (round half to even); 2^128 and beyond is inf.
uint16_t ref_float_to_bf16(float v) {
  const double a = std::fabs(static_cast<double>(v));
  double r = a;  // 0 and inf stay
  if (a != 0 && !std::isinf(a)) {
    const double quantum = std::ldexp(1.0, std::max(std::ilogb(a), -126) - 7);
    r = std::nearbyint(a / quantum) * quantum;
  }
  const float rf = r >= std::ldexp(1.0, 128) ? kInf : static_cast<float>(r);  // exact: r has <= 8 bits
  return static_cast<uint16_t>((bits_of(rf) >> 16) | (std::signbit(v) ? 0x8000u : 0u));
}

// Floats to try encoders on: every exponent, structured mantissas (zero, one ulp, the tie patterns
// of the 3-, 2- and 1-bit mantissas and their neighbours, all ones), both signs, plus random bits.
std::vector<float> dense_sample() {
  std::vector<float> out;
  const uint32_t mantissas[] = {0u,        1u,        0x7FFFFFu, 0x80000u,  0x7FFFFu,  0x80001u,  0x100000u,
                                0x180000u, 0x200000u, 0x1FFFFFu, 0x200001u, 0x400000u, 0x3FFFFFu, 0x400001u,
                                0x280000u, 0x680000u, 0x700000u, 0x780000u, 0x600000u, 0x5FFFFFu, 0x600001u};
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t exp = 0; exp < 256; ++exp)
      for (uint32_t m : mantissas) out.push_back(float_of((sign << 31) | (exp << 23) | m));
  std::mt19937 rng(20240601u);
  for (int i = 0; i < 1 << 20; ++i) out.push_back(float_of(rng()));
  // Concentrate on the formats' ranges: exponents 2^-12 .. 2^10.
  std::uniform_int_distribution<uint32_t> exp_dist(127 - 12, 127 + 10);
  for (int i = 0; i < 1 << 20; ++i) out.push_back(float_of((rng() & 0x807FFFFFu) | (exp_dist(rng) << 23)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(Formats, Bf16_DecodeEveryCode) {
  for (int code = 0; code < 65536; ++code) {
    const int s = code >> 15, e = (code >> 7) & 0xFF, m = code & 0x7F;
    const float got = fmt::bf16_to_float(static_cast<uint16_t>(code));
    if (e == 0xFF) {
      EXPECT_EQ(std::isnan(got), m != 0) << code;
      if (m == 0) {
        EXPECT_EQ(got, s ? -kInf : kInf);
      }
      continue;
    }
    const double mag = e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
    EXPECT_EQ(static_cast<double>(got), s ? -mag : mag) << "code " << code;
    EXPECT_EQ(std::signbit(got), s == 1) << code;
  }
}

TEST(Formats, Bf16_EncodeRoundTripsEveryNonNaNCode) {
  for (int code = 0; code < 65536; ++code) {
    if ((code & 0x7F80) == 0x7F80 && (code & 0x7F)) continue;  // NaN payloads
    EXPECT_EQ(fmt::float_to_bf16(fmt::bf16_to_float(static_cast<uint16_t>(code))), code) << code;
  }
}

TEST(Formats, Bf16_RoundsToNearestEven) {
  // Ties: 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd) -> 1; 1 + 3*2^-8 halfway
  // between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6.
  EXPECT_EQ(fmt::float_to_bf16(1.f + std::ldexp(1.f, -8)), 0x3F80);
  EXPECT_EQ(fmt::float_to_bf16(1.f + 3 * std::ldexp(1.f, -8)), 0x3F82);
  EXPECT_EQ(fmt::float_to_bf16(-(1.f + 3 * std::ldexp(1.f, -8))), 0xBF82);
  EXPECT_EQ(fmt::float_to_bf16(std::nextafter(1.f + std::ldexp(1.f, -8), 2.f)), 0x3F81);
  EXPECT_EQ(fmt::float_to_bf16(float_of(0x7F7FFFFFu)), 0x7F80);  // FLT_MAX rounds to inf
  EXPECT_EQ(fmt::float_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(fmt::float_to_bf16(-0.f), 0x8000);
  EXPECT_EQ(fmt::float_to_bf16(float_of(0x00018000u)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(fmt::round_to_bf16(3.14159265f), fmt::bf16_to_float(0x4049));
  int64_t mismatches = 0;
  for (float v : dense_sample()) {
    if (std::isnan(v)) continue;
    mismatches += fmt::float_to_bf16(v) != ref_float_to_bf16(v);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Formats, Bf16_NaNStaysQuietNaNWithSign) {
  for (uint32_t u : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC12345u, 0x7F810000u}) {
    const uint16_t b = fmt::float_to_bf16(float_of(u));
    EXPECT_TRUE(std::isnan(fmt::bf16_to_float(b))) << std::hex << u;
    EXPECT_EQ(b & 0x0040, 0x0040) << "quiet bit, input " << std::hex << u;
    EXPECT_EQ(b >> 15, u >> 31) << "sign, input " << std::hex << u;
  }
}

// ---------------------------------------------------------------------------------------------
// e4m3

TEST(Formats, E4M3_DecodeEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float got = fmt::e4m3_to_float(static_cast<uint8_t>(code));
    const double want = ref_e4m3(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
    EXPECT_EQ(std::signbit(got), code >= 0x80) << code;
  }
  EXPECT_EQ(fmt::e4m3_to_float(0x7E), kE4M3Max);
  EXPECT_EQ(fmt::e4m3_to_float(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(fmt::e4m3_to_float(0x08), std::ldexp(1.f, -6));
}

TEST(Formats, E4M3_EncodeRoundTripsEveryFiniteCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(fmt::float_to_e4m3(fmt::e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
}

TEST(Formats, E4M3_TiesRoundToEven) {
  int ties = 0;
  for (int c = 0; c < 0x7E; ++c) {  // adjacent non-negative finite codes c, c+1
    const double lo = ref_e4m3(c), hi = ref_e4m3(c + 1);
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: e4m3 values have <= 5 significant bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(fmt::float_to_e4m3(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(fmt::float_to_e4m3(-mid), even | 0x80) << "negative midpoint of " << c;
    EXPECT_EQ(fmt::float_to_e4m3(std::nextafter(mid, 0.f)), c) << c;
    EXPECT_EQ(fmt::float_to_e4m3(std::nextafter(mid, kInf)), c + 1) << c;
    ++ties;
  }
  EXPECT_EQ(ties, 126);
}

TEST(Formats, E4M3_Saturates) {
  for (float v : {448.f, 449.f, 463.99f, 464.f, 465.f, 1000.f, 1e30f, float_of(0x7F7FFFFFu), kInf}) {
    EXPECT_EQ(fmt::float_to_e4m3(v), 0x7E) << v;
    EXPECT_EQ(fmt::float_to_e4m3(-v), 0xFE) << -v;
  }
  EXPECT_EQ(fmt::float_to_e4m3(447.f), 0x7E);  // nearest is 448
  EXPECT_EQ(fmt::float_to_e4m3(432.f), 0x7E);  // tie 416 (odd 0x7D) / 448 (even 0x7E)
  EXPECT_EQ(fmt::float_to_e4m3(431.f), 0x7D);
}

TEST(Formats, E4M3_NaNAndNegativeZero) {
  for (uint32_t u : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu})
    EXPECT_EQ(fmt::float_to_e4m3(float_of(u)), 0x7F);
  EXPECT_TRUE(std::isnan(fmt::e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fmt::e4m3_to_float(0xFF)));
  EXPECT_EQ(fmt::float_to_e4m3(-0.f), 0x80);
  EXPECT_EQ(fmt::float_to_e4m3(0.f), 0x00);
  EXPECT_EQ(fmt::float_to_e4m3(-1e-20f), 0x80);  // rounds to zero, keeps the sign
  EXPECT_TRUE(std::signbit(fmt::e4m3_to_float(0x80)));
}

TEST(Formats, E4M3_Subnormals) {
  const float ulp = std::ldexp(1.f, -9);
  EXPECT_EQ(fmt::float_to_e4m3(ulp), 0x01);
  EXPECT_EQ(fmt::float_to_e4m3(3 * ulp), 0x03);
  EXPECT_EQ(fmt::float_to_e4m3(7 * ulp), 0x07);
  EXPECT_EQ(fmt::float_to_e4m3(0.5f * ulp), 0x00);  // tie 0 / 2^-9 -> 0
  EXPECT_EQ(fmt::float_to_e4m3(std::nextafter(0.5f * ulp, 1.f)), 0x01);
  EXPECT_EQ(fmt::float_to_e4m3(1.5f * ulp), 0x02);  // tie 1 / 2 -> 2
  EXPECT_EQ(fmt::float_to_e4m3(2.5f * ulp), 0x02);  // tie 2 / 3 -> 2
  EXPECT_EQ(fmt::float_to_e4m3(7.5f * ulp), 0x08);  // tie 7 / min normal -> 0x08
  EXPECT_EQ(fmt::float_to_e4m3(-5 * ulp), 0x85);
  EXPECT_EQ(fmt::float_to_e4m3(float_of(1u)), 0x00);  // fp32 subnormal -> 0
  EXPECT_EQ(fmt::float_to_e4m3(-float_of(0x007FFFFFu)), 0x80);
}

TEST(Formats, E4M3_EncodeMatchesReferenceAndCuda) {
  int64_t vs_ref = 0, vs_cuda = 0, n = 0;
  for (float v : dense_sample()) {
    const int got = fmt::float_to_e4m3(v);
    vs_ref += got != ref_float_to_e4m3(v);
    vs_cuda += got != static_cast<int>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    ++n;
  }
  std::printf("e4m3 encode: %lld inputs, %lld differ from the nearest-value reference, %lld from cuda_fp8.h\n",
              static_cast<long long>(n), static_cast<long long>(vs_ref), static_cast<long long>(vs_cuda));
  EXPECT_EQ(vs_ref, 0);
  EXPECT_EQ(vs_cuda, 0);
}

// ---------------------------------------------------------------------------------------------
// e2m1

TEST(Formats, E2M1_DecodeEveryCode) {
  const double values[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int code = 0; code < 16; ++code) {
    const float got = fmt::e2m1_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(static_cast<double>(got), ref_e2m1(code)) << code;
    EXPECT_EQ(std::fabs(got), values[code & 7]) << code;
    EXPECT_EQ(std::signbit(got), code >= 8) << code;
    // Only the low nibble matters.
    EXPECT_EQ(bits_of(fmt::e2m1_to_float(static_cast<uint8_t>(code | 0xA0))), bits_of(got));
  }
}

TEST(Formats, E2M1_EncodeEveryCodeTiesSaturationNaN) {
  for (int code = 0; code < 16; ++code)
    EXPECT_EQ(fmt::float_to_e2m1(fmt::e2m1_to_float(static_cast<uint8_t>(code))), code) << code;
  // Midpoints go to the even code (mantissa bit 0).
  const struct {
    float v;
    int code;
  } ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.f, 6}};
  for (const auto& t : ties) {
    EXPECT_EQ(fmt::float_to_e2m1(t.v), t.code) << t.v;
    EXPECT_EQ(fmt::float_to_e2m1(-t.v), t.code | 8) << -t.v;
    EXPECT_EQ(fmt::float_to_e2m1(std::nextafter(t.v, 0.f)), ref_float_to_e2m1(std::nextafter(t.v, 0.f))) << t.v;
    EXPECT_EQ(fmt::float_to_e2m1(std::nextafter(t.v, kInf)), ref_float_to_e2m1(std::nextafter(t.v, kInf))) << t.v;
  }
  for (float v : {6.f, 7.f, 100.f, 1e30f, kInf}) {
    EXPECT_EQ(fmt::float_to_e2m1(v), 0x7) << v;
    EXPECT_EQ(fmt::float_to_e2m1(-v), 0xF) << -v;
  }
  EXPECT_EQ(fmt::float_to_e2m1(kNaN), 0x7);
  EXPECT_EQ(fmt::float_to_e2m1(-kNaN), 0x7);
  EXPECT_EQ(fmt::float_to_e2m1(-0.f), 0x8);
  EXPECT_EQ(fmt::float_to_e2m1(-0.1f), 0x8);
  EXPECT_EQ(fmt::float_to_e2m1(0.26f), 0x1);  // just above the first tie: the subnormal 0.5
}

TEST(Formats, E2M1_EncodeMatchesReferenceAndCuda) {
  int64_t vs_ref = 0, vs_cuda = 0;
  for (float v : dense_sample()) {
    const int got = fmt::float_to_e2m1(v);
    vs_ref += got != ref_float_to_e2m1(v);
    vs_cuda += got != static_cast<int>(__nv_cvt_float_to_fp4(v, __NV_E2M1, cudaRoundNearest));
  }
  EXPECT_EQ(vs_ref, 0);
  EXPECT_EQ(vs_cuda, 0);
}

// ---------------------------------------------------------------------------------------------
// e8m0 and the scale rules

TEST(Formats, E8M0_DecodeEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float got = fmt::e8m0_to_float(static_cast<uint8_t>(code));
    if (code == 255) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, code - 127)) << code;
  }
}

TEST(Formats, Fp8BlockScale_Rules) {
  EXPECT_EQ(fmt::fp8_block_scale(0.f, false), 1.f);
  EXPECT_EQ(fmt::fp8_block_scale(0.f, true), 1.f);
  EXPECT_EQ(fmt::fp8_block_scale(448.f, false), 1.f);
  EXPECT_EQ(fmt::fp8_block_scale(448.f, true), 1.f);
  EXPECT_EQ(fmt::fp8_block_scale(std::nextafter(448.f, kInf), true), 2.f);
  EXPECT_EQ(fmt::fp8_block_scale(225.f, true), 1.f);
  EXPECT_EQ(fmt::fp8_block_scale(224.f, true), 0.5f);
  EXPECT_EQ(fmt::fp8_block_scale(1e-40f, false), fmt::kMinNormalFp32);  // clamped: never subnormal
  std::mt19937 rng(7u);
  std::uniform_real_distribution<double> log2_dist(-100.0, 100.0);
  for (int i = 0; i < 200000; ++i) {
    const float amax = static_cast<float>(std::exp2(log2_dist(rng)));
    const float s = fmt::fp8_block_scale(amax, false);
    ASSERT_EQ(s, amax / 448.f) << amax;
    const float p = fmt::fp8_block_scale(amax, true);
    int exp;
    ASSERT_EQ(std::frexp(p, &exp), 0.5f) << "power of two, amax " << amax;
    // amax <= 448 * p (so amax / p <= 448: no saturation), and p is the smallest such power of two.
    ASSERT_LE(static_cast<double>(amax), 448.0 * p) << amax;
    ASSERT_GT(static_cast<double>(amax), 448.0 * p / 2) << amax;
    ASSERT_GE(static_cast<double>(p), static_cast<double>(amax) / 448.0) << amax;
  }
  // Exact powers: amax = 448 * 2^k gives 2^k.
  for (int k = -60; k <= 60; ++k) EXPECT_EQ(fmt::fp8_block_scale(std::ldexp(448.f, k), true), std::ldexp(1.f, k)) << k;
}

TEST(Formats, Mxfp8ScaleCode_OcpRule) {
  EXPECT_EQ(fmt::mxfp8_scale_code(0.f), 127);
  EXPECT_EQ(fmt::mxfp8_scale_code(kNaN), 0xFF);
  EXPECT_EQ(fmt::mxfp8_scale_code(kInf), 254);
  EXPECT_EQ(fmt::mxfp8_scale_code(256.f), 127);  // floor(log2 256) - 8 = 0
  EXPECT_EQ(fmt::mxfp8_scale_code(std::nextafter(256.f, 0.f)), 126);
  EXPECT_EQ(fmt::mxfp8_scale_code(511.9f), 127);
  EXPECT_EQ(fmt::mxfp8_scale_code(1.f), 119);
  EXPECT_EQ(fmt::mxfp8_scale_code(float_of(1u)), 0);  // clamped
  EXPECT_EQ(fmt::mxfp8_scale_code(float_of(0x7F7FFFFFu)), 127 + 127 - 8);
  std::mt19937 rng(11u);
  std::uniform_real_distribution<double> log2_dist(-140.0, 127.9);
  for (int i = 0; i < 200000; ++i) {
    const float amax = static_cast<float>(std::exp2(log2_dist(rng)));
    if (amax == 0.f) continue;
    int exp;
    std::frexp(static_cast<double>(amax), &exp);  // amax = f * 2^exp, f in [0.5, 1): floor(log2) = exp - 1
    const int want = std::min(254, std::max(0, (exp - 1) - 8 + 127));
    ASSERT_EQ(fmt::mxfp8_scale_code(amax), want) << amax;
    if (want > 0) {  // the block's largest element lands in [256, 512) before saturation
      const double t = amax / static_cast<double>(fmt::e8m0_to_float(static_cast<uint8_t>(want)));
      ASSERT_GE(t, 256.0);
      ASSERT_LT(t, 512.0);
    }
  }
}

TEST(Formats, Mxfp4ScaleCode_OcpRule) {
  EXPECT_EQ(fmt::mxfp4_scale_code(0.f), 127);
  EXPECT_EQ(fmt::mxfp4_scale_code(kNaN), 0xFF);
  EXPECT_EQ(fmt::mxfp4_scale_code(kInf), 254);
  EXPECT_EQ(fmt::mxfp4_scale_code(4.f), 127);  // floor(log2 4) - 2 = 0
  EXPECT_EQ(fmt::mxfp4_scale_code(std::nextafter(4.f, 0.f)), 126);
  EXPECT_EQ(fmt::mxfp4_scale_code(7.99f), 127);
  EXPECT_EQ(fmt::mxfp4_scale_code(1.f), 125);
  EXPECT_EQ(fmt::mxfp4_scale_code(float_of(1u)), 0);  // clamped
  EXPECT_EQ(fmt::mxfp4_scale_code(float_of(0x7F7FFFFFu)), 127 + 127 - 2);
  std::mt19937 rng(12u);
  std::uniform_real_distribution<double> log2_dist(-140.0, 127.9);
  for (int i = 0; i < 200000; ++i) {
    const float amax = static_cast<float>(std::exp2(log2_dist(rng)));
    if (amax == 0.f) continue;
    int exp;
    std::frexp(static_cast<double>(amax), &exp);
    const int want = std::min(254, std::max(0, (exp - 1) - 2 + 127));
    ASSERT_EQ(fmt::mxfp4_scale_code(amax), want) << amax;
    if (want > 0) {  // the block's largest element lands in [4, 8) before saturation
      const double t = amax / static_cast<double>(fmt::e8m0_to_float(static_cast<uint8_t>(want)));
      ASSERT_GE(t, 4.0);
      ASSERT_LT(t, 8.0);
    }
  }
}

TEST(Formats, Nvfp4GlobalScale_Rule) {
  EXPECT_EQ(fmt::nvfp4_global_scale(0.f), 1.f);
  EXPECT_EQ(fmt::nvfp4_global_scale(2688.f), 1.f);
  EXPECT_EQ(fmt::nvfp4_global_scale(10.f), 10.f / 2688.f);
  // The block holding the tensor's amax gets the largest e4m3 scale, 448.
  EXPECT_EQ(fmt::nvfp4_block_scale_code(10.f, fmt::nvfp4_global_scale(10.f)), 0x7E);
}

// ---------------------------------------------------------------------------------------------
// Block codecs on random data.
//
// Error bounds, derived from the element formats. An element x of a block whose decoded scale (or
// nvfp4 divisor) is d is stored as code = RNE(x / d), so
//   |x - code * d| <= d * half_gap(|x| / d)   while |x| / d <= max,
//   |x - code * d|  = |x| - max * d           beyond (saturation),
// plus the fp32 rounding of the division and the product (2^-24 relative each; slop 2^-22 below).
//   e4m3: half_gap(t) = 2^(floor(log2 t) - 4) for t >= 2^-6 (3 mantissa bits), 2^-10 below (step
//         2^-9), so in the normal range [2^-6, 448] the error is <= 2^-4 |x|.
//   e2m1: half_gap(t) = 0.25 below 2, 0.5 below 4, 1 up to 6, so in [1, 6] the error is <= 2^-2 |x|.
// fp8-block scales never saturate (amax / s <= 448 by construction); mxfp8 saturates elements with
// |x| / X in (448, 512) (the OCP rule; error up to |x| / 8); nvfp4 saturates where the block scale
// rounded down.

double half_gap_e4m3(double t) {
  return t < std::ldexp(1.0, -6) ? std::ldexp(1.0, -10) : std::ldexp(1.0, std::ilogb(t) - 4);
}
double half_gap_e2m1(double t) { return t < 2 ? 0.25 : (t < 4 ? 0.5 : 1.0); }

struct ElementFormat {
  const char* name;
  double max, normal_min, rel;  // largest value, start of the normal range, normal-range relative bound
  double (*half_gap)(double);
};
const ElementFormat kE4M3Format{"e4m3", 448.0, 1.0 / 64, 1.0 / 16, half_gap_e4m3};
const ElementFormat kE2M1Format{"e2m1", 6.0, 1.0, 1.0 / 4, half_gap_e2m1};

struct ErrorStats {
  double err2 = 0, ref2 = 0, bound2 = 0, worst_ratio = 0;
  int64_t count = 0, saturated = 0, violations = 0, normal_violations = 0;

  void add(const ElementFormat& f, float x, double d, float deq) {
    const double ax = std::fabs(static_cast<double>(x));
    const double err = std::fabs(static_cast<double>(x) - static_cast<double>(deq));
    const double t = ax / d;
    const double slop = std::ldexp(ax + std::fabs(static_cast<double>(deq)), -22) + std::ldexp(1.0, -140);
    double bound;
    if (t > f.max) {
      bound = ax - f.max * d;
      saturated += t > f.max * (1 + 1e-6);  // beyond the hair of fp32 rounding in the scale
    } else {
      bound = d * f.half_gap(std::min(t * (1 + 1e-6), f.max));  // the wider gap at a binade edge
    }
    bound += slop;
    violations += err > bound;
    if (t >= f.normal_min && t <= f.max) normal_violations += err > f.rel * ax + slop;
    if (t <= f.max) worst_ratio = std::max(worst_ratio, err / bound);
    err2 += err * err;
    ref2 += ax * ax;
    bound2 += bound * bound;
    ++count;
  }
  double rel_l2() const { return std::sqrt(err2 / ref2); }
  double rel_l2_bound() const { return std::sqrt(bound2 / ref2); }
  void print(const std::string& what) const {
    std::printf("%-34s rel-L2 %.4e (derived bound %.4e)  worst err/bound (unsaturated) %.6f  saturated %lld/%lld\n",
                what.c_str(), rel_l2(), rel_l2_bound(), worst_ratio, static_cast<long long>(saturated),
                static_cast<long long>(count));
  }
  void expect_within(const std::string& what) const {
    EXPECT_EQ(violations, 0) << what;
    EXPECT_EQ(normal_violations, 0) << what;
    EXPECT_LE(rel_l2(), rel_l2_bound()) << what;
  }
};

enum class Dist { kNormal, kHeavy };
const char* dist_name(Dist d) { return d == Dist::kNormal ? "normal" : "heavy"; }

// kNormal: N(0, 1) times a magnitude 2^U[-12, 12] per run of `block` elements (scales across
// binades). kHeavy: Student-t with 1.5 degrees of freedom (infinite variance; outliers dominate).
std::vector<float> random_data(int64_t n, Dist dist, uint32_t seed, int64_t block) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::student_t_distribution<float> heavy(1.5f);
  std::uniform_int_distribution<int> binade(-12, 12);
  std::vector<float> x(static_cast<size_t>(n));
  float magnitude = 1.f;
  for (int64_t i = 0; i < n; ++i) {
    if (dist == Dist::kNormal) {
      if (i % block == 0) magnitude = std::ldexp(1.f, binade(rng));
      x[i] = normal(rng) * magnitude;
    } else {
      x[i] = heavy(rng);
    }
  }
  return x;
}

double block_amax(const float* x, int64_t n, int64_t stride = 1, int64_t rows = 1, int64_t row_stride = 0) {
  double m = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(x[r * row_stride + i * stride])));
  return m;
}

TEST(Formats, Fp8_1x128_RoundTripWithinBound) {
  const int64_t n = 128 * 2048;
  for (bool pow2 : {false, true}) {
    for (Dist dist : {Dist::kNormal, Dist::kHeavy}) {
      const std::string what = std::string("fp8 1x128 ") + (pow2 ? "pow2 " : "") + dist_name(dist);
      const std::vector<float> x = random_data(n, dist, 1234u + pow2, 128);
      std::vector<uint8_t> q(n, 0xAA);
      std::vector<float> scales(n / 128, -1.f), out(n, kNaN);
      fmt::quantize_fp8_1x128(x.data(), n, q.data(), scales.data(), pow2);
      fmt::dequantize_fp8_1x128(q.data(), scales.data(), n, out.data());
      ErrorStats st;
      for (int64_t b = 0; b < n / 128; ++b) {
        const double amax = block_amax(&x[b * 128], 128);
        const double s = scales[b];
        ASSERT_EQ(scales[b], fmt::fp8_block_scale(static_cast<float>(amax), pow2)) << what << " block " << b;
        double max_code = 0;
        for (int i = 0; i < 128; ++i)
          max_code = std::max(max_code, std::fabs(static_cast<double>(fmt::e4m3_to_float(q[b * 128 + i]))));
        // The block's amax lands on 448 (pow2: in [224, 448]): the whole e4m3 range is used.
        if (pow2) {
          ASSERT_GE(max_code, 224.0) << what << " block " << b;
          ASSERT_LE(max_code, 448.0) << what << " block " << b;
        } else {
          ASSERT_EQ(max_code, 448.0) << what << " block " << b;
        }
        for (int i = 0; i < 128; ++i) st.add(kE4M3Format, x[b * 128 + i], s, out[b * 128 + i]);
      }
      st.print(what);
      st.expect_within(what);
      EXPECT_EQ(st.saturated, 0) << what;
    }
  }
}

TEST(Formats, Fp8_128x128_RoundTripWithinBound) {
  const int64_t rows = 384, cols = 640;
  for (bool pow2 : {false, true}) {
    for (Dist dist : {Dist::kNormal, Dist::kHeavy}) {
      const std::string what = std::string("fp8 128x128 ") + (pow2 ? "pow2 " : "") + dist_name(dist);
      const std::vector<float> w = random_data(rows * cols, dist, 99u + pow2, 128 * cols);
      std::vector<uint8_t> q(rows * cols, 0xAA);
      std::vector<float> scales(rows / 128 * (cols / 128), -1.f), out(rows * cols, kNaN);
      fmt::quantize_fp8_128x128(w.data(), rows, cols, q.data(), scales.data(), pow2);
      fmt::dequantize_fp8_128x128(q.data(), scales.data(), rows, cols, out.data());
      ErrorStats st;
      for (int64_t br = 0; br < rows / 128; ++br) {
        for (int64_t bc = 0; bc < cols / 128; ++bc) {
          const double amax = block_amax(&w[br * 128 * cols + bc * 128], 128, 1, 128, cols);
          ASSERT_EQ(scales[br * (cols / 128) + bc], fmt::fp8_block_scale(static_cast<float>(amax), pow2))
              << what << " block " << br << "," << bc;
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          st.add(kE4M3Format, w[r * cols + c], scales[r / 128 * (cols / 128) + c / 128], out[r * cols + c]);
      st.print(what);
      st.expect_within(what);
      EXPECT_EQ(st.saturated, 0) << what;
    }
  }
}

TEST(Formats, Mxfp8_RoundTripWithinBound) {
  const int64_t n = 32 * 8192;
  for (Dist dist : {Dist::kNormal, Dist::kHeavy}) {
    const std::string what = std::string("mxfp8 ") + dist_name(dist);
    const std::vector<float> x = random_data(n, dist, 4242u, 32);
    std::vector<uint8_t> q(n, 0xAA), scales(n / 32, 0xAA);
    std::vector<float> out(n, kNaN);
    fmt::quantize_mxfp8(x.data(), n, q.data(), scales.data());
    fmt::dequantize_mxfp8(q.data(), scales.data(), n, out.data());
    ErrorStats st;
    for (int64_t b = 0; b < n / 32; ++b) {
      int exp;
      std::frexp(block_amax(&x[b * 32], 32), &exp);
      ASSERT_EQ(scales[b], std::min(254, std::max(0, (exp - 1) - 8 + 127))) << what << " block " << b;
      const double d = std::ldexp(1.0, scales[b] - 127);
      for (int i = 0; i < 32; ++i) st.add(kE4M3Format, x[b * 32 + i], d, out[b * 32 + i]);
    }
    st.print(what);
    st.expect_within(what);
  }
}

TEST(Formats, Nvfp4_RoundTripWithinBound) {
  const int64_t n = 16 * 16384;
  for (Dist dist : {Dist::kNormal, Dist::kHeavy}) {
    const std::string what = std::string("nvfp4 ") + dist_name(dist);
    // One magnitude for the whole tensor, as a weight matrix has (per-block binades would push most
    // blocks' e4m3 scales into the subnormal range of a global scale set by the largest block).
    const std::vector<float> x = random_data(n, dist, 777u, n);
    const float global = fmt::nvfp4_global_scale(static_cast<float>(block_amax(x.data(), n)));
    std::vector<uint8_t> packed(n / 2, 0xAA), scales(n / 16, 0xAA);
    std::vector<float> out(n, kNaN);
    fmt::quantize_nvfp4(x.data(), n, global, packed.data(), scales.data());
    fmt::dequantize_nvfp4(packed.data(), scales.data(), global, n, out.data());
    ErrorStats st;
    int64_t normal_blocks = 0;
    for (int64_t b = 0; b < n / 16; ++b) {
      const double d = static_cast<double>(fmt::e4m3_to_float(scales[b])) * global;
      const double target = block_amax(&x[b * 16], 16) / 6 / global;  // the block scale before rounding
      if (scales[b] >= 0x08) {
        // Normal e4m3 block scale: within 2^-4 of its target, and the block's largest element
        // encodes to +-6 (|x| / d in [6 / (1 + 2^-4), 6 / (1 - 2^-4)]).
        ++normal_blocks;
        ASSERT_LE(std::fabs(fmt::e4m3_to_float(scales[b]) - target), target / 16 * (1 + 1e-6)) << what << " " << b;
        int max_code = 0;
        for (int i = 0; i < 16; ++i) max_code = std::max(max_code, (packed[(b * 16 + i) / 2] >> ((i & 1) * 4)) & 7);
        ASSERT_EQ(max_code, 7) << what << " block " << b;
      }
      for (int i = 0; i < 16; ++i) st.add(kE2M1Format, x[b * 16 + i], d, out[b * 16 + i]);
    }
    std::printf("%-34s %lld/%lld blocks with a normal e4m3 scale\n", what.c_str(),
                static_cast<long long>(normal_blocks), static_cast<long long>(n / 16));
    st.print(what);
    st.expect_within(what);
  }
}

TEST(Formats, Mxfp4_RoundTripWithinBound) {
  const int64_t n = 32 * 8192;
  for (Dist dist : {Dist::kNormal, Dist::kHeavy}) {
    const std::string what = std::string("mxfp4 ") + dist_name(dist);
    const std::vector<float> x = random_data(n, dist, 4343u, 32);
    std::vector<uint8_t> packed(n / 2, 0xAA), scales(n / 32, 0xAA);
    std::vector<float> out(n, kNaN);
    fmt::quantize_mxfp4(x.data(), n, packed.data(), scales.data());
    fmt::dequantize_mxfp4(packed.data(), scales.data(), n, out.data());
    ErrorStats st;
    for (int64_t b = 0; b < n / 32; ++b) {
      int exp;
      std::frexp(block_amax(&x[b * 32], 32), &exp);
      ASSERT_EQ(scales[b], std::min(254, std::max(0, (exp - 1) - 2 + 127))) << what << " block " << b;
      const double d = std::ldexp(1.0, scales[b] - 127);
      for (int i = 0; i < 32; ++i) {
        st.add(kE2M1Format, x[b * 32 + i], d, out[b * 32 + i]);
        // Each element is the nearest e2m1 value of x / d (saturated at 6) times d, exactly.
        const uint8_t code = static_cast<uint8_t>((packed[(b * 32 + i) / 2] >> (((b * 32 + i) & 1) * 4)) & 0xF);
        ASSERT_EQ(code, fmt::float_to_e2m1(static_cast<float>(x[b * 32 + i] / d))) << what << " " << b << " " << i;
        ASSERT_EQ(out[b * 32 + i], static_cast<float>(fmt::e2m1_to_float(code) * d));
      }
    }
    st.print(what);
    st.expect_within(what);
  }
}

// mxfp4 as e4m3 under a pow2 scale per 128 x 128 block (the GPU's expansion).
TEST(Formats, Mxfp4AsE4m3_EveryCodeAndShiftExactDownToMinus8) {
  for (int shift = fmt::kMxfp4MinExactShift; shift <= 6; ++shift) {
    for (int code = 0; code < 16; ++code) {
      const uint8_t q = fmt::mxfp4_element_as_e4m3(static_cast<uint8_t>(code), shift);
      const float want = std::ldexp(fmt::e2m1_to_float(static_cast<uint8_t>(code)), shift);
      EXPECT_EQ(bits_of(fmt::e4m3_to_float(q)), bits_of(want)) << "code " << code << " shift " << shift;
    }
  }
  // One binade below, 0.5 * 2^-9 = 2^-10 ties to zero and 1.5 * 2^-9 rounds to 2^-8: no longer exact.
  EXPECT_EQ(fmt::mxfp4_element_as_e4m3(0x1, -9), 0x00);
  EXPECT_EQ(fmt::mxfp4_element_as_e4m3(0x3, -9), 0x02);
  EXPECT_EQ(fmt::mxfp4_element_as_e4m3(0x7, fmt::kMxfp4MinShift), 0x00);  // 6 * 2^-14 < 2^-10
  EXPECT_EQ(fmt::mxfp4_e4m3_shift(0, 254), fmt::kMxfp4MinShift);
  EXPECT_EQ(fmt::mxfp4_e4m3_shift(130, 130), 6);
  EXPECT_EQ(fmt::mxfp4_e4m3_shift(3, 5), 2);  // cmax < 7 counts as 7
  EXPECT_EQ(fmt::mxfp4_e4m3_block_scale(133), 1.f);
  EXPECT_EQ(fmt::mxfp4_e4m3_block_scale(0), fmt::kMinNormalFp32);
}

// Random mxfp4 weights whose groups span `binades` scale codes in each 128 x 128 block.
void mxfp4_blocks(int64_t rows, int64_t cols, int binades, uint32_t seed, std::vector<uint8_t>* packed,
                  std::vector<uint8_t>* scales) {
  std::mt19937 rng(seed);
  packed->resize(rows * cols / 2);
  scales->resize(rows * cols / 32);
  for (auto& b : *packed) b = static_cast<uint8_t>(rng());
  std::uniform_int_distribution<int> code(0, binades - 1);
  for (auto& c : *scales) c = static_cast<uint8_t>(120 + code(rng));
  (*scales)[0] = static_cast<uint8_t>(120 + binades - 1);  // every span reaches its top in block (0, 0)
  (*scales)[1] = 120;
}

TEST(Formats, Mxfp4AsE4m3_WithinFifteenBinadesBitEqualToMxfp4) {
  const int64_t rows = 256, cols = 384;
  std::vector<uint8_t> packed, scales, q(rows * cols);
  std::vector<float> block(rows / 128 * (cols / 128)), via_fp8(rows * cols), direct(rows * cols);
  mxfp4_blocks(rows, cols, 15, 21u, &packed, &scales);
  fmt::mxfp4_to_fp8_128x128(packed.data(), scales.data(), rows, cols, q.data(), block.data());
  fmt::dequantize_fp8_128x128(q.data(), block.data(), rows, cols, via_fp8.data());
  fmt::dequantize_mxfp4(packed.data(), scales.data(), rows * cols, direct.data());
  int64_t diffs = 0;
  for (int64_t i = 0; i < rows * cols; ++i) diffs += bits_of(via_fp8[i]) != bits_of(direct[i]);
  EXPECT_EQ(diffs, 0) << "e4m3 * S must be the mxfp4 value bit for bit when a block spans <= 15 binades";
  EXPECT_EQ(block[0], std::ldexp(1.f, 134 - 133));  // cmax 134 in block (0, 0)
}

TEST(Formats, Mxfp4AsE4m3_BeyondFifteenBinadesRoundsWithinTwoToTheMinus10S) {
  const int64_t rows = 128, cols = 128;
  std::vector<uint8_t> packed, scales, q(rows * cols);
  std::vector<float> block(1), via_fp8(rows * cols), direct(rows * cols);
  mxfp4_blocks(rows, cols, 24, 22u, &packed, &scales);  // codes 120..143: 24 binades
  fmt::mxfp4_to_fp8_128x128(packed.data(), scales.data(), rows, cols, q.data(), block.data());
  fmt::dequantize_fp8_128x128(q.data(), block.data(), rows, cols, via_fp8.data());
  fmt::dequantize_mxfp4(packed.data(), scales.data(), rows * cols, direct.data());
  const double S = block[0];
  int64_t inexact = 0, exact_groups_wrong = 0;
  double worst = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double err = std::fabs(static_cast<double>(via_fp8[i]) - direct[i]);
    worst = std::max(worst, err / S);
    inexact += err > 0;
    const bool exact_group = fmt::mxfp4_e4m3_shift(scales[i / 32], 143) >= fmt::kMxfp4MinExactShift;
    exact_groups_wrong += exact_group && err > 0;
  }
  std::printf("24 binades: %lld of %lld elements rounded, worst error %.3g * S (bound 2^-10 = %.3g)\n",
              static_cast<long long>(inexact), static_cast<long long>(rows * cols), worst, std::ldexp(1.0, -10));
  EXPECT_GT(inexact, 0);
  EXPECT_EQ(exact_groups_wrong, 0) << "groups within 15 binades of the block's largest stay exact";
  EXPECT_LE(worst, std::ldexp(1.0, -10));
}

// The GPU's fragment-word expansion (byte permutes and logic) against the element definition: every
// code in every position under every shift, and random words; packing and unpacking are inverse.
TEST(Formats, Fp4WordToE4m3_EqualsTheElementExpansion) {
  EXPECT_EQ(fmt::byte_perm(0x33221100u, 0x77665544u, 0x7531u), 0x77553311u);
  EXPECT_EQ(fmt::byte_perm(0x00800000u, 0u, 0x08A2u), 0x0000FF80u);  // sign-replicate of 0x80 is 0xFF, of 0x00 is 0
  std::mt19937 rng(31u);
  for (int shift = fmt::kMxfp4MinShift; shift <= 6; ++shift) {
    uint32_t lo, hi;
    fmt::mxfp4_shift_table_row(shift, &lo, &hi);
    auto check = [&](const uint8_t* c) {
      const uint32_t w = fmt::pack_fp4_word(c);
      uint32_t out_lo, out_hi;
      fmt::fp4_word_to_e4m3(w, lo, hi, &out_lo, &out_hi);
      for (int i = 0; i < 8; ++i) {
        ASSERT_EQ(fmt::fp4_word_code(w, i), c[i]) << "unpack element " << i;
        const uint8_t want = fmt::mxfp4_element_as_e4m3(c[i], shift);
        const uint8_t got = static_cast<uint8_t>(((i < 4 ? out_lo : out_hi) >> (8 * (i % 4))) & 0xFF);
        ASSERT_EQ(got, want) << "word " << std::hex << w << " element " << i << " shift " << std::dec << shift;
      }
    };
    uint8_t c[8];
    for (int pos = 0; pos < 8; ++pos)
      for (uint8_t code = 0; code < 16; ++code) {
        for (int i = 0; i < 8; ++i) c[i] = static_cast<uint8_t>((i * 5 + 3) & 0xF);
        c[pos] = code;
        check(c);
      }
    for (int n = 0; n < 20000; ++n) {
      for (int i = 0; i < 8; ++i) c[i] = static_cast<uint8_t>(rng() & 0xF);
      check(c);
    }
  }
}

TEST(Formats, BlockCodecs_NonFiniteZeroAndPacking) {
  // A block with inf / NaN: the scale comes from the finite elements; inf saturates, NaN stays NaN.
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i) x[i] = 0.01f * static_cast<float>(i - 64);
  x[3] = kInf;
  x[4] = -kInf;
  x[5] = kNaN;
  std::vector<uint8_t> q(128);
  float scale = 0;
  fmt::quantize_fp8_1x128(x.data(), 128, q.data(), &scale, false);
  EXPECT_EQ(scale, fmt::fp8_block_scale(std::fabs(x[0]), false));  // x[0] = -0.64 is the finite amax
  EXPECT_EQ(q[3], 0x7E);
  EXPECT_EQ(q[4], 0xFE);
  EXPECT_EQ(q[5], 0x7F);
  EXPECT_EQ(q[0], 0xFE);  // the amax element lands on -448
  // A NaN element dequantises to the canonical NaN bits (the same on host and device).
  std::vector<float> fp8_back(128);
  fmt::dequantize_fp8_1x128(q.data(), &scale, 128, fp8_back.data());
  EXPECT_EQ(bits_of(fp8_back[5]), fmt::kCanonicalNaNBits);
  EXPECT_EQ(fp8_back[3], 448.f * scale);
  // An all-zero block: scale 1, codes 0 (negative zero keeps its sign).
  std::vector<float> zeros(128, 0.f);
  zeros[7] = -0.f;
  fmt::quantize_fp8_1x128(zeros.data(), 128, q.data(), &scale, true);
  EXPECT_EQ(scale, 1.f);
  EXPECT_EQ(q[0], 0x00);
  EXPECT_EQ(q[7], 0x80);
  uint8_t mx_scale = 0;
  fmt::quantize_mxfp8(zeros.data(), 32, q.data(), &mx_scale);
  EXPECT_EQ(mx_scale, 127);
  // nvfp4 packing: element 2i in the low nibble. Global 1, block amax 6 -> block scale 1.0 (0x38).
  const float v[16] = {0.5f, -6.f, 1.f, 1.5f, -2.f, 3.f, 4.f, -0.5f, 0.f, -0.f, 6.f, 2.5f, kNaN, kInf, -kInf, 0.26f};
  uint8_t packed[8], nv_scale = 0;
  fmt::quantize_nvfp4(v, 16, 1.f, packed, &nv_scale);
  EXPECT_EQ(nv_scale, 0x38);
  const uint8_t want[8] = {0xF1, 0x32, 0x5C, 0x96, 0x80, 0x47, 0x77, 0x1F};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[i], want[i]) << "byte " << i;
  float back[16];
  fmt::dequantize_nvfp4(packed, &nv_scale, 1.f, 16, back);
  EXPECT_EQ(back[1], -6.f);
  EXPECT_EQ(back[11], 2.f);  // 2.5 ties to 2
  // mxfp4 packing is nvfp4's: amax 6 -> code 127 + floor(log2 6) - 2 = 127 (X = 1), the same codes
  // for the first 16 elements; NaN -> +6, +-inf -> +-6.
  float v32[32] = {};
  std::copy(v, v + 16, v32);
  uint8_t mx_packed[16], mx_scale4 = 0;
  fmt::quantize_mxfp4(v32, 32, mx_packed, &mx_scale4);
  EXPECT_EQ(mx_scale4, 127);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(mx_packed[i], want[i]) << "mxfp4 byte " << i;
  for (int i = 8; i < 16; ++i) EXPECT_EQ(mx_packed[i], 0) << "mxfp4 byte " << i;
  float mx_back[32];
  fmt::dequantize_mxfp4(mx_packed, &mx_scale4, 32, mx_back);
  EXPECT_EQ(mx_back[1], -6.f);
  EXPECT_EQ(mx_back[12], 6.f);
  // An nvfp4 block far below the global amax whose scale encodes to 0 stores zeros.
  const float tiny[16] = {1e-9f, -1e-9f};
  fmt::quantize_nvfp4(tiny, 16, 1.f, packed, &nv_scale);
  EXPECT_EQ(nv_scale, 0);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[i], 0) << i;
}

}  // namespace
}  // namespace megamoe
