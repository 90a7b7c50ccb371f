// The grouped GEMM with nvfp4 weights in the pipeline (GemmDtype::kNvfp4: e2m1 codes x e4m3 block scales
// expanded into bf16 wgmma register A fragments, kernels/gemm/gemm_weights.h's layout; bf16 tokens):
// - bit for bit the bf16 GEMM run on the host's bf16 expansion (gemm::expand_nvfp4_to_bf16, the routed
//   backend's prefill weights), 64-row bf16 tiles against the 16- and 32-row nvfp4 tiles, both layouts,
//   the bf16-row epilogue and the scaled bf16 SwiGLU (the global scale from the image against
//   b_expert_scale): the in-pipeline expansion is then exactly the bf16 path's operand, e4m3
//   subnormal and negative block scales included;
// - against float64 on the nvfp4 values (bf16 rows: no global scale, as the GEMM leaves it to the
//   caller), within the bound the bf16 GEMM meets (rel-L2 <= 1e-3 against the bf16-rounded reference);
// - every run the same bits (static and dynamic schedules, all SMs and 3 CTAs).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "megamoe/formats.h"

namespace {

using megamoe::gemm::GemmDtype;
using megamoe::gemm::GemmEpilogue;
using megamoe::gemm::GroupedGemmArgs;
using megamoe::gemm::GroupedLayout;
namespace fmt = megamoe::fmt;
namespace gemm = megamoe::gemm;

#define REQUIRE_SM90() MEGAMOE_REQUIRE_SM90_GPUS(1)

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)); }
  explicit DevBuf(const std::vector<T>& h) : DevBuf(h.size()) {
    cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

struct Nvfp4Case {
  std::string name;
  GroupedLayout layout;
  int N, K;
  std::vector<int> rows;  // per expert
  int block_m;            // 16 or 32
  bool swiglu;            // FC1 + the scaled bf16 SwiGLU (N = 2I, rows in the GEMM's order)
};
std::ostream& operator<<(std::ostream& os, const Nvfp4Case& c) { return os << c.name; }

struct Nvfp4Problem {
  int E = 0, N = 0, K = 0;
  GroupedLayout layout = GroupedLayout::kContiguous;
  int64_t m_rows = 0;
  std::vector<int32_t> offsets, counts;
  std::vector<uint16_t> a;            // bf16 [rows, K]
  std::vector<uint8_t> packed, scales;  // nvfp4 [E, N, K/2], [E, N, K/16] (GEMM row order)
  std::vector<float> global;          // [E]
  std::vector<uint16_t> b_bf16;       // expand_nvfp4_to_bf16 [E, N, K]
  int64_t a_rows() const { return layout == GroupedLayout::kMasked ? int64_t(E) * m_rows : m_rows; }
  void segment(int e, int64_t* begin, int64_t* rows) const {
    if (layout == GroupedLayout::kMasked) {
      *begin = int64_t(e) * m_rows;
      *rows = std::min<int64_t>(counts[e], m_rows);
    } else {
      *begin = offsets[e];
      *rows = offsets[e + 1] - offsets[e];
    }
  }
};

Nvfp4Problem make_problem(const Nvfp4Case& c, uint32_t seed) {
  Nvfp4Problem p;
  std::mt19937 rng(seed);
  p.E = int(c.rows.size());
  p.N = c.N;
  p.K = c.K;
  p.layout = c.layout;
  if (c.layout == GroupedLayout::kMasked) {
    p.counts.assign(c.rows.begin(), c.rows.end());
    p.m_rows = *std::max_element(c.rows.begin(), c.rows.end()) + 3;
  } else {
    p.offsets.assign(p.E + 1, 0);
    for (int e = 0; e < p.E; ++e) p.offsets[e + 1] = p.offsets[e] + c.rows[e];
    p.m_rows = p.offsets[p.E] + 5;
  }
  const int64_t rows = p.a_rows(), K = p.K, N = p.N;
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.05f, 4.f);
  p.a.resize(rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mag(rng);
    for (int64_t k = 0; k < K; ++k) p.a[r * K + k] = fmt::float_to_bf16(u(rng) * m);
  }
  p.packed.resize(size_t(p.E) * N * K / 2);
  p.scales.resize(size_t(p.E) * N * K / 16);
  for (auto& b : p.packed) b = uint8_t(rng());
  // Block scales: mostly codes of magnitude 2^-3 .. 2^3 (0x28 .. 0x57), every 7th an e4m3 subnormal
  // (0x01 .. 0x07), every 11th negative, a few zeros; no NaN.
  for (size_t i = 0; i < p.scales.size(); ++i) {
    uint8_t s = uint8_t(0x28 + rng() % 0x30);
    if (i % 7 == 3) s = uint8_t(1 + rng() % 7);
    if (i % 11 == 5) s |= 0x80u;
    if (i % 97 == 1) s = 0;
    p.scales[i] = s;
  }
  p.global.resize(p.E);
  for (int e = 0; e < p.E; ++e) p.global[e] = 0.37f * float(e + 1) + 0.01f;
  p.b_bf16.resize(size_t(p.E) * N * K);
  gemm::expand_nvfp4_to_bf16(p.packed.data(), p.scales.data(), p.E, N, K, p.b_bf16.data());
  return p;
}

