// Grouped GEMM (src/kernels/gemm) against a float64 CPU GEMM on the same quantised inputs.
// Every case poisons D before the run, checks the stored rows by relative L2 error and that rows
// outside every segment stay poisoned, and runs four times (static and dynamic tile schedules, on every
// SM and on 3 CTAs) to check every run gives the same bits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
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

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

#define REQUIRE_SM90() MEGAMOE_REQUIRE_SM90_GPUS(1)

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) { cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)); }
  DevBuf(const std::vector<T>& h) : DevBuf(h.size()) {
    cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DevBuf() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

// Random fp32 values with a per-row magnitude so rows get different scales.
void random_rows(std::mt19937& rng, int64_t rows, int64_t cols, std::vector<float>* out) {
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.05f, 4.f);
  out->resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mag(rng);
    for (int64_t c = 0; c < cols; ++c) (*out)[r * cols + c] = u(rng) * m;
  }
}

// One problem: activations A (fp8 1x128 or bf16), weights B [E, N, K], row segments per expert.
struct Problem {
  GemmDtype dtype = GemmDtype::kFp8Block;
  GroupedLayout layout = GroupedLayout::kContiguous;
  int E = 0, N = 0, K = 0;
  int64_t m_rows = 0;                  // contiguous rows / masked max_m
  std::vector<int32_t> offsets;        // contiguous [E+1]
  std::vector<int32_t> counts;         // masked [E]
  std::vector<uint8_t> a;              // [a_rows, K * eb]
  std::vector<float> a_scales;         // fp8: M-major, ld = ld_sa
  int64_t ld_sa = 0;
  std::vector<uint8_t> b;              // [E, N, K * eb]
  std::vector<float> b_scales;         // [E, N/128, K/128]
  std::vector<double> a_deq, b_deq;    // exact dequantised values (double)
  bool pow2 = false;
  // Small-integer e4m3 codes with random fp32 block scales: every 128-long K block sums exactly in
  // the tensor core, so the GEMM matches float64 to fp32 rounding (what the epilogue test needs;
  // with random data the fp8 MMA's internal accumulation differs from float64 by more than an e4m3
  // step on small elements).
  bool exact = false;

  int64_t a_rows() const { return layout == GroupedLayout::kMasked ? int64_t(E) * m_rows : m_rows; }
  // Rows of expert e as A row indices.
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

// Codes of integers in [-4, 4] and fp32 scales (2^[-3, 3] for pow2, else [0.25, 4)) for exact problems.
void exact_codes(std::mt19937& rng, int64_t n, uint8_t* q) {
  std::uniform_int_distribution<int> d(-4, 4);
  for (int64_t i = 0; i < n; ++i) q[i] = fmt::float_to_e4m3(float(d(rng)));
}
float exact_scale(std::mt19937& rng, bool pow2) {
  if (pow2) return std::ldexp(1.f, int(rng() % 7) - 3);
  return std::uniform_real_distribution<float>(0.25f, 4.f)(rng);
}

void build_problem(Problem* p, uint32_t seed) {
  std::mt19937 rng(seed);
  const bool fp8 = p->dtype == GemmDtype::kFp8Block;
  const int64_t eb = fp8 ? 1 : 2, K = p->K, KB = K / 128, rows = p->a_rows();
  std::vector<float> x;
  random_rows(rng, rows, K, &x);
  p->a.assign(rows * K * eb, 0);
  p->a_deq.assign(rows * K, 0.0);
  p->ld_sa = (p->m_rows + 3) / 4 * 4;
  if (fp8) {
    const int64_t nexp = p->layout == GroupedLayout::kMasked ? p->E : 1;
    p->a_scales.assign(nexp * KB * p->ld_sa, 0.f);
    std::vector<float> s(KB);
    for (int64_t r = 0; r < rows; ++r) {
      if (p->exact) {
        exact_codes(rng, K, &p->a[r * K]);
        for (int64_t kb = 0; kb < KB; ++kb) s[kb] = exact_scale(rng, p->pow2);
      } else {
        fmt::quantize_fp8_1x128(&x[r * K], K, &p->a[r * K], s.data(), p->pow2);
      }
      const int64_t e = p->layout == GroupedLayout::kMasked ? r / p->m_rows : 0;
      const int64_t m = p->layout == GroupedLayout::kMasked ? r % p->m_rows : r;
      for (int64_t kb = 0; kb < KB; ++kb) p->a_scales[(e * KB + kb) * p->ld_sa + m] = s[kb];
      for (int64_t k = 0; k < K; ++k) p->a_deq[r * K + k] = double(fmt::e4m3_to_float(p->a[r * K + k])) * s[k / 128];
    }
  } else {
    for (int64_t i = 0; i < rows * K; ++i) {
      const uint16_t h = fmt::float_to_bf16(x[i]);
      std::memcpy(&p->a[i * 2], &h, 2);
      p->a_deq[i] = fmt::bf16_to_float(h);
    }
  }
  const int64_t N = p->N;
  std::vector<float> w;
  random_rows(rng, int64_t(p->E) * N, K, &w);
  p->b.assign(int64_t(p->E) * N * K * eb, 0);
  p->b_deq.assign(int64_t(p->E) * N * K, 0.0);
  if (fp8) {
    p->b_scales.assign(int64_t(p->E) * (N / 128) * KB, 0.f);
    for (int e = 0; e < p->E; ++e) {
      if (p->exact) {
        exact_codes(rng, N * K, &p->b[int64_t(e) * N * K]);
        for (int64_t i = 0; i < (N / 128) * KB; ++i) p->b_scales[int64_t(e) * (N / 128) * KB + i] = exact_scale(rng, p->pow2);
      } else {
        fmt::quantize_fp8_128x128(&w[int64_t(e) * N * K], N, K, &p->b[int64_t(e) * N * K],
                                  &p->b_scales[int64_t(e) * (N / 128) * KB], p->pow2);
      }
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t i = (int64_t(e) * N + n) * K + k;
          p->b_deq[i] = double(fmt::e4m3_to_float(p->b[i])) * p->b_scales[(int64_t(e) * (N / 128) + n / 128) * KB + k / 128];
        }
    }
  } else {
    for (int64_t i = 0; i < int64_t(p->E) * N * K; ++i) {
      const uint16_t h = fmt::float_to_bf16(w[i]);
      std::memcpy(&p->b[i * 2], &h, 2);
      p->b_deq[i] = fmt::bf16_to_float(h);
    }
  }
}

