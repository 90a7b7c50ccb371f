// The grouped GEMM with mxfp4 weights (GemmDtype::kMxfp4: e2m1 codes expanded into wgmma's register A
// fragments, kernels/gemm/gemm_weights.h's layout):
// - bit for bit the fp8-block GEMM run on the expanded values (fmt::mxfp4_to_fp8_128x128: e4m3 codes
//   and the 128 x 128 block scales), same tiles, both layouts, 16-, 32- and 64-row tiles (64: swapped
//   here, two math warpgroups only; unswapped in the fp8-block path), the bf16-row and the SwiGLU + fp8
//   epilogues: the expansion and the fragment layout are then exactly the fp8 path's operands;
// - against float64 on the mxfp4 values themselves (the cpu backend's definition), within the bound
//   the fp8-block GEMM meets (rel-L2 <= 1e-3 against the bf16-rounded reference), also for a block
//   spanning more binades than e4m3 holds (those groups round: still within the bound);
// - every run the same bits (static and dynamic schedules, all SMs and 3 CTAs);
// each with one and with two math warpgroups per tile (GemmTileConfig::fp4_math_wg; test names end in
// _Wg1 / _Wg2), and the 16-row cases also at two CTAs per SM (GemmTileConfig::ctas_per_sm; _Wg2x2):
// all are bit for bit the fp8-block path, so also each other;
// - the device expansion of an image into fp8-block weights (gemm::launch_expand_mxfp4, the routed
//   backend's prefill path) bit for bit the host's, and fp8-block's 128-row tiles on it bit for bit
//   the mxfp4 GEMM's swapped tiles.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/mxfp4_expand.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "megamoe/formats.h"

namespace {

using megamoe::gemm::GemmDtype;
using megamoe::gemm::GemmEpilogue;
using megamoe::gemm::GroupedGemmArgs;
using megamoe::gemm::GroupedLayout;
namespace fmt = megamoe::fmt;
namespace gemm = megamoe::gemm;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)
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

struct Mxfp4Case {
  std::string name;
  GroupedLayout layout;
  int N, K;
  std::vector<int> rows;  // per expert
  int block_m;            // 16, 32 or 64 (64: two math warpgroups only)
  bool swiglu;            // FC1 + SwiGLU + fp8 (N = 2I, w13 reordered)
  int binades;            // scale codes per 128 x 128 block span this many (16+: some groups round)
};
std::ostream& operator<<(std::ostream& os, const Mxfp4Case& c) { return os << c.name; }

// Operands of one case: A e4m3 + 1x128 scales (M-major), the mxfp4 weights, and their expansion.
struct Mxfp4Problem {
  int E = 0, N = 0, K = 0;
  GroupedLayout layout = GroupedLayout::kContiguous;
  int64_t m_rows = 0, ld_sa = 0;
  std::vector<int32_t> offsets, counts;
  std::vector<uint8_t> a;
  std::vector<float> a_scales;
  std::vector<double> a_deq;
  std::vector<uint8_t> packed, scales;     // mxfp4 [E, N, K/2], [E, N, K/32], GEMM row order
  std::vector<uint8_t> fp8;                // expansion [E, N, K] e4m3
  std::vector<float> fp8_scales;           // [E, N/128, K/128]
  std::vector<double> b_deq;               // the mxfp4 values (cpu backend's definition)
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

Mxfp4Problem make_problem(const Mxfp4Case& c, uint32_t seed) {
  Mxfp4Problem p;
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
  const int64_t K = p.K, KB = K / 128, rows = p.a_rows(), N = p.N;
  p.ld_sa = (p.m_rows + 3) / 4 * 4;
  const int64_t nexp = c.layout == GroupedLayout::kMasked ? p.E : 1;
  p.a.assign(rows * K, 0);
  p.a_deq.assign(rows * K, 0);
  p.a_scales.assign(nexp * KB * p.ld_sa, 0.f);
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.05f, 4.f);
  std::vector<float> x(K), s(KB);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mag(rng);
    for (int64_t k = 0; k < K; ++k) x[k] = u(rng) * m;
    fmt::quantize_fp8_1x128(x.data(), K, &p.a[r * K], s.data(), false);
    const int64_t e = c.layout == GroupedLayout::kMasked ? r / p.m_rows : 0;
    const int64_t mm = c.layout == GroupedLayout::kMasked ? r % p.m_rows : r;
    for (int64_t kb = 0; kb < KB; ++kb) p.a_scales[(e * KB + kb) * p.ld_sa + mm] = s[kb];
    for (int64_t k = 0; k < K; ++k) p.a_deq[r * K + k] = double(fmt::e4m3_to_float(p.a[r * K + k])) * s[k / 128];
  }
  // Weights: random codes, scale codes 120 .. 120 + binades - 1 (the top one in every block, so
  // every block spans all of them).
  p.packed.resize(size_t(p.E) * N * K / 2);
  p.scales.resize(size_t(p.E) * N * K / 32);
  for (auto& b : p.packed) b = uint8_t(rng());
  for (auto& sc : p.scales) sc = uint8_t(120 + rng() % c.binades);
  for (int64_t i = 0; i < int64_t(p.scales.size()); i += 4 * (K / 128)) p.scales[i] = uint8_t(120 + c.binades - 1);
  p.fp8.resize(size_t(p.E) * N * K);
  p.fp8_scales.resize(size_t(p.E) * (N / 128) * KB);
  p.b_deq.resize(size_t(p.E) * N * K);
  std::vector<float> deq(size_t(N) * K);
  for (int e = 0; e < p.E; ++e) {
    fmt::mxfp4_to_fp8_128x128(&p.packed[size_t(e) * N * K / 2], &p.scales[size_t(e) * N * K / 32], N, K,
                              &p.fp8[size_t(e) * N * K], &p.fp8_scales[size_t(e) * (N / 128) * KB]);
    fmt::dequantize_mxfp4(&p.packed[size_t(e) * N * K / 2], &p.scales[size_t(e) * N * K / 32], N * K, deq.data());
    for (int64_t i = 0; i < N * K; ++i) p.b_deq[size_t(e) * N * K + i] = deq[i];
  }
  return p;
}

