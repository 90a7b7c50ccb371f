// Grouped GEMM host pieces: the persistent tile scheduler (grouped_scheduler.h), the tile heuristic
// and its knob overrides (gemm_heuristic.h), argument validation, and the SwiGLU weight preparation.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/gemm/gemm_heuristic.h"
#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/grouped_scheduler.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"

namespace {

using namespace megamoe::gemm;
using megamoe::Status;

// Every (expert, row block, n block) of every segment is produced exactly once, rows stay inside
// their segment, and the CTA round-robin covers each tile once whatever the grid.
void check_schedule(GroupedLayout layout, const std::vector<int32_t>& offsets, const std::vector<int32_t>& counts,
                    int32_t max_m, int32_t block_m, int32_t n_blocks) {
  const int32_t E = layout == GroupedLayout::kMasked ? int32_t(counts.size()) : int32_t(offsets.size()) - 1;
  std::vector<int32_t> begin(E), rows(E), prefix(E + 1);
  build_grouped_tables(layout, E, offsets.data(), counts.data(), max_m, block_m, begin.data(), rows.data(), prefix.data());
  GroupedSchedule s{begin.data(), rows.data(), prefix.data(), E, n_blocks, block_m};
  int64_t expected_tiles = 0;
  std::map<std::pair<int32_t, int32_t>, int> row_cover;  // (expert, row) -> times covered (per n block)
  for (int32_t e = 0; e < E; ++e) expected_tiles += (rows[e] + block_m - 1) / block_m * n_blocks;
  ASSERT_EQ(s.num_tiles(), expected_tiles);
  std::set<std::tuple<int32_t, int32_t, int32_t>> seen;
  for (int32_t grid : {1, 7, 132}) {
    seen.clear();
    row_cover.clear();
    for (int32_t cta = 0; cta < grid; ++cta)
      for (int32_t t = cta; t < s.num_tiles(); t += grid) {
        const GroupedTile g = s.tile(t);
        ASSERT_GE(g.expert, 0);
        ASSERT_LT(g.expert, E);
        ASSERT_GT(g.rows, 0) << "tile of an empty expert";
        ASSERT_LE(g.rows, block_m);
        ASSERT_LE(g.m0 + g.rows, rows[g.expert]) << "tile rows past the segment";
        ASSERT_EQ(g.row0, begin[g.expert] + g.m0);
        ASSERT_TRUE(seen.insert({g.expert, g.m0, g.n_block}).second) << "tile produced twice";
        if (g.n_block == 0)
          for (int32_t r = 0; r < g.rows; ++r) row_cover[{g.expert, g.m0 + r}]++;
      }
    ASSERT_EQ(int64_t(seen.size()), expected_tiles);
    for (int32_t e = 0; e < E; ++e)
      for (int32_t r = 0; r < rows[e]; ++r) ASSERT_EQ((row_cover[{e, r}]), 1) << "expert " << e << " row " << r;
  }
}

TEST(GemmScheduler, ContiguousPaddedAndUneven) {
  check_schedule(GroupedLayout::kContiguous, {0, 128, 128, 384, 512, 1024}, {}, 0, 128, 16);
  check_schedule(GroupedLayout::kContiguous, {0, 1, 8, 8, 71, 200, 329}, {}, 0, 64, 3);
  check_schedule(GroupedLayout::kContiguous, {0, 0, 0}, {}, 0, 128, 4);  // M = 0
}

TEST(GemmScheduler, MaskedCountsClampedToMaxM) {
  check_schedule(GroupedLayout::kMasked, {}, {8, 0, 1, 7, 64, 65, 200}, 96, 64, 28);
  check_schedule(GroupedLayout::kMasked, {}, {0, 0, 0, 0}, 32, 64, 16);
  check_schedule(GroupedLayout::kMasked, {}, {-3, 5}, 32, 128, 2);  // a negative count is empty
}

TEST(GemmScheduler, RandomSegments) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int E = 1 + int(rng() % 40);
    std::vector<int32_t> off(E + 1, 0), cnt(E);
    for (int e = 0; e < E; ++e) {
      cnt[e] = int32_t(rng() % 300) * int32_t(rng() % 3 != 0);
      off[e + 1] = off[e] + cnt[e];
    }
    check_schedule(GroupedLayout::kContiguous, off, {}, 0, (trial & 1) ? 64 : 128, 1 + int32_t(rng() % 30));
    check_schedule(GroupedLayout::kMasked, {}, cnt, 256, (trial & 1) ? 128 : 64, 1 + int32_t(rng() % 30));
  }
}

