// The error model's bounds (src/reference/error_model.h) against the real codecs: the same-points
// bound through a quantised combine wire holds for two inputs that differ by the pre-wire bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "megamoe/formats.h"
#include "megamoe/workspace.h"
#include "reference/ep_protocol.h"
#include "reference/error_model.h"

namespace megamoe {
namespace {

// rel-L2 between wire(a) and wire(b), the wire applied row by row as the combine does.
double rel_l2_through_wire(int32_t format, const std::vector<float>& a, const std::vector<float>& b, int64_t hidden) {
  std::vector<uint8_t> wa(static_cast<size_t>(combine_row_bytes(format, hidden))), wb(wa.size());
  std::vector<float> da(static_cast<size_t>(hidden)), db(da.size());
  double num = 0, den = 0;
  for (size_t row = 0; row * hidden < a.size(); ++row) {
    reference::encode_combine_row(format, a.data() + row * hidden, hidden, wa.data());
    reference::encode_combine_row(format, b.data() + row * hidden, hidden, wb.data());
    reference::decode_combine_row(format, wa.data(), hidden, da.data());
    reference::decode_combine_row(format, wb.data(), hidden, db.data());
    for (int64_t i = 0; i < hidden; ++i) {
      num += (double(da[i]) - db[i]) * (double(da[i]) - db[i]);
      den += double(db[i]) * db[i];
    }
  }
  return std::sqrt(num / den);
}

struct WireCase {
  CombineDtype dtype;
  int32_t format;
  const char* name;
};

class SamePointsBound : public ::testing::TestWithParam<WireCase> {};

// Partials like FC2's (normal, per-row magnitudes over several binades); b = a perturbed so that
// rel_l2(a, b) is exactly the pre-wire bound, the worst case the bound allows upstream.
TEST_P(SamePointsBound, HoldsThroughTheWireForInputsAtThePreWireBound) {
  const WireCase& w = GetParam();
  const int64_t hidden = 2048, rows = 64;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> a(static_cast<size_t>(hidden * rows)), noise(a.size()), b(a.size());
  double norm_a = 0, norm_n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.f, static_cast<int>(rng() % 12) - 6);
    for (int64_t i = 0; i < hidden; ++i) a[r * hidden + i] = row_scale * normal(rng);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    noise[i] = std::fabs(a[i]) * normal(rng);  // relative perturbation, as accumulation differences are
    norm_a += double(a[i]) * a[i];
    norm_n += double(noise[i]) * noise[i];
  }
  const double scale = reference::kSamePointsRelL2 * std::sqrt(norm_a / norm_n);
  for (size_t i = 0; i < a.size(); ++i) b[i] = a[i] + static_cast<float>(scale * noise[i]);

  const reference::ErrorBound bound = reference::same_points_bound(w.dtype);
  const double measured = rel_l2_through_wire(w.format, a, b, hidden);
  std::printf("[error model] %s: rel-L2 through the wire %.3e for %.1e before it (bound %.3e: %s)\n", w.name, measured,
              reference::kSamePointsRelL2, bound.rel_l2, bound.derivation.c_str());
  EXPECT_LE(measured, bound.rel_l2);
  // The amplification is real: a quantised wire turns 5e-3 into more than twice as much.
  EXPECT_GT(measured, 2 * reference::kSamePointsRelL2);
}

INSTANTIATE_TEST_SUITE_P(Wires, SamePointsBound,
                         ::testing::Values(WireCase{CombineDtype::kMxfp8, kWsMxfp8, "mxfp8"},
                                           WireCase{CombineDtype::kNvfp4, kWsNvfp4, "nvfp4"}),
                         [](const ::testing::TestParamInfo<WireCase>& info) { return std::string(info.param.name); });