// float64 D = A * B^T on the mxfp4 values, rows of every segment (others NaN).
std::vector<double> reference(const Mxfp4Problem& p) {
  const int64_t rows = p.a_rows(), N = p.N, K = p.K;
  std::vector<double> ref(rows * N, std::nan(""));
  for (int e = 0; e < p.E; ++e) {
    int64_t b, n;
    p.segment(e, &b, &n);
    for (int64_t r = b; r < b + n; ++r)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += p.a_deq[r * K + k] * p.b_deq[(int64_t(e) * N + j) * K + k];
        ref[r * N + j] = s;
      }
  }
  return ref;
}

// The weights in the GEMM's row order: SwiGLU w13 reordered (packed rows, scale rows, expansion too).
void reorder_for_swiglu(Mxfp4Problem* p) {
  const int64_t I = p->N / 2, K = p->K;
  auto reorder = [&](std::vector<uint8_t>* v, int64_t row_bytes) {
    std::vector<uint8_t> out(v->size());
    gemm::prepare_w13_for_swiglu(v->data(), p->E, I, row_bytes, 1, out.data());
    *v = out;
  };
  reorder(&p->packed, K / 2);
  reorder(&p->scales, K / 32);
  reorder(&p->fp8, K);
  std::vector<float> s(p->fp8_scales.size());
  gemm::prepare_w13_scales_for_swiglu(p->fp8_scales.data(), p->E, I, K, s.data());
  p->fp8_scales = s;
}

struct Outputs {
  std::vector<uint8_t> d;       // bf16 rows (2 B each) or e4m3 rows
  std::vector<float> d_scales;  // SwiGLU
};

// The mxfp4 launch's tiles: math warpgroups per tile and CTAs per SM (the fp8-block launch ignores them).
struct Fp4Tiles {
  int math_wg = 0;
  int ctas_per_sm = 0;
};

