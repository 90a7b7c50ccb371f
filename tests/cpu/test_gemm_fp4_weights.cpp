// The grouped GEMM's mxfp4 weight layout (kernels/gemm/gemm_weights.h): every element read back through
// the register-fragment order and the word expansion (what the math warpgroup does) is the e4m3 code
// of fmt::mxfp4_to_fp8_128x128, under its block scale; every byte of a piece is written exactly once;
// a warp's fragment reads are 512 contiguous bytes. nvfp4 expanded to bf16 for the bf16 GEMM
// (expand_nvfp4_to_bf16, prepare_nvfp4_expert_bf16): exact for every code and scale, and the cpu
// backend's dequantisation bit for bit once the global scale (kept apart) is 1.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kernels/gemm/gemm_weights.h"
#include "megamoe/formats.h"
#include "megamoe/weights.h"

namespace megamoe::gemm {
namespace {

struct Mxfp4Stack {
  int64_t e, n, k;
  std::vector<uint8_t> packed, scales;
};

Mxfp4Stack random_stack(int64_t e, int64_t n, int64_t k, int binades, uint32_t seed) {
  Mxfp4Stack s{e, n, k, std::vector<uint8_t>(e * n * k / 2), std::vector<uint8_t>(e * n * k / 32)};
  std::mt19937 rng(seed);
  for (auto& b : s.packed) b = static_cast<uint8_t>(rng());
  for (auto& c : s.scales) c = static_cast<uint8_t>(110 + rng() % binades);
  return s;
}

void expect_layout_matches_expansion(const Mxfp4Stack& s) {
  Mxfp4GemmWeights w;
  prepare_mxfp4_for_gemm(s.packed.data(), s.scales.data(), s.e, s.n, s.k, &w);
  ASSERT_EQ(static_cast<int64_t>(w.slabs.size()), s.e * (s.k / 128) * (s.n / 64) * kFp4SlabBytes);
  int64_t diffs = 0, scale_diffs = 0;
  for (int64_t e = 0; e < s.e; ++e) {
    std::vector<uint8_t> q(s.n * s.k);
    std::vector<float> bs(s.n / 128 * (s.k / 128));
    fmt::mxfp4_to_fp8_128x128(&s.packed[e * s.n * s.k / 2], &s.scales[e * s.n * s.k / 32], s.n, s.k, q.data(),
                              bs.data());
    for (size_t i = 0; i < bs.size(); ++i) scale_diffs += bs[i] != w.block_scales[e * bs.size() + i];
    for (int64_t r = 0; r < s.n; ++r)
      for (int64_t c = 0; c < s.k; ++c) diffs += mxfp4_gemm_e4m3(w, e, r, c) != q[r * s.k + c];
  }
  EXPECT_EQ(diffs, 0);
  EXPECT_EQ(scale_diffs, 0);
}

// A device image read back as the GEMM reads it: the block scales first, the pieces from
// mxfp4_pieces_offset() on.
Mxfp4GemmWeights from_image(const std::vector<uint8_t>& image, int64_t e, int64_t n, int64_t k) {
  Mxfp4GemmWeights w;
  w.num_experts = e;
  w.n = n;
  w.k = k;
  w.block_scales.resize(e * (n / 128) * (k / 128));
  std::memcpy(w.block_scales.data(), image.data(), w.block_scales.size() * sizeof(float));
  w.slabs.assign(image.begin() + mxfp4_pieces_offset(e, n, k), image.end());
  return w;
}

// The layers' upload (prepare_mxfp4_expert_images): every w13 and w2 element of the images, read back
// through the fragment layout under its block scale, is the mxfp4 value of the element weights.h puts
// there (w13 row r at the SwiGLU-prepared row), within 15 binades exactly.
TEST(GemmFp4Weights, ExpertImagesHoldTheLayersWeightsInTheSwigluRowOrder) {
  const int64_t E = 2, H = 256, I = 128;
  const Mxfp4Stack w13 = random_stack(E, 2 * I, H, 12, 7u), w2 = random_stack(E, H, I, 12, 8u);
  std::vector<uint8_t> image13, image2;
  prepare_mxfp4_expert_images(w13.packed.data(), w13.scales.data(), w2.packed.data(), w2.scales.data(), E, H, I,
                              &image13, &image2);
  ASSERT_EQ(static_cast<int64_t>(image13.size()),
            mxfp4_pieces_offset(E, 2 * I, H) + E * (H / 128) * (2 * I / 64) * kFp4SlabBytes);
  int64_t checked = 0, diffs = 0;
  for (int which = 0; which < 2; ++which) {
    const Mxfp4Stack& s = which == 0 ? w13 : w2;
    const Mxfp4GemmWeights w = from_image(which == 0 ? image13 : image2, s.e, s.n, s.k);
    std::vector<float> v(s.n * s.k);
    for (int64_t e = 0; e < s.e; ++e) {
      fmt::dequantize_mxfp4(&s.packed[e * s.n * s.k / 2], &s.scales[e * s.n * s.k / 32], s.n * s.k, v.data());
      for (int64_t r = 0; r < s.n; ++r) {
        const int64_t row = which == 0 ? swiglu_prepared_row(r, I) : r;
        for (int64_t c = 0; c < s.k; ++c) {
          const float scale = w.block_scales[(e * (s.n / 128) + row / 128) * (s.k / 128) + c / 128];
          const float got = fmt::e4m3_to_float(mxfp4_gemm_e4m3(w, e, row, c)) * scale;
          diffs += got != v[r * s.k + c];
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, E * 2 * I * H + E * H * I);
  EXPECT_EQ(diffs, 0);
}

TEST(GemmFp4Weights, FragmentLayoutReadsBackTheExpansion_WithinFifteenBinades) {
  expect_layout_matches_expansion(random_stack(3, 256, 384, 15, 1u));
}

TEST(GemmFp4Weights, FragmentLayoutReadsBackTheExpansion_BeyondFifteenBinades) {
  expect_layout_matches_expansion(random_stack(2, 128, 256, 40, 2u));  // shifts clamp at kMxfp4MinShift
}

TEST(GemmFp4Weights, EveryCodeNibbleAndShiftByteOnce_WarpReadsContiguous) {
  Mxfp4GemmWeights w;
  w.num_experts = 2;
  w.n = 256;
  w.k = 256;
  std::set<std::pair<int64_t, int>> codes;  // (word, code index)
  std::set<int64_t> shifts;
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t r = 0; r < w.n; ++r)
      for (int64_t c = 0; c < w.k; ++c) {
        const Fp4ElementPlace p = mxfp4_gemm_place(w, e, r, c);
        EXPECT_TRUE(codes.insert({p.word_byte, p.code}).second) << e << " " << r << " " << c;
        EXPECT_EQ(p.word_byte % 4, 0);
        shifts.insert(p.shift_byte);
        const int64_t piece = p.word_byte / kFp4SlabBytes;
        EXPECT_EQ(p.shift_byte / kFp4SlabBytes, piece);
        EXPECT_LT(p.word_byte % kFp4SlabBytes, kFp4SlabCodeBytes);
        EXPECT_GE(p.shift_byte % kFp4SlabBytes, kFp4SlabCodeBytes);
      }
  const int64_t pieces = 2 * (w.k / 128) * (w.n / 64);
  EXPECT_EQ(static_cast<int64_t>(codes.size()), pieces * kFp4SlabCodeBytes * 2);  // 8 codes per 4-byte word
  EXPECT_EQ(static_cast<int64_t>(shifts.size()), pieces * 64 * 4);
  // Lane l of warp 0 reads bytes [16 l, 16 l + 16) of piece 0 (j = 0): row l/4 (and + 8), step 0..1.
  for (int lane = 0; lane < 32; ++lane) {
    const Fp4ElementPlace p = mxfp4_gemm_place(w, 0, lane / 4, 4 * (lane % 4));
    EXPECT_EQ(p.word_byte, 16 * lane) << lane;
  }
  // A tile's pieces of one K block are contiguous: rows 64..127 follow rows 0..63.
  EXPECT_EQ(mxfp4_gemm_place(w, 0, 64, 0).word_byte, kFp4SlabBytes);
  EXPECT_EQ(mxfp4_gemm_place(w, 0, 0, 128).word_byte, (w.n / 64) * kFp4SlabBytes);
}

// Every e2m1 code times every finite e4m3 scale code is a bf16 value: the expansion rounds nothing
// (the product has at most 6 significant bits and lies in [2^-10, 2688]).
TEST(GemmNvfp4Weights, EveryCodeTimesEveryScaleIsExactInBf16) {
  int64_t pairs = 0, inexact = 0;
  for (int scale = 0; scale < 256; ++scale) {
    if ((scale & 0x7F) == 0x7F) continue;  // e4m3's NaN codes
    for (int code = 0; code < 16; ++code) {
      const uint8_t packed = static_cast<uint8_t>(code | (code << 4)), sc = static_cast<uint8_t>(scale);
      uint16_t out[16];
      uint8_t row[8];
      std::memset(row, packed, sizeof(row));
      expand_nvfp4_to_bf16(row, &sc, 1, 1, 16, out);
      const float want = fmt::e2m1_to_float(static_cast<uint8_t>(code)) * fmt::e4m3_to_float(sc);
      for (uint16_t b : out) {
        const float got = fmt::bf16_to_float(b);
        inexact += std::memcmp(&got, &want, 4) != 0;  // bits: signed zeros too
      }
      ++pairs;
    }
  }
  EXPECT_EQ(pairs, 254 * 16);
  EXPECT_EQ(inexact, 0);
}

// The layers' upload (prepare_nvfp4_expert_bf16) on nvfp4 weights prepare_weights made (per-expert
// global scales != 1): every element at its GEMM row (w13 in the SwiGLU order) is the cpu backend's
// dequantised value (QuantizedTensor::dequantize) bit for bit with the global scale set to 1; times
// the global scale in fp32 (what the layer applies) it is within one fp32 rounding of it with the
// scale (the cpu backend rounds e4m3 scale x global scale first).
TEST(GemmNvfp4Weights, ExpertBf16ImagesAreTheCpuBackendsDequantisationWithoutTheGlobalScale) {
  const int64_t E = 3, H = 256, I = 128;
  MoeGeometry g;
  g.hidden = H, g.intermediate = I, g.num_experts = E, g.top_k = 2, g.ep_size = 1, g.max_tokens_per_rank = 8;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w13(E * 2 * I * H), w2(E * H * I);
  for (int64_t i = 0; i < static_cast<int64_t>(w13.size()); ++i) w13[i] = normal(rng) * std::ldexp(1.f, int(i / (2 * I * H)) - 3);
  for (int64_t i = 0; i < static_cast<int64_t>(w2.size()); ++i) w2[i] = normal(rng) * std::ldexp(1.f, int(i / (H * I)) + 2);
  MoeWeights src;
  src.w13 = TensorView(w13.data(), DType::kFloat32, {E, 2 * I, H});
  src.w2 = TensorView(w2.data(), DType::kFloat32, {E, H, I});
  MoeConfig c;
  c.weight_format = WeightFormat::kNvfp4;
  c.dispatch_format = DispatchFormat::kBf16;
  PreparedWeights pw;
  ASSERT_TRUE(prepare_weights(g, c, src, &pw).is_ok());
  std::vector<uint16_t> b13, b2;
  prepare_nvfp4_expert_bf16(pw.w13.data.data(), pw.w13.scales.data(), pw.w2.data.data(), pw.w2.scales.data(), E, H,
                            I, &b13, &b2);
  ASSERT_EQ(static_cast<int64_t>(b13.size()), E * 2 * I * H);
  ASSERT_EQ(static_cast<int64_t>(b2.size()), E * H * I);
  int64_t checked = 0, diffs = 0, scaled_off = 0, distinct_globals = 0;
  double worst_scaled = 0;
  for (int which = 0; which < 2; ++which) {
    const QuantizedTensor& q = which == 0 ? pw.w13 : pw.w2;
    const std::vector<uint16_t>& b = which == 0 ? b13 : b2;
    QuantizedTensor unit = q;
    for (float& s : unit.global_scales) s = 1.f;
    std::vector<float> with_g, without_g;
    q.dequantize(&with_g);
    unit.dequantize(&without_g);
    for (int64_t e = 0; e < E; ++e) {
      distinct_globals += q.global_scales[e] != 1.f;
      for (int64_t r = 0; r < q.rows; ++r) {
        const int64_t row = which == 0 ? swiglu_prepared_row(r, I) : r;
        for (int64_t col = 0; col < q.cols; ++col) {
          const int64_t at = (e * q.rows + r) * q.cols + col;
          const float got = fmt::bf16_to_float(b[(e * q.rows + row) * q.cols + col]);
          diffs += std::memcmp(&got, &without_g[at], 4) != 0;
          const float scaled = fmt::mul_rn(got, q.global_scales[e]), want = with_g[at];
          const double rel = want == 0.f ? std::fabs(scaled) : std::fabs(double(scaled) - want) / std::fabs(want);
          worst_scaled = std::max(worst_scaled, rel);
          scaled_off += rel > std::ldexp(1.0, -23);
          ++checked;
        }
      }
    }
  }
  std::printf("nvfp4 -> bf16: %lld elements, %lld differ from the dequantisation at global scale 1; times the "
              "global scale: worst relative difference %.3e\n",
              static_cast<long long>(checked), static_cast<long long>(diffs), worst_scaled);
  EXPECT_EQ(checked, E * 3 * H * I);
  EXPECT_EQ(distinct_globals, 2 * E) << "the case must exercise global scales other than 1";
  EXPECT_EQ(diffs, 0);
  EXPECT_EQ(scaled_off, 0);
}

// ---- nvfp4 in the pipeline (gemm_weights.h: the fragment layout of bf16 k16 steps) ----

// Every element read back through the layout and the word expansion (what the math warpgroup does:
// fmt::fp4_word_to_bf16x2_pow120 and one bf16 multiply by the scale's b << 4) is expand_nvfp4_to_bf16's
// bf16 bit for bit, for every scale code but NaN (negative scales, e4m3 subnormals and zero included).
TEST(GemmNvfp4Layout, ReadsBackTheBf16ExpansionForEveryScaleCode) {
  const int64_t E = 2, N = 128, K = 256;
  std::vector<uint8_t> packed(E * N * K / 2), scales(E * N * K / 16);
  std::mt19937 rng(5);
  for (auto& b : packed) b = static_cast<uint8_t>(rng());
  for (size_t i = 0; i < scales.size(); ++i) {
    uint8_t sc = static_cast<uint8_t>(i % 256);  // every code, then random ones
    if (i >= 256) sc = static_cast<uint8_t>(rng());
    if ((sc & 0x7Fu) == 0x7Fu) sc = 0x7Eu;
    scales[i] = sc;
  }
  const std::vector<float> g = {0.75f, 3.f};
  Nvfp4GemmWeights w;
  int64_t bad = -1;
  ASSERT_TRUE(prepare_nvfp4_for_gemm(packed.data(), scales.data(), g.data(), E, N, K, &w, &bad));
  ASSERT_EQ(static_cast<int64_t>(w.slabs.size()), E * (K / kNvfp4BlockK) * (N / 64) * kNvfp4SlabBytes);
  std::vector<uint16_t> want(E * N * K);
  expand_nvfp4_to_bf16(packed.data(), scales.data(), E, N, K, want.data());
  int64_t diffs = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < K; ++c) diffs += nvfp4_gemm_bf16(w, e, r, c) != want[(e * N + r) * K + c];
  EXPECT_EQ(diffs, 0);
  const std::vector<uint8_t> img = device_image(w);
  ASSERT_EQ(static_cast<int64_t>(img.size()), nvfp4_pieces_offset(E) + static_cast<int64_t>(w.slabs.size()));
  float g1 = 0;
  std::memcpy(&g1, img.data() + 4, 4);
  EXPECT_EQ(g1, 3.f);
}

// Every code nibble and scale byte of every piece is written (no magnitude nibble left 0, every scale
// byte the scale), and the layout still reads back the expansion.
TEST(GemmNvfp4Layout, EveryCodeAndScaleByteWritten) {
  const int64_t E = 1, N = 128, K = 128;
  std::vector<uint8_t> packed(E * N * K / 2, 0x11), scales(E * N * K / 16, 0x38);
  // code of element i: its index mod 7 + 1 (never 0), so a slot written twice or never shows
  for (int64_t i = 0; i < E * N * K; ++i) {
    const uint8_t code = static_cast<uint8_t>(i % 7 + 1);
    packed[i / 2] = static_cast<uint8_t>((packed[i / 2] & ((i & 1) ? 0x0Fu : 0xF0u)) | (code << ((i & 1) * 4)));
  }
  const float g = 1.f;
  Nvfp4GemmWeights w;
  int64_t bad = -1;
  ASSERT_TRUE(prepare_nvfp4_for_gemm(packed.data(), scales.data(), &g, E, N, K, &w, &bad));
  // no zero magnitude nibble anywhere: every nibble was written
  int64_t zero_nibbles = 0;
  for (int64_t pc = 0; pc < (K / kNvfp4BlockK) * (N / 64); ++pc)
    for (int64_t b = 0; b < kNvfp4SlabCodeBytes; b += 4) {
      uint32_t word = 0;
      std::memcpy(&word, w.slabs.data() + pc * kNvfp4SlabBytes + b, 4);
      for (int e = 0; e < 8; ++e) zero_nibbles += ((word >> (4 * e)) & 7u) == 0;
    }
  EXPECT_EQ(zero_nibbles, 0);
  for (int64_t pc = 0; pc < (K / kNvfp4BlockK) * (N / 64); ++pc)
    for (int64_t b = kNvfp4SlabCodeBytes; b < kNvfp4SlabBytes; ++b) EXPECT_EQ(w.slabs[pc * kNvfp4SlabBytes + b], 0x38);
  std::vector<uint16_t> want(E * N * K);
  expand_nvfp4_to_bf16(packed.data(), scales.data(), E, N, K, want.data());
  int64_t diffs = 0;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < K; ++c) diffs += nvfp4_gemm_bf16(w, 0, r, c) != want[r * K + c];
  EXPECT_EQ(diffs, 0);
}

// A NaN block scale is refused with its index (the GPU layout holds finite, sign-free scales).
TEST(GemmNvfp4Layout, NanScaleIsRefusedWithItsIndex) {
  std::vector<uint8_t> packed(64 * 128 / 2, 0x22), scales(64 * 128 / 16, 0x38);
  scales[37] = 0xFF;
  const float g = 1.f;
  Nvfp4GemmWeights w;
  int64_t bad = -1;
  EXPECT_FALSE(prepare_nvfp4_for_gemm(packed.data(), scales.data(), &g, 1, 64, 128, &w, &bad));
  EXPECT_EQ(bad, 37);
}

}  // namespace
}  // namespace megamoe::gemm