TEST(ErrorBound, RootSumSquareOfTheRoundingsTimesTwo) {
  MoeConfig c;  // fp8-block weights: fp8 intermediate, bf16 wire, bf16 output
  EXPECT_NEAR(reference::error_bound(c, 8).rel_l2, 2 * std::sqrt(2 * 0.00166 * 0.00166 + 0.0265 * 0.0265), 1e-12);
  c.combine_dtype = CombineDtype::kMxfp8;
  EXPECT_NEAR(reference::error_bound(c, 8).rel_l2, 2 * std::sqrt(0.00166 * 0.00166 + 0.0265 * 0.0265 + 0.032 * 0.032),
              1e-12);
  EXPECT_NE(reference::error_bound(c, 8).derivation.find("mxfp8 combine wire"), std::string::npos);
}

// One forward's bound: the pooled bound widened by 1 + 3 / sqrt(tokens); 4x at one token, within
// 10% of the pooled bound from 900 tokens, and a lost (token, slot) pair of a 64-token top-4 forward
// (rel-L2 about 1 / sqrt(256)) still far outside it.
TEST(ErrorBound, OneForwardWidensThePooledBoundByTokenCount) {
  for (CombineDtype w : {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {
    const double pooled = reference::same_points_bound(w).rel_l2;
    EXPECT_DOUBLE_EQ(reference::same_points_bound_one_forward(w, 1).rel_l2, 4 * pooled);
    EXPECT_DOUBLE_EQ(reference::same_points_bound_one_forward(w, 0).rel_l2, 4 * pooled);  // no rows: as one
    EXPECT_DOUBLE_EQ(reference::same_points_bound_one_forward(w, 900).rel_l2, 1.1 * pooled);
  }
  const reference::ErrorBound b = reference::same_points_bound_one_forward(CombineDtype::kBf16, 64);
  EXPECT_NEAR(b.rel_l2, 5e-3 * 1.375, 1e-15);
  EXPECT_LT(b.rel_l2, 1.0 / std::sqrt(64.0 * 4) / 8);
  EXPECT_NE(b.derivation.find("one forward of 64 token(s)"), std::string::npos) << b.derivation;
}

// The in-kernel reduce's order term: k partials added into a zeroed bf16 row in two different orders
// (one rounding per add, as the GPU's red.add and the cpu backend do) differ by less than the order
// term of in_kernel_reduce_bound_one_forward, and by more than a tenth of it (the term is not slack).
TEST(ErrorBound, InKernelReduceOrderTermCoversTwoAddOrders) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_real_distribution<float> w(0.05f, 1.f);
  for (int64_t k : {4, 8}) {
    const int64_t H = 4096;
    double diff = 0, ref = 0;
    for (int64_t t = 0; t < 64; ++t) {
      std::vector<std::vector<float>> part(k, std::vector<float>(H));
      for (auto& p : part) {
        const float scale = w(rng);  // routing weights of different sizes
        for (float& v : p) v = fmt::round_to_bf16(scale * n(rng));
      }
      for (int64_t c = 0; c < H; ++c) {
        float a = 0.f, b = 0.f;
        for (int64_t j = 0; j < k; ++j) a = fmt::bf16_to_float(fmt::float_to_bf16(a + part[j][c]));
        for (int64_t j = k - 1; j >= 0; --j) b = fmt::bf16_to_float(fmt::float_to_bf16(b + part[j][c]));
        diff += (double(a) - b) * (double(a) - b);
        ref += double(a) * a;
      }
    }
    const double measured = std::sqrt(diff / ref);
    const double same = reference::same_points_bound_one_forward(CombineDtype::kBf16, 1 << 20).rel_l2;
    const double full = reference::in_kernel_reduce_bound_one_forward(k, 1 << 20).rel_l2;
    const double order = std::sqrt(full * full - same * same);
    std::printf("[error model] top_k %lld: two add orders differ by %.3e (order term %.3e)\n",
                static_cast<long long>(k), measured, order);
    EXPECT_LE(measured, order);
    EXPECT_GE(measured, order / 10);
  }
}

}  // namespace
}  // namespace megamoe