// One launch with `dtype` (kMxfp4: the mxfp4 image; kFp8Block: the expansion), everything else equal.
Outputs run(const Mxfp4Case& c, const Mxfp4Problem& p, GemmDtype dtype, Fp4Tiles fp4, int32_t* counter,
            int num_sms, gemm::GemmTileConfig* used) {
  DevBuf<uint8_t> a(p.a);
  DevBuf<float> sa(p.a_scales);
  DevBuf<int32_t> offsets(p.offsets), counts(p.counts);
  gemm::Mxfp4GemmWeights w;
  gemm::prepare_mxfp4_for_gemm(p.packed.data(), p.scales.data(), p.E, p.N, p.K, &w);
  DevBuf<uint8_t> b(dtype == GemmDtype::kMxfp4 ? gemm::device_image(w) : p.fp8);
  DevBuf<float> sb(p.fp8_scales);
  const int64_t rows = p.a_rows();
  const int64_t out_cols = c.swiglu ? p.N / 2 : p.N;
  const int64_t out_bytes = c.swiglu ? 1 : 2;
  DevBuf<uint8_t> d(rows * out_cols * out_bytes);
  const int64_t ld_sd = (p.m_rows + 3) / 4 * 4;
  const int64_t nexp = c.layout == GroupedLayout::kMasked ? p.E : 1;
  DevBuf<float> sd(nexp * (p.N / 256) * ld_sd);
  cudaMemset(d.p, c.swiglu ? 0x7F : 0xFF, d.n);
  cudaMemset(sd.p, 0xFF, sd.n * 4);
  GroupedGemmArgs g;
  g.dtype = dtype;
  g.layout = c.layout;
  g.num_experts = p.E;
  g.n = p.N;
  g.k = p.K;
  g.a = a.p;
  g.m_rows = p.m_rows;
  g.a_scales = sa.p;
  g.ld_a_scales = p.ld_sa;
  g.expert_offsets = c.layout == GroupedLayout::kContiguous ? offsets.p : nullptr;
  g.masked_counts = c.layout == GroupedLayout::kMasked ? counts.p : nullptr;
  g.b = b.p;
  g.b_scales = dtype == GemmDtype::kMxfp4 ? nullptr : sb.p;
  g.epilogue = c.swiglu ? GemmEpilogue::kSwigluFp8 : GemmEpilogue::kStoreBf16;
  g.d = d.p;
  g.d_scales = c.swiglu ? sd.p : nullptr;
  g.ld_d_scales = ld_sd;
  g.tiles.block_m = c.block_m;
  g.tiles.block_n = 256;
  g.tiles.cluster = 1;
  g.tiles.num_sms = num_sms;
  g.tiles.fp4_math_wg = dtype == GemmDtype::kMxfp4 ? fp4.math_wg : 0;
  g.tiles.ctas_per_sm = dtype == GemmDtype::kMxfp4 ? fp4.ctas_per_sm : 0;
  g.tile_counter = counter;
  const megamoe::Status st = gemm::launch_grouped_gemm(g, nullptr, used);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Outputs o;
  o.d = d.get();
  if (c.swiglu) o.d_scales = sd.get();
  return o;
}

// (case, math warpgroups per tile, CTAs per SM)
class Mxfp4Gemm : public ::testing::TestWithParam<std::tuple<Mxfp4Case, int, int>> {};

TEST_P(Mxfp4Gemm, BitEqualToFp8BlockOnTheExpansion_AndDeterministic) {
  REQUIRE_SM90();
  const Mxfp4Case& c = std::get<0>(GetParam());
  const int wg = std::get<1>(GetParam()), cps = std::get<2>(GetParam());
  Mxfp4Problem p = make_problem(c, 777u + c.N + c.K);
  if (c.swiglu) reorder_for_swiglu(&p);
  gemm::GemmTileConfig used_fp8, used;
  const Outputs want = run(c, p, GemmDtype::kFp8Block, Fp4Tiles{}, nullptr, 0, &used_fp8);
  EXPECT_EQ(used_fp8.fp4_math_wg, 0);
  EXPECT_EQ(used_fp8.ctas_per_sm, 0);
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  for (int r = 0; r < 3; ++r) {
    const Outputs got =
        run(c, p, GemmDtype::kMxfp4, Fp4Tiles{wg, cps}, r == 1 ? counter.p : nullptr, r == 2 ? 3 : 0, &used);
    EXPECT_EQ(used.block_m, used_fp8.block_m);
    EXPECT_EQ(used.fp4_math_wg, wg);
    EXPECT_EQ(used.ctas_per_sm, cps);
    if (r == 2) {
      EXPECT_EQ(used.grid, 3 * cps);  // 3 SMs
    }
    int64_t diffs = 0;
    for (size_t i = 0; i < got.d.size(); ++i) diffs += got.d[i] != want.d[i];
    std::printf("  [%s] run %d %s: %lld of %zu output bytes differ from fp8-block on the expansion\n", c.name.c_str(), r,
                used.to_string().c_str(), (long long)diffs, got.d.size());
    EXPECT_EQ(diffs, 0);
    EXPECT_EQ(0, std::memcmp(got.d_scales.data(), want.d_scales.data(), got.d_scales.size() * 4));
  }
}