TEST(GemmScheduler, RowBlocksSharingAWeightTileAreAdjacent) {
  // tile order within an expert: m-blocks fastest, so concurrent CTAs share one weight tile in L2.
  std::vector<int32_t> off = {0, 384, 512};  // expert 0: 3 m-blocks, expert 1: 1
  std::vector<int32_t> begin(2), rows(2), prefix(3);
  build_grouped_tables(GroupedLayout::kContiguous, 2, off.data(), nullptr, 0, 128, begin.data(), rows.data(), prefix.data());
  GroupedSchedule s{begin.data(), rows.data(), prefix.data(), 2, 4, 128};
  for (int t = 0; t < 12; ++t) {
    EXPECT_EQ(s.tile(t).expert, 0);
    EXPECT_EQ(s.tile(t).n_block, t / 3);
    EXPECT_EQ(s.tile(t).row0, (t % 3) * 128);
  }
  for (int t = 12; t < 16; ++t) {
    EXPECT_EQ(s.tile(t).expert, 1);
    EXPECT_EQ(s.tile(t).n_block, t - 12);
    EXPECT_EQ(s.tile(t).row0, 384);
  }
}

GemmShapeHint hint(int64_t m, int32_t e, int32_t n, int32_t k, GemmEpilogue epi = GemmEpilogue::kStoreBf16) {
  GemmShapeHint h;
  h.m_per_expert = m;
  h.num_experts = e;
  h.n = n;
  h.k = k;
  h.epilogue = epi;
  h.num_sms = 132;
  return h;
}

TEST(GemmHeuristic, BucketsByTokensPerExpert) {
  // decode: <= 16 rows per expert -> 16-row tiles (swapped); <= 64 -> 64-row tiles, one math
  // warpgroup (FC1 + SwiGLU at 17-32: 32-row swapped tiles, below)
  EXPECT_EQ(select_gemm_tiles(hint(1, 32, 4096, 7168)).block_m, 16);
  EXPECT_EQ(select_gemm_tiles(hint(8, 32, 4096, 7168)).block_m, 16);
  EXPECT_EQ(select_gemm_tiles(hint(16, 32, 4096, 7168)).block_m, 16);
  EXPECT_EQ(select_gemm_tiles(hint(17, 32, 4096, 7168)).block_m, 64);
  EXPECT_EQ(select_gemm_tiles(hint(32, 32, 4096, 7168)).block_m, 64);
  EXPECT_EQ(select_gemm_tiles(hint(17, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).block_m, 32);
  EXPECT_EQ(select_gemm_tiles(hint(32, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).block_m, 32);
  EXPECT_EQ(select_gemm_tiles(hint(33, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).block_m, 64);
  EXPECT_EQ(select_gemm_tiles(hint(64, 32, 4096, 7168)).block_m, 64);
  // prefill: two math warpgroups
  EXPECT_EQ(select_gemm_tiles(hint(65, 32, 4096, 7168)).block_m, 128);
  EXPECT_EQ(select_gemm_tiles(hint(2048, 128, 7168, 2048)).block_m, 128);
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168)).block_n, 256);
  // SwiGLU always 256 wide (gate + up)
  EXPECT_EQ(select_gemm_tiles(hint(8, 2, 1536, 2048, GemmEpilogue::kSwigluFp8)).block_n, 256);
  // N = 128 mod 256 -> 128-wide tiles
  EXPECT_EQ(select_gemm_tiles(hint(512, 8, 384, 256)).block_n, 128);
  // too few tiles for the SMs -> narrower tiles
  EXPECT_EQ(select_gemm_tiles(hint(8, 2, 4096, 768)).block_n, 128);
  // small N (qwen3-30b-a3b) at <= 128 rows per expert -> 128-wide tiles; from 256 rows, and for
  // deepseek-v3 FC2 (N 7168), 256
  EXPECT_EQ(select_gemm_tiles(hint(128, 64, 1536, 2048)).block_n, 128);
  EXPECT_EQ(select_gemm_tiles(hint(32, 64, 2048, 768)).block_n, 128);
  EXPECT_EQ(select_gemm_tiles(hint(8, 64, 2048, 768)).block_n, 256);  // 16-row swapped tiles: 256 wide
  EXPECT_EQ(select_gemm_tiles(hint(256, 64, 1536, 2048)).block_n, 256);
  EXPECT_EQ(select_gemm_tiles(hint(256, 64, 2048, 768)).block_n, 256);
  EXPECT_EQ(select_gemm_tiles(hint(256, 64, 7168, 2048)).block_n, 256);
  EXPECT_EQ(select_gemm_tiles(hint(1024, 64, 1536, 2048)).block_n, 256);
  EXPECT_EQ(select_gemm_tiles(hint(256, 64, 1536, 2048, GemmEpilogue::kSwigluFp8)).block_n, 256);
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168)).num_sms, 132);
  // 16- and 32-row (swapped) tiles for fp8 (bf16 rows or SwiGLU + fp8 out): bf16 keeps 64 at decode
  EXPECT_EQ(select_gemm_tiles(hint(8, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).block_m, 16);
  EXPECT_EQ(select_gemm_tiles(hint(24, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).block_m, 32);
  GemmShapeHint bf16 = hint(8, 32, 4096, 7168);
  bf16.fp8 = false;
  EXPECT_EQ(select_gemm_tiles(bf16).block_m, 64);
  bf16.m_per_expert = 24;
  EXPECT_EQ(select_gemm_tiles(bf16).block_m, 64);
  megamoe::Knobs k16;
  k16.block_m = 16;
  EXPECT_EQ(select_gemm_tiles(bf16, &k16).block_m, 64);
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168), &k16).block_m, 16);
  k16.block_m = 32;
  EXPECT_EQ(select_gemm_tiles(bf16, &k16).block_m, 64);
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168), &k16).block_m, 32);
}