// ref[r, n] for every row of every segment (other rows stay NaN), float64.
std::vector<double> reference(const Problem& p) {
  const int64_t rows = p.a_rows(), N = p.N, K = p.K;
  std::vector<double> ref(rows * N, std::nan(""));
  std::vector<std::pair<int64_t, int>> work;  // (row, expert)
  for (int e = 0; e < p.E; ++e) {
    int64_t b, n;
    p.segment(e, &b, &n);
    for (int64_t r = b; r < b + n; ++r) work.push_back({r, e});
  }
  const int nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> ts;
  for (int t = 0; t < nt; ++t)
    ts.emplace_back([&, t] {
      for (size_t w = t; w < work.size(); w += nt) {
        const int64_t r = work[w].first;
        const int e = work[w].second;
        const double* a = &p.a_deq[r * K];
        for (int64_t n = 0; n < N; ++n) {
          const double* b = &p.b_deq[(int64_t(e) * N + n) * K];
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
          ref[r * N + n] = s;
        }
      }
    });
  for (auto& t : ts) t.join();
  return ref;
}

float bf16_at(const std::vector<uint16_t>& d, int64_t i) { return fmt::bf16_to_float(d[i]); }

struct GemmCase {
  std::string name;
  GemmDtype dtype;
  GroupedLayout layout;
  int N, K;
  std::vector<int> rows;  // per expert
  int block_m, block_n;   // 0 = heuristic
  bool pad_to_128;        // contiguous: segments padded to 128 rows (as dispatch writes them)
  bool pow2;
  int cluster = 0;        // CTAs per cluster (0 = heuristic)
  int max_m = 0;          // masked: rows per expert in A (0 = the most rows + 3)
};

std::ostream& operator<<(std::ostream& os, const GemmCase& c) { return os << c.name; }

void make_segments(const GemmCase& c, Problem* p) {
  p->E = int(c.rows.size());
  if (c.layout == GroupedLayout::kMasked) {
    p->counts.assign(c.rows.begin(), c.rows.end());
    p->m_rows = c.max_m > 0 ? c.max_m : std::max(1, *std::max_element(c.rows.begin(), c.rows.end()) + 3);
  } else {
    p->offsets.assign(p->E + 1, 0);
    for (int e = 0; e < p->E; ++e) {
      const int n = c.pad_to_128 ? (c.rows[e] + 127) / 128 * 128 : c.rows[e];
      p->offsets[e + 1] = p->offsets[e] + n;
    }
    p->m_rows = p->offsets[p->E] + 5;  // rows past the last segment: never stored
  }
}

// The Problem of case c (dtype, layout, N, K, scale kind, segments), its inputs drawn from `seed`.
Problem case_problem(const GemmCase& c, uint32_t seed) {
  Problem p;
  p.dtype = c.dtype;
  p.layout = c.layout;
  p.N = c.N;
  p.K = c.K;
  p.pow2 = c.pow2;
  make_segments(c, &p);
  build_problem(&p, seed);
  return p;
}