TEST_P(Mxfp4Gemm, MatchesFloat64OnTheMxfp4Values) {
  REQUIRE_SM90();
  const Mxfp4Case& c = std::get<0>(GetParam());
  const int wg = std::get<1>(GetParam()), cps = std::get<2>(GetParam());
  if (c.swiglu) GTEST_SKIP() << "the SwiGLU output is checked bit for bit against the fp8-block path";
  const Mxfp4Problem p = make_problem(c, 999u + c.N + c.K);
  const std::vector<double> ref = reference(p);
  gemm::GemmTileConfig used;
  const Outputs o = run(c, p, GemmDtype::kMxfp4, Fp4Tiles{wg, cps}, nullptr, 0, &used);
  EXPECT_EQ(used.fp4_math_wg, wg);
  EXPECT_EQ(used.ctas_per_sm, cps);
  double num = 0, den = 0;
  int64_t poisoned_ok = 0, outside = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &o.d[2 * i], 2);
    if (std::isnan(ref[i])) {
      ++outside;
      poisoned_ok += h == 0xFFFF;
      continue;
    }
    const double g = fmt::bf16_to_float(h), rb = fmt::round_to_bf16(float(ref[i]));
    num += (g - rb) * (g - rb);
    den += ref[i] * ref[i];
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  std::printf("  [%s] %s rel_l2(vs bf16(float64 on mxfp4)) = %.3e\n", c.name.c_str(), used.to_string().c_str(), rel);
  EXPECT_LE(rel, 1e-3);
  EXPECT_EQ(poisoned_ok, outside) << "rows outside every segment were written";
}

// Every case with one and with two math warpgroups per tile, but the 64-row ones (two only); the 16-row
// ones also with two at two CTAs per SM.
std::vector<std::tuple<Mxfp4Case, int, int>> gemm_cases() {
  const Mxfp4Case cases[] = {
      Mxfp4Case{"Masked_BM16_N512_K1024", GroupedLayout::kMasked, 512, 1024, {1, 16, 0, 9}, 16, false, 15},
      Mxfp4Case{"Masked_BM32_N768_K512", GroupedLayout::kMasked, 768, 512, {32, 3, 17}, 32, false, 6},
      Mxfp4Case{"Contiguous_BM16_N256_K2048_Uneven", GroupedLayout::kContiguous, 256, 2048, {7, 0, 40, 1}, 16, false,
                15},
      Mxfp4Case{"Contiguous_BM32_DeepSeekFc2Shape", GroupedLayout::kContiguous, 7168, 2048, {8, 8}, 32, false, 4},
      Mxfp4Case{"Masked_BM16_24Binades", GroupedLayout::kMasked, 256, 512, {5, 12}, 16, false, 24},
      Mxfp4Case{"Swiglu_Masked_BM16_I256_K1024", GroupedLayout::kMasked, 512, 1024, {3, 16, 0}, 16, true, 15},
      Mxfp4Case{"Swiglu_Contiguous_BM32_I512_K768", GroupedLayout::kContiguous, 1024, 768, {20, 33, 1}, 32, true, 8},
      Mxfp4Case{"Masked_BM64_N512_K1024", GroupedLayout::kMasked, 512, 1024, {64, 37, 0, 90}, 64, false, 6},
      Mxfp4Case{"Contiguous_BM64_DeepSeekFc2Shape", GroupedLayout::kContiguous, 7168, 2048, {100, 64, 1}, 64, false,
                4},
      Mxfp4Case{"Swiglu_Contiguous_BM64_I512_K768", GroupedLayout::kContiguous, 1024, 768, {70, 33, 128}, 64, true,
                8}};
  std::vector<std::tuple<Mxfp4Case, int, int>> out;
  for (const Mxfp4Case& c : cases) {
    for (int wg : {1, 2})
      if (c.block_m != 64 || wg == 2) out.emplace_back(c, wg, 1);
    if (c.block_m == 16) out.emplace_back(c, 2, 2);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, Mxfp4Gemm, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<std::tuple<Mxfp4Case, int, int>>& i) {
                           return std::get<0>(i.param).name + "_Wg" + std::to_string(std::get<1>(i.param)) +
                                  (std::get<2>(i.param) == 2 ? "x2" : "");
                         });