TEST(GemmHeuristic, KnobOverridesFieldByField) {
  megamoe::Knobs k;
  k.block_m = 128;
  GemmTileConfig c = select_gemm_tiles(hint(8, 32, 4096, 7168), &k);
  EXPECT_EQ(c.block_m, 128);
  EXPECT_EQ(c.block_n, 256);
  k = {};
  k.block_n = 128;
  k.num_sms = 66;
  c = select_gemm_tiles(hint(512, 32, 4096, 7168), &k);
  EXPECT_EQ(c.block_n, 128);
  EXPECT_EQ(c.num_sms, 66);
  // an override breaking a rule is ignored: SwiGLU needs 256, N=384 cannot take 256
  c = select_gemm_tiles(hint(512, 32, 4096, 7168, GemmEpilogue::kSwigluFp8), &k);
  EXPECT_EQ(c.block_n, 256);
  k.block_n = 256;
  EXPECT_EQ(select_gemm_tiles(hint(512, 8, 384, 256), &k).block_n, 128);
  k = {};
  k.num_sms = 1000;
  EXPECT_EQ(select_gemm_tiles(hint(512, 8, 4096, 7168), &k).num_sms, 132);
}

// Round-robin tiles for short launches whose experts span several m-blocks; the counter otherwise.
TEST(GemmHeuristic, TileOrderBySpanAndLength) {
  // qwen3-30b-a3b 64 experts x 256 rows: 2 m-blocks, 1024 (FC2) / 768 (FC1) tiles on 132 SMs
  EXPECT_TRUE(select_gemm_tiles(hint(256, 64, 2048, 768)).round_robin);
  EXPECT_TRUE(select_gemm_tiles(hint(256, 64, 1536, 2048)).round_robin);
  // deepseek-v3 32 x 256: 2 m-blocks, 1024 FC1 tiles (7.8 per SM) but 1792 FC2 tiles (13.6)
  EXPECT_TRUE(select_gemm_tiles(hint(256, 32, 4096, 7168)).round_robin);
  EXPECT_FALSE(select_gemm_tiles(hint(256, 32, 7168, 2048)).round_robin);
  // long launches: 128 x 256 (4096 FC1 tiles), 32 x 512 (27 waves), 64 x 1024
  EXPECT_FALSE(select_gemm_tiles(hint(256, 128, 4096, 7168)).round_robin);
  EXPECT_FALSE(select_gemm_tiles(hint(512, 32, 7168, 2048)).round_robin);
  EXPECT_FALSE(select_gemm_tiles(hint(1024, 64, 2048, 768)).round_robin);
  // one m-block per expert: decode and 128 rows
  EXPECT_FALSE(select_gemm_tiles(hint(8, 64, 2048, 768)).round_robin);
  EXPECT_FALSE(select_gemm_tiles(hint(128, 32, 7168, 2048)).round_robin);
  // the count follows the SMs the launch may use
  megamoe::Knobs k;
  k.num_sms = 60;
  EXPECT_FALSE(select_gemm_tiles(hint(256, 64, 2048, 768), &k).round_robin);  // 1024 tiles > 8 x 60
}