// A Problem's operands on the device and the arguments every GEMM test sets from them (epilogue,
// outputs and tiles are the test's). b_host / b_scales_host: the weights as launched (the SwiGLU test
// passes the prepared w13).
struct DeviceProblem {
  const Problem& p;
  DevBuf<uint8_t> a, b;
  DevBuf<float> a_scales, b_scales;
  DevBuf<int32_t> offsets, counts;
  DeviceProblem(const Problem& p, const std::vector<uint8_t>& b_host, const std::vector<float>& b_scales_host)
      : p(p), a(p.a), b(b_host), a_scales(p.a_scales), b_scales(b_scales_host), offsets(p.offsets), counts(p.counts) {}
  explicit DeviceProblem(const Problem& p) : DeviceProblem(p, p.b, p.b_scales) {}
  GroupedGemmArgs args() const {
    const bool fp8 = p.dtype == GemmDtype::kFp8Block;
    GroupedGemmArgs g;
    g.dtype = p.dtype;
    g.layout = p.layout;
    g.num_experts = p.E;
    g.n = p.N;
    g.k = p.K;
    g.a = a.p;
    g.m_rows = p.m_rows;
    g.a_scales = fp8 ? a_scales.p : nullptr;
    g.ld_a_scales = p.ld_sa;
    g.expert_offsets = p.layout == GroupedLayout::kContiguous ? offsets.p : nullptr;
    g.masked_counts = p.layout == GroupedLayout::kMasked ? counts.p : nullptr;
    g.b = b.p;
    g.b_scales = fp8 ? b_scales.p : nullptr;
    return g;
  }
};

class GroupedGemmStore : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GroupedGemmStore, MatchesFloat64Reference) {
  REQUIRE_SM90();
  const GemmCase& c = GetParam();
  const Problem p = case_problem(c, 1234u + c.N + c.K);
  const std::vector<double> ref = reference(p);

  const DeviceProblem dev(p);
  const int64_t rows = p.a_rows();
  DevBuf<uint16_t> dd(rows * p.N);

  GroupedGemmArgs args = dev.args();
  args.epilogue = GemmEpilogue::kStoreBf16;
  args.d = dd.p;
  args.tiles.block_m = c.block_m;
  args.tiles.block_n = c.block_n;
  args.tiles.cluster = c.cluster;

  // Runs: static round-robin on every SM, the dynamic tile counter on every SM, then both on 3 CTAs
  // (many tiles per CTA: the tile-id hand-over through the ring and the counter's reset between
  // launches). Every run must give the same bits.
  DevBuf<int32_t> counter(std::vector<int32_t>{0, 0});
  std::vector<uint16_t> first;
  for (int run = 0; run < 4; ++run) {
    args.tile_counter = run == 1 || run == 2 ? counter.p : nullptr;
    args.tiles.num_sms = run >= 2 ? 3 : 0;
    CUDA_OK(cudaMemset(dd.p, 0xFF, rows * p.N * 2));  // poison: bf16 NaN
    megamoe::gemm::GemmTileConfig used;
    const megamoe::Status st = megamoe::gemm::launch_grouped_gemm(args, nullptr, &used);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    if (c.cluster != 0) {
      EXPECT_EQ(used.cluster, c.cluster) << used.to_string();
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> d = dd.get();
    if (run == 0) {
      double num = 0, den = 0, num_raw = 0;
      int64_t stored = 0, poisoned_ok = 0, outside = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < p.N; ++n) {
          const double rv = ref[r * p.N + n];
          const float g = bf16_at(d, r * p.N + n);
          if (std::isnan(rv)) {
            ++outside;
            if (d[r * p.N + n] == 0xFFFF) ++poisoned_ok;
            continue;
          }
          ++stored;
          const double rb = fmt::round_to_bf16(float(rv));
          num += (g - rb) * (g - rb);
          num_raw += (g - rv) * (g - rv);
          den += rv * rv;
        }
      const double rel = stored ? std::sqrt(num / std::max(den, 1e-300)) : 0.0;
      const double rel_raw = stored ? std::sqrt(num_raw / std::max(den, 1e-300)) : 0.0;
      std::printf("  [%s] %s rows=%lld stored=%lld rel_l2(vs bf16(ref))=%.3e rel_l2(vs ref)=%.3e\n", c.name.c_str(),
                  used.to_string().c_str(), (long long)rows, (long long)stored, rel, rel_raw);
      EXPECT_LE(rel, 1e-3);
      EXPECT_LE(rel_raw, 4e-3);  // bf16 output rounding alone is ~1.5e-3
      EXPECT_EQ(poisoned_ok, outside) << "rows outside every segment were written";
      first = d;
    } else {
      EXPECT_EQ(0, std::memcmp(first.data(), d.data(), d.size() * 2))
          << "run " << run << " (" << (args.tile_counter ? "dynamic" : "static") << " schedule, "
          << used.to_string() << ") not bitwise identical to run 0";
    }
    if (args.tile_counter != nullptr) {
      const std::vector<int32_t> c = counter.get();
      EXPECT_EQ(c[0], 0) << "tile counter not reset after run " << run;
      EXPECT_EQ(c[1], 0) << "done counter not reset after run " << run;
    }
  }
}