// gemm::launch_expand_mxfp4: the e4m3 codes of fmt::mxfp4_to_fp8_128x128 bit for bit (blocks within
// e4m3's binades and blocks beyond them, whose groups round), the block scales the image's first
// region; experts with no rows skipped (their bytes untouched); 3 CTAs striding over every piece the
// same as a full grid; no offsets: every expert; a chunk of experts into its own buffer.
TEST(Mxfp4Expand, DeviceExpansionIsTheHostsBitForBit) {
  REQUIRE_SM90();
  for (int binades : {4, 24}) {
    const Mxfp4Case c{"expand", GroupedLayout::kContiguous, 512, 1024, {5, 0, 7}, 32, false, binades};
    const Mxfp4Problem p = make_problem(c, 4242u + binades);
    gemm::Mxfp4GemmWeights w;
    gemm::prepare_mxfp4_for_gemm(p.packed.data(), p.scales.data(), p.E, p.N, p.K, &w);
    const std::vector<uint8_t> img = gemm::device_image(w);
    ASSERT_EQ(0, std::memcmp(gemm::mxfp4_image_block_scales(img.data()), p.fp8_scales.data(),
                             p.fp8_scales.size() * sizeof(float)));
    DevBuf<uint8_t> image(img);
    DevBuf<int32_t> offsets(p.offsets);
    const size_t per_expert = size_t(p.N) * p.K;
    // variants: offsets + full grid, offsets + 3 CTAs, no offsets, experts [1, 3) only (a chunk)
    for (int variant = 0; variant < 4; ++variant) {
      const int first = variant == 3 ? 1 : 0, count = variant == 3 ? 2 : p.E;
      DevBuf<uint8_t> out(per_expert * count);
      CUDA_OK(cudaMemset(out.p, 0xA5, out.n));
      const cudaError_t launched =
          gemm::launch_expand_mxfp4(image.p, p.E, p.N, p.K, first, count, variant == 2 ? nullptr : offsets.p, out.p,
                                    variant == 1 ? 3 : 0, nullptr);
      CUDA_OK(launched);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = out.get();
      for (int i = 0; i < count; ++i) {
        const int e = first + i;
        const bool skipped = variant != 2 && p.offsets[e + 1] == p.offsets[e];
        int64_t diffs = 0;
        for (size_t j = 0; j < per_expert; ++j)
          diffs += got[i * per_expert + j] != (skipped ? uint8_t(0xA5) : p.fp8[e * per_expert + j]);
        EXPECT_EQ(diffs, 0) << "binades " << binades << " variant " << variant << " expert " << e
                            << (skipped ? " (no rows: must stay untouched)" : "");
      }
    }
    // A range past the image is refused, nothing launched.
    EXPECT_EQ(gemm::launch_expand_mxfp4(image.p, p.E, p.N, p.K, 2, 2, offsets.p, nullptr, 0, nullptr),
              cudaErrorInvalidValue);
  }
}

// fp8-block's 128-row tiles on the expansion (what the routed backend runs at prefill) against the
// mxfp4 GEMM's swapped 32- and 64-row tiles: the same bits, bf16 rows and SwiGLU + fp8.
TEST(Mxfp4Expand, Fp8BlockTilesOnTheExpansionEqualTheMxfp4Gemm) {
  REQUIRE_SM90();
  for (bool swiglu : {false, true}) {
    Mxfp4Case c{swiglu ? "expand_swiglu" : "expand_rows", GroupedLayout::kContiguous, 1024, 768, {300, 0, 170, 1},
                128, swiglu, 8};
    Mxfp4Problem p = make_problem(c, 5151u + swiglu);
    if (swiglu) reorder_for_swiglu(&p);
    gemm::GemmTileConfig used_fp8, used;
    const Outputs want = run(c, p, GemmDtype::kFp8Block, Fp4Tiles{}, nullptr, 0, &used_fp8);
    EXPECT_EQ(used_fp8.block_m, 128);
    for (int bm : {32, 64}) {
      Mxfp4Case m = c;
      m.block_m = bm;
      const Outputs got = run(m, p, GemmDtype::kMxfp4, Fp4Tiles{2, 0}, nullptr, 0, &used);
      EXPECT_EQ(used.block_m, bm);
      int64_t diffs = 0;
      for (size_t i = 0; i < got.d.size(); ++i) diffs += got.d[i] != want.d[i];
      std::printf("  [%s] fp8-block %s vs mxfp4 %s: %lld of %zu output bytes differ\n", c.name.c_str(),
                  used_fp8.to_string().c_str(), used.to_string().c_str(), (long long)diffs, got.d.size());
      EXPECT_EQ(diffs, 0);
      EXPECT_EQ(0, std::memcmp(got.d_scales.data(), want.d_scales.data(), got.d_scales.size() * 4));
    }
  }
}

}  // namespace