// Clusters of 2 (weight tiles multicast to a pair of CTAs): fp8 128 x 256 tiles with long K.
// mxfp4 weights: the smallest swapped tile holding the bucket's rows (64 with two math warpgroups
// only), not fp8-block's 64-row choice for 17-32-row bf16-row GEMMs; an asked-for BLOCK_M is kept.
TEST(GemmHeuristic, Mxfp4BlockMIsTheSmallestTileHoldingTheRows) {
  for (int32_t wg : {1, 2}) {
    EXPECT_EQ(select_mxfp4_block_m(1, 0, wg), 16);
    EXPECT_EQ(select_mxfp4_block_m(16, 0, wg), 16);
    EXPECT_EQ(select_mxfp4_block_m(17, 0, wg), 32);
    EXPECT_EQ(select_mxfp4_block_m(32, 0, wg), 32);
    EXPECT_EQ(select_mxfp4_block_m(33, 0, wg), wg == 2 ? 64 : 32);
    EXPECT_EQ(select_mxfp4_block_m(4096, 0, wg), wg == 2 ? 64 : 32);
    EXPECT_EQ(select_mxfp4_block_m(4096, 16, wg), 16);
    EXPECT_EQ(select_mxfp4_block_m(8, 32, wg), 32);
  }
  EXPECT_EQ(select_mxfp4_block_m(8, 64, 2), 64);
  // fp8-block's choice at 32 rows of a bf16-row GEMM is 64; mxfp4's stays 32.
  EXPECT_EQ(select_gemm_tiles(hint(32, 128, 4096, 7168)).block_m, 64);
}

TEST(GemmHeuristic, ClustersForLongK) {
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168)).cluster, 2);  // deepseek-v3 FC1
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168, GemmEpilogue::kSwigluFp8)).cluster, 2);
  EXPECT_EQ(select_gemm_tiles(hint(128, 128, 4096, 7168)).cluster, 2);
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 7168, 2048)).cluster, 1);  // FC2: K 2048, even
  EXPECT_EQ(select_gemm_tiles(hint(1024, 64, 2048, 768)).cluster, 1);  // qwen3-30b-a3b FC2: K 768, slower
  EXPECT_EQ(select_gemm_tiles(hint(8, 32, 4096, 7168)).cluster, 1);    // decode tiles
  EXPECT_EQ(select_gemm_tiles(hint(64, 32, 4096, 7168)).cluster, 1);
  GemmShapeHint bf16 = hint(512, 32, 4096, 7168);
  bf16.fp8 = false;
  EXPECT_EQ(select_gemm_tiles(bf16).cluster, 1);
  megamoe::Knobs k;
  k.gemm_cluster = 1;
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168), &k).cluster, 1);
  k.gemm_cluster = 2;
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 7168, 2048), &k).cluster, 2);
  EXPECT_EQ(select_gemm_tiles(hint(8, 32, 4096, 7168), &k).cluster, 1);  // 16-row tiles: ignored
  EXPECT_EQ(select_gemm_tiles(bf16, &k).cluster, 1);
  k.block_n = 128;
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 7168, 2048), &k).cluster, 1);  // 128-wide tiles: ignored
  k = {};
  k.num_sms = 1;
  EXPECT_EQ(select_gemm_tiles(hint(512, 32, 4096, 7168), &k).cluster, 1);  // one SM: no pair
}

TEST(GemmTiles, CountMatchesScheduler) {
  const std::vector<int32_t> rows = {0, 1, 64, 65, 300};
  GemmTileConfig c;
  c.block_m = 64;
  c.block_n = 256;
  EXPECT_EQ(count_gemm_tiles(rows.data(), 5, 1024, c), (0 + 1 + 1 + 2 + 5) * 4);
}