struct RunOpts {
  GemmDtype dtype = GemmDtype::kNvfp4;
  int block_m = 16;
  int32_t* counter = nullptr;
  int num_sms = 0;
};

// One launch: kNvfp4 on the image, or kBf16 on the host expansion (64-row tiles), everything else equal.
std::vector<uint16_t> run(const Nvfp4Case& c, const Nvfp4Problem& p, const RunOpts& o, gemm::GemmTileConfig* used) {
  DevBuf<uint16_t> a(p.a);
  DevBuf<int32_t> offsets(p.offsets), counts(p.counts);
  gemm::Nvfp4GemmWeights w;
  int64_t bad = -1;
  EXPECT_TRUE(gemm::prepare_nvfp4_for_gemm(p.packed.data(), p.scales.data(), p.global.data(), p.E, p.N, p.K, &w, &bad));
  const bool nv = o.dtype == GemmDtype::kNvfp4;
  std::vector<uint8_t> bf16_bytes(p.b_bf16.size() * 2);
  std::memcpy(bf16_bytes.data(), p.b_bf16.data(), bf16_bytes.size());
  DevBuf<uint8_t> b(nv ? gemm::device_image(w) : bf16_bytes);
  DevBuf<float> g(p.global);
  const int64_t rows = p.a_rows(), out_cols = c.swiglu ? p.N / 2 : p.N;
  DevBuf<uint16_t> d(rows * out_cols);
  cudaMemset(d.p, 0xFF, d.n * 2);
  GroupedGemmArgs args;
  args.dtype = o.dtype;
  args.layout = c.layout;
  args.num_experts = p.E;
  args.n = p.N;
  args.k = p.K;
  args.a = a.p;
  args.m_rows = p.m_rows;
  args.expert_offsets = c.layout == GroupedLayout::kContiguous ? offsets.p : nullptr;
  args.masked_counts = c.layout == GroupedLayout::kMasked ? counts.p : nullptr;
  args.b = b.p;
  args.epilogue = c.swiglu ? GemmEpilogue::kSwigluBf16Scaled : GemmEpilogue::kStoreBf16;
  args.b_expert_scale = c.swiglu && !nv ? g.p : nullptr;
  args.d = d.p;
  args.tiles.block_m = o.block_m;
  args.tiles.block_n = 256;
  args.tiles.cluster = 1;
  args.tiles.num_sms = o.num_sms;
  args.tile_counter = o.counter;
  const megamoe::Status st = gemm::launch_grouped_gemm(args, nullptr, used);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d.get();
}

class Nvfp4Gemm : public ::testing::TestWithParam<Nvfp4Case> {};