std::vector<GemmCase> store_cases() {
  const auto F = GemmDtype::kFp8Block;
  const auto H = GemmDtype::kBf16;
  const auto C = GroupedLayout::kContiguous;
  const auto M = GroupedLayout::kMasked;
  std::vector<GemmCase> v = {
      {"Fp8_Contig_Uneven_BM128_BN256", F, C, 512, 512, {1, 7, 0, 127, 128, 129, 300}, 128, 256, true, false},
      {"Fp8_Contig_Uneven_BM128_BN128", F, C, 384, 256, {63, 64, 65, 0, 1}, 128, 128, true, false},
      {"Fp8_Contig_Unpadded_BM64_BN256", F, C, 256, 384, {1, 7, 63, 64, 65, 200}, 64, 256, false, false},
      {"Fp8_Contig_Unpadded_BM64_BN128", F, C, 128, 128, {5, 0, 130}, 64, 128, false, false},
      // 128-wide fp8 tiles run their K loop two blocks deep: an odd number of K blocks (5) ends on
      // the loop's one-block tail, an even one (the cases above with K = 256) on its two-block tail
      {"Fp8_Contig_OddKBlocks_BM128_BN128", F, C, 256, 640, {1, 129, 64}, 128, 128, true, false},
      {"Fp8_Masked_OddKBlocks_BM64_BN128", F, M, 384, 384, {8, 0, 64, 33}, 64, 128, false, false},
      {"Fp8_Contig_Unpadded_BM128_BN256", F, C, 256, 384, {1, 7, 63, 64, 65, 200}, 128, 256, false, false},
      {"Fp8_Contig_Padded_BM64_BN256", F, C, 256, 384, {1, 7, 63, 64, 65, 200}, 64, 256, true, false},
      {"Fp8_Contig_AllEmpty", F, C, 256, 256, {0, 0, 0}, 0, 0, true, false},
      {"Fp8_Contig_OneExpertSkewed", F, C, 256, 512, {0, 0, 777, 0}, 128, 256, true, false},
      {"Fp8_Contig_Pow2Scales", F, C, 256, 256, {129, 3}, 128, 256, true, true},
      {"Fp8_Masked_BM64", F, M, 512, 512, {8, 0, 1, 7, 32, 65}, 64, 256, false, false},
      {"Fp8_Masked_BM128", F, M, 256, 256, {127, 128, 129, 0}, 128, 128, false, false},
      {"Fp8_Masked_Heuristic", F, M, 256, 256, {3, 17, 0, 31}, 0, 0, false, false},
      // each preset's N and K (deepseek-v3 FC1 / FC2, qwen3-30b-a3b FC1 / FC2)
      {"Fp8_DeepseekV3_FC1_N4096_K7168", F, C, 4096, 7168, {129, 7}, 0, 0, true, false},
      {"Fp8_DeepseekV3_FC2_N7168_K2048", F, C, 7168, 2048, {1, 65}, 0, 0, true, false},
      {"Fp8_Qwen3_FC1_N1536_K2048", F, C, 1536, 2048, {200, 13, 0}, 0, 0, true, false},
      {"Fp8_Qwen3_FC2_N2048_K768", F, C, 2048, 768, {200, 13, 0}, 0, 0, true, false},
      {"Fp8_Qwen3_FC2_Masked_N2048_K768", F, M, 2048, 768, {9, 0, 32}, 0, 0, false, false},
      // 16-row decode tiles, operands swapped (tokens as wgmma's N): experts of 17 and 40 rows span 2
      // and 3 m-blocks, segment starts not a multiple of 4, rows 1..16 of a tile
      {"Fp8_Contig_Unpadded_BM16_BN128", F, C, 256, 384, {1, 7, 15, 16, 17, 0, 40}, 16, 128, false, false},
      {"Fp8_Masked_BM16_BN256", F, M, 512, 512, {8, 0, 1, 16, 33}, 16, 256, false, false},
      {"Fp8_Qwen3_FC2_Masked_BM16_N2048_K768", F, M, 2048, 768, {8, 16, 0, 5}, 16, 128, false, false},
      // 32-row swapped tiles (wgmma N = 32): experts of 33 and 70 rows span 2 and 3 m-blocks, rows
      // 1..32 of a tile
      {"Fp8_Contig_Unpadded_BM32_BN128", F, C, 256, 384, {1, 7, 31, 32, 33, 0, 70}, 32, 128, false, false},
      {"Fp8_Masked_BM32_BN256", F, M, 512, 512, {24, 0, 1, 32, 65}, 32, 256, false, false},
      {"Fp8_Qwen3_FC2_Masked_BM32_N2048_K768", F, M, 2048, 768, {32, 17, 0, 5}, 32, 256, false, false},
      // clusters of 2 (pair tiles 2u, 2u + 1; one weight tile multicast when both are the same expert's
      // n-block): pairs straddling experts and n-blocks, empty experts, an odd tile count (the last
      // pair's second CTA runs a tile of no rows), unpadded segment starts
      {"Fp8_Contig_Uneven_BM128_BN256_Cluster2", F, C, 512, 512, {1, 7, 0, 127, 128, 129, 300}, 128, 256, true, false, 2},
      {"Fp8_Contig_OddTiles_N768_Cluster2", F, C, 768, 384, {129, 300}, 128, 256, true, false, 2},
      {"Fp8_Contig_Unpadded_BM128_BN256_Cluster2", F, C, 256, 384, {1, 7, 63, 64, 65, 200}, 128, 256, false, false, 2},
      {"Fp8_DeepseekV3_FC2_N7168_K2048_Cluster2", F, C, 7168, 2048, {256, 384, 1}, 128, 256, true, false, 2},
      // masked with max_m == BLOCK_M (rows per expert in A, no slack): the A-scale box (BLOCK_M + 4)
      // reaches past each expert's scale row, full tiles store every row, an idle expert between busy ones
      {"Fp8_Masked_MaxMIsBlockM_BM16_BN256", F, M, 512, 512, {8, 16, 3, 11, 0, 5, 16, 1}, 16, 256, false, false, 0, 16},
      {"Fp8_Qwen3_FC2_Masked_MaxMIsBlockM_BM16", F, M, 2048, 768, {8, 1, 16, 5, 9, 12}, 16, 256, false, false, 0, 16},
      {"Fp8_Masked_MaxMIsBlockM_BM32_BN128", F, M, 256, 512, {32, 24, 0, 1, 30}, 32, 128, false, false, 0, 32},
      {"Fp8_Masked_MaxMIsBlockM_BM64_BN128_K384", F, M, 384, 384, {32, 0, 64, 1, 17}, 64, 128, false, false, 0, 64},
      {"Bf16_Masked_MaxMIsBlockM_BM64", H, M, 256, 512, {8, 0, 33, 64}, 64, 256, false, false, 0, 64},
      {"Bf16_Contig_BM128_BN256", H, C, 512, 384, {1, 7, 129, 0, 64}, 128, 256, true, false},
      {"Bf16_Contig_BM64_BN128", H, C, 384, 256, {63, 65}, 64, 128, false, false},
      {"Bf16_Masked_BM64", H, M, 256, 512, {8, 0, 33}, 64, 256, false, false},
  };
  return v;
}