TEST(GemmValidate, MessagesNameTheField) {
  GroupedGemmArgs a;
  a.num_experts = 4;
  a.n = 4096;
  a.k = 7000;
  int dummy[64];
  a.a = a.b = a.d = dummy;
  Status st = validate_grouped_gemm(a);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("k=7000"), std::string::npos) << st.message();
  a.k = 7168;
  a.n = 4000;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("n=4000"), std::string::npos) << st.message();
  a.n = 4096 + 128;
  a.epilogue = GemmEpilogue::kSwigluFp8;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("multiple of 256"), std::string::npos) << st.message();
  a.n = 4096;
  a.epilogue = GemmEpilogue::kStoreBf16;
  st = validate_grouped_gemm(a);  // no expert_offsets
  EXPECT_NE(st.message().find("expert_offsets"), std::string::npos) << st.message();
  a.expert_offsets = reinterpret_cast<const int32_t*>(dummy);
  a.a_scales = a.b_scales = reinterpret_cast<const float*>(dummy);
  a.m_rows = 100;
  a.ld_a_scales = 102;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("ld_a_scales=102"), std::string::npos) << st.message();
  a.ld_a_scales = 104;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.tiles.block_n = 128;
  a.epilogue = GemmEpilogue::kSwigluFp8;
  a.d_scales = reinterpret_cast<float*>(dummy);
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_n"), std::string::npos) << st.message();
  a.tiles.block_n = 256;
  a.tiles.block_m = 16;  // 16-row tiles: fp8 only
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.epilogue = GemmEpilogue::kStoreBf16;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.dtype = GemmDtype::kBf16;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_m=16"), std::string::npos) << st.message();
  a.tiles.block_m = 32;  // 32-row tiles: fp8 only as well
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_m=32"), std::string::npos) << st.message();
  a.dtype = GemmDtype::kFp8Block;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.tiles.block_m = 48;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_m=48"), std::string::npos) << st.message();
  a.tiles.block_m = 16;
  a.probe = megamoe::gemm::GemmProbe::kStream;  // a probe needs the timeline
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("probe"), std::string::npos) << st.message();
  a.probe = megamoe::gemm::GemmProbe::kNone;
  // clusters: 1 or 2; 2 only for fp8 128 x 256 tiles (or tiles the heuristic picks)
  a.tiles.cluster = 3;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.cluster=3"), std::string::npos) << st.message();
  a.tiles.cluster = 2;
  st = validate_grouped_gemm(a);  // block_m 16
  EXPECT_NE(st.message().find("tiles.cluster=2"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("128-row"), std::string::npos) << st.message();
  a.tiles.block_m = 128;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.tiles.block_m = 0;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.tiles.block_n = 128;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("256-wide"), std::string::npos) << st.message();
  a.tiles.block_n = 0;
  a.dtype = GemmDtype::kBf16;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("fp8-block"), std::string::npos) << st.message();
}