TEST_P(Nvfp4Gemm, BitEqualToBf16OnTheExpansion_AndDeterministic) {
  REQUIRE_SM90();
  const Nvfp4Case& c = GetParam();
  const Nvfp4Problem p = make_problem(c, 555u + c.N + c.K);
  gemm::GemmTileConfig used_bf16, used;
  RunOpts ref;
  ref.dtype = GemmDtype::kBf16;
  ref.block_m = 64;
  const std::vector<uint16_t> want = run(c, p, ref, &used_bf16);
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  for (int r = 0; r < 3; ++r) {
    RunOpts o;
    o.block_m = c.block_m;
    o.counter = r == 1 ? counter.p : nullptr;
    o.num_sms = r == 2 ? 3 : 0;
    const std::vector<uint16_t> got = run(c, p, o, &used);
    EXPECT_EQ(used.block_m, c.block_m);
    EXPECT_EQ(used.fp4_math_wg, 2);
    if (r == 2) EXPECT_EQ(used.grid, 3);
    int64_t diffs = 0;
    for (size_t i = 0; i < got.size(); ++i) diffs += got[i] != want[i];
    std::printf("  [%s] run %d %s: %lld of %zu outputs differ from bf16 on the expansion (%s)\n", c.name.c_str(), r,
                used.to_string().c_str(), (long long)diffs, got.size(), used_bf16.to_string().c_str());
    EXPECT_EQ(diffs, 0);
  }
}

TEST_P(Nvfp4Gemm, MatchesFloat64OnTheNvfp4Values) {
  REQUIRE_SM90();
  const Nvfp4Case& c = GetParam();
  if (c.swiglu) GTEST_SKIP() << "the SwiGLU output is checked bit for bit against the bf16 path";
  const Nvfp4Problem p = make_problem(c, 919u + c.N + c.K);
  const int64_t rows = p.a_rows(), N = p.N, K = p.K;
  std::vector<double> ref(rows * N, std::nan(""));
  for (int e = 0; e < p.E; ++e) {
    int64_t b, n;
    p.segment(e, &b, &n);
    for (int64_t r = b; r < b + n; ++r)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t i = (int64_t(e) * N + j) * K + k;
          const uint8_t code = uint8_t((p.packed[i / 2] >> ((i & 1) * 4)) & 0xF);
          const double wv = double(fmt::e2m1_to_float(code)) * fmt::e4m3_to_float(p.scales[i / 16]);
          s += double(fmt::bf16_to_float(p.a[r * K + k])) * wv;
        }
        ref[r * N + j] = s;
      }
  }
  gemm::GemmTileConfig used;
  RunOpts o;
  o.block_m = c.block_m;
  const std::vector<uint16_t> got = run(c, p, o, &used);
  double num = 0, den = 0;
  int64_t outside = 0, poisoned_ok = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      ++outside;
      poisoned_ok += got[i] == 0xFFFF;
      continue;
    }
    const double gv = fmt::bf16_to_float(got[i]), rb = fmt::round_to_bf16(float(ref[i]));
    num += (gv - rb) * (gv - rb);
    den += ref[i] * ref[i];
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  std::printf("  [%s] %s rel_l2(vs bf16(float64 on nvfp4)) = %.3e\n", c.name.c_str(), used.to_string().c_str(), rel);
  EXPECT_LE(rel, 1e-3);
  EXPECT_EQ(poisoned_ok, outside) << "rows outside every segment were written";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Nvfp4Gemm,
    ::testing::Values(
        Nvfp4Case{"Masked_BM16_N512_K1024", GroupedLayout::kMasked, 512, 1024, {1, 16, 0, 9}, 16, false},
        Nvfp4Case{"Contiguous_BM16_N256_K2048_Uneven", GroupedLayout::kContiguous, 256, 2048, {7, 0, 40, 1}, 16, false},
        Nvfp4Case{"Masked_BM32_N768_K512", GroupedLayout::kMasked, 768, 512, {32, 3, 17}, 32, false},
        Nvfp4Case{"Contiguous_BM32_DeepSeekFc2Shape", GroupedLayout::kContiguous, 7168, 2048, {8, 8}, 32, false},
        Nvfp4Case{"Swiglu_Masked_BM16_I256_K1024", GroupedLayout::kMasked, 512, 1024, {3, 16, 0}, 16, true},
        Nvfp4Case{"Swiglu_Contiguous_BM32_I512_K768", GroupedLayout::kContiguous, 1024, 768, {20, 33, 1}, 32, true}),
    [](const ::testing::TestParamInfo<Nvfp4Case>& i) { return i.param.name; });

}  // namespace