INSTANTIATE_TEST_SUITE_P(Sm90, GroupedGemmStore, ::testing::ValuesIn(store_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& i) { return i.param.name; });

// FC2-style epilogue: row_map scatter (some rows dropped) and per-row weights.
TEST(Sm90GroupedGemm, Fp8_RowMapAndWeights) {
  REQUIRE_SM90();
  GemmCase c{"rowmap", GemmDtype::kFp8Block, GroupedLayout::kContiguous, 256, 256, {70, 0, 5}, 128, 256, true, false};
  const Problem p = case_problem(c, 99);
  const std::vector<double> ref = reference(p);
  const int64_t rows = p.a_rows();
  std::vector<int32_t> row_map(rows);
  std::vector<float> weight(rows);
  const int64_t out_rows = rows + 10;
  for (int64_t r = 0; r < rows; ++r) {
    row_map[r] = (r % 5 == 3) ? -1 : int32_t(out_rows - 1 - r);  // reversed, every 5th dropped
    weight[r] = 0.25f + 0.01f * float(r % 17);
  }
  const DeviceProblem dev(p);
  DevBuf<float> dw(weight);
  DevBuf<int32_t> dmap(row_map);
  DevBuf<uint16_t> dd(out_rows * p.N);
  // the heuristic's tiles (128 rows) and the swapped 16- and 32-row decode tiles
  for (const int block_m : {0, 16, 32}) {
    CUDA_OK(cudaMemset(dd.p, 0xFF, out_rows * p.N * 2));
    GroupedGemmArgs a = dev.args();
    a.d = dd.p;
    a.row_map = dmap.p;
    a.row_weight = dw.p;
    a.tiles.block_m = block_m;
    const megamoe::Status st = megamoe::gemm::launch_grouped_gemm(a, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> d = dd.get();
    double num = 0, den = 0;
    std::vector<bool> written(out_rows, false);
    for (int64_t r = 0; r < rows; ++r) {
      if (std::isnan(ref[r * p.N]) || row_map[r] < 0) continue;
      written[row_map[r]] = true;
      for (int64_t n = 0; n < p.N; ++n) {
        const double rv = fmt::round_to_bf16(float(ref[r * p.N + n] * weight[r]));
        const double g = bf16_at(d, int64_t(row_map[r]) * p.N + n);
        num += (g - rv) * (g - rv);
        den += rv * rv;
      }
    }
    const double rel = std::sqrt(num / den);
    std::printf("  row_map + weights, block_m %d: rel_l2 = %.3e\n", block_m, rel);
    EXPECT_LE(rel, 1e-3);
    for (int64_t o = 0; o < out_rows; ++o)
      if (!written[o]) {
        EXPECT_EQ(d[o * p.N], 0xFFFF) << "row " << o << " written but no A row maps to it";
      }
  }
}

// Row weights with D's own rows (no row_map): full 16-row slabs go out by TMA store, weighted, and the
// slabs at the unpadded segments' ends by the per-row path; rows outside every segment stay untouched.
TEST(Sm90GroupedGemm, Fp8_IdentityRowsWithWeights) {
  REQUIRE_SM90();
  GemmCase c{"weights", GemmDtype::kFp8Block, GroupedLayout::kContiguous, 512, 256, {70, 0, 5, 33, 130}, 0, 0,
             false, false};
  const Problem p = case_problem(c, 77);
  const std::vector<double> ref = reference(p);
  const int64_t rows = p.a_rows();
  std::vector<float> weight(rows);
  for (int64_t r = 0; r < rows; ++r) weight[r] = 0.5f + 0.03f * float(r % 11);
  const DeviceProblem dev(p);
  DevBuf<float> dw(weight);
  DevBuf<uint16_t> dd(rows * p.N);
  for (const int block_m : {0, 64, 128}) {
    CUDA_OK(cudaMemset(dd.p, 0xFF, rows * p.N * 2));  // poison: bf16 NaN
    GroupedGemmArgs a = dev.args();
    a.d = dd.p;
    a.row_weight = dw.p;
    a.tiles.block_m = block_m;
    a.tiles.block_n = 256;
    megamoe::gemm::GemmTileConfig used;
    const megamoe::Status st = megamoe::gemm::launch_grouped_gemm(a, nullptr, &used);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> d = dd.get();
    double num = 0, den = 0;
    int64_t outside = 0, poisoned_ok = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < p.N; ++n) {
        if (std::isnan(ref[r * p.N + n])) {
          ++outside;
          if (d[r * p.N + n] == 0xFFFF) ++poisoned_ok;
          continue;
        }
        const double rv = fmt::round_to_bf16(float(ref[r * p.N + n] * weight[r]));
        const double g = bf16_at(d, r * p.N + n);
        num += (g - rv) * (g - rv);
        den += rv * rv;
      }
    const double rel = std::sqrt(num / den);
    std::printf("  identity rows + weights, %s: rel_l2 = %.3e\n", used.to_string().c_str(), rel);
    EXPECT_LE(rel, 1e-3);
    EXPECT_EQ(poisoned_ok, outside) << "rows outside every segment were written";
  }
}