// mxfp4 weights: swapped 16- / 32-row tiles 256 wide, n a multiple of 256, the block scales inside b.
TEST(GemmValidate, Mxfp4RulesNameTheirField) {
  alignas(16) int dummy[64];
  GroupedGemmArgs a;
  a.dtype = GemmDtype::kMxfp4;
  a.num_experts = 4;
  a.n = 7168;
  a.k = 2048;
  a.m_rows = 100;
  a.a = a.b = a.d = dummy;
  a.expert_offsets = reinterpret_cast<const int32_t*>(dummy);
  a.a_scales = reinterpret_cast<const float*>(dummy);
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.b_scales = reinterpret_cast<const float*>(dummy);
  Status st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("b_scales=set"), std::string::npos) << st.message();
  a.b_scales = nullptr;
  a.n = 7296;  // a multiple of 128, not of 256
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("n=7296, must be a multiple of 256 with dtype mxfp4"), std::string::npos) << st.message();
  a.n = 7168;
  a.tiles.block_m = 128;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_m=128, dtype mxfp4 runs 16-, 32- or 64-row tiles"), std::string::npos)
      << st.message();
  for (int32_t wg : {0, 2}) {  // 64-row tiles: two math warpgroups (0: the default, two)
    a.tiles.block_m = 64;
    a.tiles.fp4_math_wg = wg;
    EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << wg << ": " << validate_grouped_gemm(a).message();
  }
  a.tiles.fp4_math_wg = 1;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_m=64, 64-row mxfp4 tiles run two math warpgroups"), std::string::npos)
      << st.message();
  a.tiles.fp4_math_wg = 0;
  a.tiles.block_m = 32;
  a.tiles.block_n = 128;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.block_n=128, dtype mxfp4 runs 256-wide tiles"), std::string::npos) << st.message();
  a.tiles.block_n = 256;
  a.tiles.cluster = 2;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.cluster=2"), std::string::npos) << st.message();
  a.tiles.cluster = 0;
  for (int32_t wg : {0, 1, 2}) {  // math warpgroups per tile; 0: the default
    a.tiles.fp4_math_wg = wg;
    EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << wg << ": " << validate_grouped_gemm(a).message();
  }
  for (int32_t wg : {-1, 3, 4}) {
    a.tiles.fp4_math_wg = wg;
    st = validate_grouped_gemm(a);
    EXPECT_NE(st.message().find("tiles.fp4_math_wg=" + std::to_string(wg) + ", must be 0 (the default, 2), 1 or 2"),
              std::string::npos)
        << st.message();
  }
  // CTAs per SM: 0 (the default), 1 or 2; two with 16-row tiles (or the GEMM's choice) of two math warpgroups
  a.tiles.fp4_math_wg = 0;
  for (int32_t bm : {0, 16}) {
    a.tiles.block_m = bm;
    for (int32_t cps : {0, 1, 2}) {
      a.tiles.ctas_per_sm = cps;
      EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << bm << " " << cps << ": " << validate_grouped_gemm(a).message();
    }
  }
  for (int32_t cps : {-1, 3}) {
    a.tiles.ctas_per_sm = cps;
    st = validate_grouped_gemm(a);
    EXPECT_NE(st.message().find("tiles.ctas_per_sm=" + std::to_string(cps) + ", must be 0 (the default, " +
                                    std::to_string(megamoe::gemm::kDefaultFp4CtasPerSm) + "), 1 or 2"),
              std::string::npos)
        << st.message();
  }
  // 2 beside tiles that run one (32 or 64 rows, one math warpgroup): accepted, the GEMM runs those at one
  a.tiles.ctas_per_sm = 2;
  for (int32_t bm : {32, 64}) {
    a.tiles.block_m = bm;
    EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << bm << ": " << validate_grouped_gemm(a).message();
  }
  a.tiles.block_m = 16;
  a.tiles.fp4_math_wg = 1;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.tiles.fp4_math_wg = 0;
  a.dtype = GemmDtype::kFp8Block;  // mxfp4 tiles only
  a.b_scales = reinterpret_cast<const float*>(dummy);
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.ctas_per_sm=2, must be 0 with dtype fp8-block"), std::string::npos)
      << st.message();
  a.tiles.ctas_per_sm = 0;
  a.tiles.block_m = 32;
  a.dtype = GemmDtype::kMxfp4;
  a.b_scales = nullptr;
  a.tiles.fp4_math_wg = 2;  // mxfp4 tiles only
  a.dtype = GemmDtype::kFp8Block;
  a.b_scales = reinterpret_cast<const float*>(dummy);
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("tiles.fp4_math_wg=2, must be 0 with dtype fp8-block"), std::string::npos)
      << st.message();
  a.tiles.fp4_math_wg = 0;
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();
  a.dtype = GemmDtype::kMxfp4;
  a.b_scales = nullptr;
  a.a_scales = nullptr;  // the A side is fp8-block's
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("a_scales"), std::string::npos) << st.message();
}