// FC1 with SwiGLU + fp8 requant: codes and scales against the CPU codec on the float64 GEMM.
struct SwigluCase {
  std::string name;
  GroupedLayout layout;
  int I, K;
  std::vector<int> rows;
  int block_m;
  bool pow2;
  int cluster = 0;
  int max_m = 0;  // masked: rows per expert in A (0 = the most rows + 3)
};
std::ostream& operator<<(std::ostream& os, const SwigluCase& c) { return os << c.name; }
class GroupedGemmSwiglu : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(GroupedGemmSwiglu, RequantWithinOneE4m3Step) {
  REQUIRE_SM90();
  const SwigluCase& c = GetParam();
  GemmCase gc{c.name, GemmDtype::kFp8Block, c.layout, 2 * c.I, c.K, c.rows, c.block_m, 256, true, c.pow2, c.cluster, c.max_m};
  Problem p;
  p.layout = c.layout;
  p.N = 2 * c.I;
  p.K = c.K;
  p.pow2 = c.pow2;
  p.exact = true;
  make_segments(gc, &p);
  build_problem(&p, 4321u + c.I);
  const std::vector<double> ref = reference(p);  // [rows, 2I] with original (gate | up) rows
  const int64_t rows = p.a_rows(), I = c.I, KB = p.K / 128, IB = I / 128;
  // prepared weights
  std::vector<uint8_t> bprep(p.b.size());
  std::vector<float> sprep(p.b_scales.size());
  megamoe::gemm::prepare_w13_for_swiglu(p.b.data(), p.E, I, p.K, 1, bprep.data());
  megamoe::gemm::prepare_w13_scales_for_swiglu(p.b_scales.data(), p.E, I, p.K, sprep.data());
  (void)KB;

  const DeviceProblem dev(p, bprep, sprep);
  DevBuf<uint8_t> dh(rows * I);
  const int64_t ld_sd = (p.m_rows + 3) / 4 * 4;
  const int64_t nexp = c.layout == GroupedLayout::kMasked ? p.E : 1;
  DevBuf<float> dsd(nexp * IB * ld_sd);
  GroupedGemmArgs a = dev.args();
  a.epilogue = GemmEpilogue::kSwigluFp8;
  a.d = dh.p;
  a.d_scales = dsd.p;
  a.ld_d_scales = ld_sd;
  a.pow2_scales = c.pow2;
  a.tiles.block_m = c.block_m;
  a.tiles.cluster = c.cluster;
  std::vector<uint8_t> first_h;
  std::vector<float> first_s;
  for (int run = 0; run < 2; ++run) {
    CUDA_OK(cudaMemset(dh.p, 0x7F, rows * I));
    CUDA_OK(cudaMemset(dsd.p, 0xFF, dsd.n * 4));
    megamoe::gemm::GemmTileConfig used;
    const megamoe::Status st = megamoe::gemm::launch_grouped_gemm(a, nullptr, &used);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    if (c.cluster != 0) {
      EXPECT_EQ(used.cluster, c.cluster) << used.to_string();
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> h = dh.get();
    std::vector<float> s = dsd.get();
    if (run == 1) {
      EXPECT_EQ(0, std::memcmp(first_h.data(), h.data(), h.size()));
      EXPECT_EQ(0, std::memcmp(first_s.data(), s.data(), s.size() * 4));
      break;
    }
    first_h = h;
    first_s = s;
    int64_t checked = 0, equal = 0, bad = 0, scale_bad = 0, poison_bad = 0;
    std::vector<float> hv(128), sref(1);
    std::vector<uint8_t> qref(128);
    for (int64_t r = 0; r < rows; ++r) {
      const bool valid = !std::isnan(ref[r * p.N]);
      const int64_t e = c.layout == GroupedLayout::kMasked ? r / p.m_rows : 0;
      const int64_t m = c.layout == GroupedLayout::kMasked ? r % p.m_rows : r;
      for (int64_t ib = 0; ib < IB; ++ib) {
        const float gs = s[(e * IB + ib) * ld_sd + m];
        if (!valid) {
          if (h[r * I + ib * 128] != 0x7F) ++poison_bad;
          continue;
        }
        for (int j = 0; j < 128; ++j) {
          const float g = float(ref[r * p.N + ib * 128 + j]);
          const float u = float(ref[r * p.N + I + ib * 128 + j]);
          hv[j] = fmt::mul_rn(g / (1.f + std::exp(-g)), u);
        }
        fmt::quantize_fp8_1x128(hv.data(), 128, qref.data(), sref.data(), c.pow2);
        if (std::fabs(gs - sref[0]) > 1e-5f * sref[0]) ++scale_bad;
        for (int j = 0; j < 128; ++j) {
          ++checked;
          const uint8_t gq = h[r * I + ib * 128 + j];
          if (gq == qref[j]) {
            ++equal;
            continue;
          }
          // within one e4m3 step: adjacent codes of the same sign (or +-0 / smallest subnormal)
          const float gv = fmt::e4m3_to_float(gq) * gs, rv = fmt::e4m3_to_float(qref[j]) * sref[0];
          const float step = std::max(std::fabs(rv) / 8.f, sref[0] * 0.001953125f);
          if (std::fabs(gv - rv) > step * 1.001f) ++bad;
        }
      }
    }
    std::printf("  [%s] checked=%lld equal=%.5f beyond_one_step=%lld scale_mismatch=%lld\n", c.name.c_str(),
                (long long)checked, checked ? double(equal) / checked : 1.0, (long long)bad, (long long)scale_bad);
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(scale_bad, 0);
    EXPECT_EQ(poison_bad, 0);
    EXPECT_GE(equal, checked * 99 / 100);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, GroupedGemmSwiglu,
    ::testing::Values(SwigluCase{"Contig_I256_K512_BM128", GroupedLayout::kContiguous, 256, 512, {1, 7, 129, 0, 64}, 128, false},
                      SwigluCase{"Contig_I384_K256_BM64_Pow2", GroupedLayout::kContiguous, 384, 256, {65, 3}, 64, true},
                      SwigluCase{"Masked_I256_K384_BM64", GroupedLayout::kMasked, 256, 384, {8, 0, 33, 1}, 64, false},
                      // 16-row tiles, operands swapped: 1-3 m-blocks per expert, pow2 scales
                      SwigluCase{"Masked_I256_K384_BM16", GroupedLayout::kMasked, 256, 384, {8, 0, 17, 1, 16}, 16, false},
                      SwigluCase{"Contig_I384_K256_BM16_Pow2", GroupedLayout::kContiguous, 384, 256, {5, 16, 30, 0}, 16, true},
                      // 32-row tiles, operands swapped
                      SwigluCase{"Masked_I256_K384_BM32", GroupedLayout::kMasked, 256, 384, {24, 0, 33, 1, 32}, 32, false},
                      SwigluCase{"Contig_I384_K256_BM32_Pow2", GroupedLayout::kContiguous, 384, 256, {5, 32, 70, 0}, 32, true},
                      SwigluCase{"Qwen3_I768_K2048", GroupedLayout::kContiguous, 768, 2048, {130, 5}, 0, false},
                      // masked with max_m == BLOCK_M (no slack rows)
                      SwigluCase{"Masked_I256_K384_BM16_MaxMIsBlockM", GroupedLayout::kMasked, 256, 384, {8, 0, 16, 1, 11}, 16, false, 0, 16},
                      SwigluCase{"Masked_I256_K384_BM64_MaxMIsBlockM_Pow2", GroupedLayout::kMasked, 256, 384, {8, 33, 0, 64}, 64, true, 0, 64},
                      // clusters of 2: pairs straddling experts, an odd tile count
                      SwigluCase{"Contig_I256_K512_BM128_Cluster2", GroupedLayout::kContiguous, 256, 512, {1, 7, 129, 0, 64, 300}, 128, false, 2},
                      SwigluCase{"Contig_I384_K256_BM128_Cluster2_Pow2", GroupedLayout::kContiguous, 384, 256, {129, 3}, 128, true, 2}),
    [](const ::testing::TestParamInfo<SwigluCase>& i) { return i.param.name; });

// The scaled bf16 SwiGLU epilogue (nvfp4 weights expanded to bf16, their global scale per expert in
// fp32): with power-of-two scales s_e every product is exactly s_e times the unscaled one, so FC1 with
// b_expert_scale = s_e must equal, bit for bit, the unscaled bf16 SwiGLU epilogue on weights multiplied
// by s_e (exact in bf16). 64- and 128-row tiles (the bf16 configurations), experts with 0, 1, a partial
// and several m-blocks, scales 1/2, 1, 2, 4.
TEST(Sm90GroupedGemm, Bf16SwigluScaled_EqualsUnscaledOnPrescaledWeights) {
  REQUIRE_SM90();
  for (int block_m : {64, 128}) {
    GemmCase gc{"Bf16SwigluScaled", GemmDtype::kBf16, GroupedLayout::kContiguous, 2 * 256, 384, {1, 0, 129, 64, 7},
                block_m, 256, false, false};
    const Problem p = case_problem(gc, 777u + block_m);
    const int64_t I = 256, rows = p.a_rows();
    std::vector<float> scales(p.E);
    std::vector<uint8_t> scaled_b(p.b.size());
    for (int e = 0; e < p.E; ++e) {
      scales[e] = std::ldexp(1.f, e % 4 - 1);
      for (int64_t i = 0; i < int64_t(p.N) * p.K; ++i) {
        const int64_t at = int64_t(e) * p.N * p.K + i;
        uint16_t h;
        std::memcpy(&h, &p.b[at * 2], 2);
        const uint16_t hs = fmt::float_to_bf16(fmt::bf16_to_float(h) * scales[e]);
        ASSERT_EQ(fmt::bf16_to_float(hs), fmt::bf16_to_float(h) * scales[e]) << "must be exact";
        std::memcpy(&scaled_b[at * 2], &hs, 2);
      }
    }
    std::vector<uint8_t> prep(p.b.size()), prep_scaled(p.b.size());
    megamoe::gemm::prepare_w13_for_swiglu(p.b.data(), p.E, I, p.K, 2, prep.data());
    megamoe::gemm::prepare_w13_for_swiglu(scaled_b.data(), p.E, I, p.K, 2, prep_scaled.data());
    const DeviceProblem dev(p, prep, {}), dev_scaled(p, prep_scaled, {});
    DevBuf<float> expert_scale(scales);
    DevBuf<uint16_t> h_scaled(rows * I), h_ref(rows * I);
    CUDA_OK(cudaMemset(h_scaled.p, 0xFF, rows * I * 2));
    CUDA_OK(cudaMemset(h_ref.p, 0xFF, rows * I * 2));
    GroupedGemmArgs a = dev.args();
    a.epilogue = GemmEpilogue::kSwigluBf16Scaled;
    a.b_expert_scale = expert_scale.p;
    a.d = h_scaled.p;
    a.tiles.block_m = block_m;
    GroupedGemmArgs r = dev_scaled.args();
    r.epilogue = GemmEpilogue::kSwigluBf16;
    r.d = h_ref.p;
    r.tiles.block_m = block_m;
    megamoe::gemm::GemmTileConfig used;
    megamoe::Status st = megamoe::gemm::launch_grouped_gemm(a, nullptr, &used);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(used.block_m, block_m) << used.to_string();
    st = megamoe::gemm::launch_grouped_gemm(r, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = h_scaled.get(), want = h_ref.get();
    int64_t diffs = 0, stored = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      diffs += got[i] != want[i];
      stored += got[i] != 0xFFFF;
    }
    std::printf("  [Bf16SwigluScaled BM%d] %lld of %lld h values differ from the prescaled run (%lld stored)\n",
                block_m, (long long)diffs, (long long)got.size(), (long long)stored);
    EXPECT_EQ(diffs, 0) << "block_m " << block_m;
    EXPECT_EQ(stored, (1 + 0 + 129 + 64 + 7) * I) << "every real row, no other";
  }
}

}  // namespace