// Rows written into several buffers (each rank's combine region): the rules name their field.
TEST(GemmValidate, PeerBuffersNeedARowMapAndTheStoreEpilogue) {
  alignas(16) int dummy[64];
  GroupedGemmArgs a;
  a.num_experts = 4;
  a.n = 4096;
  a.k = 7168;
  a.m_rows = 100;
  a.a = a.b = dummy;
  a.expert_offsets = reinterpret_cast<const int32_t*>(dummy);
  a.a_scales = a.b_scales = reinterpret_cast<const float*>(dummy);
  a.num_peer_d = 2;
  a.peer_d[0] = a.peer_d[1] = dummy;
  a.peer_d_rows = 64;
  Status st = validate_grouped_gemm(a);  // no row_map
  EXPECT_NE(st.message().find("row_map=null"), std::string::npos) << st.message();
  a.row_map = reinterpret_cast<const int32_t*>(dummy);
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).message();  // d unused
  a.peer_d[1] = nullptr;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("peer_d[1]=null"), std::string::npos) << st.message();
  a.peer_d[1] = reinterpret_cast<char*>(dummy) + 4;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("peer_d[1]=unaligned"), std::string::npos) << st.message();
  a.peer_d[1] = dummy;
  a.peer_d_rows = 0;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("peer_d_rows=0"), std::string::npos) << st.message();
  a.peer_d_rows = 64;
  a.num_peer_d = 9;
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("num_peer_d=9, must be in [0, 8]"), std::string::npos) << st.message();
  a.num_peer_d = 2;
  a.epilogue = GemmEpilogue::kSwigluFp8;
  a.d_scales = reinterpret_cast<float*>(dummy);
  st = validate_grouped_gemm(a);
  EXPECT_NE(st.message().find("needs the store-bf16 epilogue"), std::string::npos) << st.message();
}

TEST(GemmWeights, SwigluInterleaveKeepsScaleBlocks) {
  const int64_t E = 2, I = 256, K = 256, rows = 2 * I;
  std::vector<uint8_t> src(E * rows * K), dst(src.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) src[(e * rows + r) * K + k] = uint8_t((r * 7 + e * 3 + k) & 0xFF);
  prepare_w13_for_swiglu(src.data(), E, I, K, 1, dst.data());
  // tile j of 256 prepared rows: gate rows 128j.., then up rows I + 128j..
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < I / 128; ++j)
      for (int64_t i = 0; i < 128; ++i) {
        EXPECT_EQ(dst[(e * rows + 256 * j + i) * K], src[(e * rows + 128 * j + i) * K]);
        EXPECT_EQ(dst[(e * rows + 256 * j + 128 + i) * K + 5], src[(e * rows + I + 128 * j + i) * K + 5]);
      }
  std::vector<float> s(E * (rows / 128) * (K / 128)), sd(s.size());
  std::iota(s.begin(), s.end(), 1.f);
  prepare_w13_scales_for_swiglu(s.data(), E, I, K, sd.data());
  // blocks: gate 0, gate 1, up 0, up 1 -> prepared gate 0, up 0, gate 1, up 1
  const int64_t kb = K / 128;
  EXPECT_EQ(sd[1 * kb], s[2 * kb]);
  EXPECT_EQ(sd[2 * kb], s[1 * kb]);
  EXPECT_EQ(sd[(4 + 3) * kb + 1], s[(4 + 3) * kb + 1]);
}

// Bad arguments name the field, the value and the rule.
TEST(GemmValidate, Nvfp4RefusesScalesAndTilesItDoesNotRun) {
  GroupedGemmArgs a;
  a.dtype = GemmDtype::kNvfp4;
  a.num_experts = 2;
  a.n = 512;
  a.k = 256;
  a.m_rows = 32;
  a.layout = GroupedLayout::kMasked;
  a.masked_counts = reinterpret_cast<const int32_t*>(0x1000);
  a.a = reinterpret_cast<const void*>(0x1000);
  a.b = reinterpret_cast<const void*>(0x2000);
  a.d = reinterpret_cast<void*>(0x3000);
  EXPECT_TRUE(validate_grouped_gemm(a).is_ok()) << validate_grouped_gemm(a).to_string();
  GroupedGemmArgs b = a;
  b.tiles.block_m = 64;
  EXPECT_NE(validate_grouped_gemm(b).message().find("tiles.block_m"), std::string::npos);
  b = a;
  b.b_scales = reinterpret_cast<const float*>(0x4000);
  EXPECT_NE(validate_grouped_gemm(b).message().find("b_scales"), std::string::npos);
  b = a;
  b.epilogue = GemmEpilogue::kSwigluBf16Scaled;
  b.b_expert_scale = reinterpret_cast<const float*>(0x4000);
  EXPECT_NE(validate_grouped_gemm(b).message().find("b_expert_scale"), std::string::npos);
  b = a;
  b.epilogue = GemmEpilogue::kSwigluBf16;
  EXPECT_NE(validate_grouped_gemm(b).message().find("swiglu-bf16-scaled"), std::string::npos);
  b = a;
  b.tiles.ctas_per_sm = 2;
  EXPECT_NE(validate_grouped_gemm(b).message().find("ctas_per_sm"), std::string::npos);
}

}  // namespace
