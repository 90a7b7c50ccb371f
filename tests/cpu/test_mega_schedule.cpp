// The mega backend's host-side planning (kernels/mega/mega_schedule.h), its workspace layout, its
// static gate, and a model of the kernel's tile order that checks the deadlock-freedom argument of
// sm90_mega_kernel.cuh: CTAs take tiles in increasing order from one counter, each CTA's producer
// fills a ring of K-block slots that its math warpgroups drain in order, and an FC2 tile's loads wait
// until every FC1 tile of its m-block is done. No GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>
#include <vector>

#include "core/backends.h"
#include "kernels/gemm/grouped_scheduler.h"
#include "kernels/mega/mega_schedule.h"
#include "megamoe/config.h"
#include "megamoe/workspace.h"

namespace megamoe::mega {
namespace {

TEST(MegaSchedule, BlockMBucketsAndKnobs) {
  EXPECT_EQ(mega_block_m(1, true, 0), 16);
  EXPECT_EQ(mega_block_m(16, true, 0), 16);
  EXPECT_EQ(mega_block_m(17, true, 0), 64);
  EXPECT_EQ(mega_block_m(64, true, 0), 64);
  EXPECT_EQ(mega_block_m(65, true, 0), 128);
  EXPECT_EQ(mega_block_m(1, false, 0), 64);  // no swapped 16-row tiles for bf16 weights
  EXPECT_EQ(mega_block_m(1, true, 128), 128);
  EXPECT_EQ(mega_block_m(1000, true, 16), 16);
  EXPECT_EQ(mega_block_m(1, false, 16), 64);  // a knob the configuration cannot run is ignored
  EXPECT_EQ(mega_block_m(1, true, 32), 16);   // 32-row tiles are not built for mega
  // deepseek-v3 EP1: 1 token -> 16-row tiles, 128 tokens (4 + 2*2 rows per expert) -> 16, 1024 (32 +
  // 2*5.7) -> 64, 4096 -> 128 (the routed backend's GEMM buckets for the same rows)
  EXPECT_EQ(mega_block_m(mega_expected_rows_per_expert(1, 1, 8, 256), true, 0), 16);
  EXPECT_EQ(mega_expected_rows_per_expert(1, 128, 8, 256), 8);
  EXPECT_EQ(mega_block_m(mega_expected_rows_per_expert(1, 1024, 8, 256), true, 0), 64);
  EXPECT_EQ(mega_block_m(mega_expected_rows_per_expert(1, 4096, 8, 256), true, 0), 128);
  // mxfp4 weights: the one configuration built (16-row tiles) at every size, whatever the knob
  for (int64_t rows : {1, 16, 17, 64, 65, 4096})
    for (int32_t knob : {0, 16, 64, 128}) EXPECT_EQ(mega_block_m(rows, true, knob, /*weight_fp4=*/true), 16);
}

TEST(MegaSchedule, DispatchShapeFitsTheCta) {
  for (int grid : {1, 33, 66, 132})
    for (int threads : {256, 384})
      for (int64_t T : {0, 1, 7, 128, 1000, 8192, 16384}) {
        if (T > int64_t(grid) * threads) continue;
        const MegaDispatchShape s = mega_dispatch_shape(T, grid, threads, 7168 / 16);
        EXPECT_GE(s.tokens_per_cta, 1);
        EXPECT_LE(s.tokens_per_cta, threads) << "T=" << T << " grid=" << grid;
        EXPECT_GE(int64_t(s.tokens_per_cta) * grid, T) << "every token in some CTA's chunk";
        EXPECT_GE(s.parts, 1);
        EXPECT_LE(s.parts, (7168 / 16 + 31) / 32);
      }
  EXPECT_EQ(mega_dispatch_shape(1, 132, 384, 448).parts, 12);  // one token: every warp of its CTA
  EXPECT_EQ(mega_dispatch_shape(8192, 132, 384, 448).parts, 1);
}

TEST(MegaSchedule, ReduceParts) {
  EXPECT_EQ(mega_reduce_parts(1, 132 * 8, 28), 28);
  EXPECT_EQ(mega_reduce_parts(0, 132 * 8, 28), 28);
  EXPECT_EQ(mega_reduce_parts(8192, 132 * 8, 28), 1);
  EXPECT_EQ(mega_reduce_parts(100, 1056, 28), 11);
}

TEST(MegaSchedule, ScratchHoldsEveryMBlockCounter) {
  // P rows cut into m-blocks of 16 per expert: at most P/16 + E_l m-blocks (each segment's tail).
  const int64_t P = 8192 * 8, El = 256;
  const MegaScratchLayout s = MegaScratchLayout::make(P, El, 64);
  EXPECT_EQ(s.max_m_blocks, P / 16 + El);
  EXPECT_GE(s.expert_fill - s.counters, 64);
  EXPECT_GE(s.expert_placed - s.expert_fill, El * 4);
  EXPECT_GE(s.fc1_done - s.expert_placed, El * 4);
  EXPECT_GE(s.total - s.fc1_done, s.max_m_blocks * 4);
  for (int bm : kMegaBlockMs) EXPECT_LE(mega_max_m_blocks(P, El, bm), s.max_m_blocks);
  std::mt19937 rng(3);
  for (int it = 0; it < 200; ++it) {  // random segments of P rows: m-blocks within the bound
    std::vector<int32_t> rows(El, 0);
    for (int64_t r = 0; r < 5000; ++r) rows[rng() % El]++;
    int64_t mb = 0;
    for (int32_t n : rows) mb += (n + 15) / 16;
    EXPECT_LE(mb, mega_max_m_blocks(5000, El, 16));
  }
}

// The model's m-block of each tile equals the device scheduler's (GroupedSchedule).
TEST(MegaSchedule, TileOrderMatchesTheGroupedScheduler) {
  std::mt19937 rng(11);
  for (int it = 0; it < 50; ++it) {
    const int E = 1 + static_cast<int>(rng() % 12), bm = kMegaBlockMs[rng() % 3];
    std::vector<int32_t> offsets(E + 1, 0), begin(E), num(E), prefix(E + 1);
    for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(rng() % 300);
    gemm::build_grouped_tables(gemm::GroupedLayout::kContiguous, E, offsets.data(), nullptr, 0, bm, begin.data(), num.data(),
                               prefix.data());
    MegaTileOrder order;
    order.m_block_prefix = prefix;
    order.fc1_n_blocks = 1 + static_cast<int32_t>(rng() % 8);
    order.fc2_n_blocks = 1 + static_cast<int32_t>(rng() % 28);
    const gemm::GroupedSchedule s1{begin.data(), num.data(), prefix.data(), E, order.fc1_n_blocks, bm};
    const gemm::GroupedSchedule s2{begin.data(), num.data(), prefix.data(), E, order.fc2_n_blocks, bm};
    for (int64_t u = 0; u < order.fc1_tiles() + order.fc2_tiles(); ++u) {
      const bool fc1 = u < order.fc1_tiles();
      const gemm::GroupedTile t = fc1 ? s1.tile(static_cast<int32_t>(u)) : s2.tile(static_cast<int32_t>(u - order.fc1_tiles()));
      EXPECT_EQ(order.m_block_of(u), prefix[t.expert] + t.m0 / bm) << "tile " << u;
    }
  }
}

// The kernel's tile machinery as a state machine, stepped in random order: G CTAs, each with a
// producer (takes tile i first, then the next from the shared counter; issues K blocks into a ring of
// S slots; an FC2 tile's first load waits until its m-block's FC1 tiles are all done) and math
// (drains the ring in order; a tile is done when its last K block is consumed). Every run must finish
// every tile, and no wait may ever be on a tile handed out after the waiter.
struct CtaModel {
  int64_t tile = -1;         // tile the producer is issuing, -1 none
  int k_issued = 0;          // K blocks of it issued
  std::deque<int64_t> ring;  // K blocks in the ring, by tile
  int k_consumed = 0;        // K blocks of the ring's front tile consumed
  bool producer_done = false;
};

// handout: the order the counter hands tiles out in (the kernel's: 0, 1, 2, ...; empty = that).
bool run_model(const MegaTileOrder& order, int G, int S, int k1, int k2, std::mt19937& rng, int64_t* max_wait_gap,
               std::vector<int64_t> handout = {}) {
  const int64_t T1 = order.fc1_tiles(), T = T1 + order.fc2_tiles();
  if (handout.empty())
    for (int64_t u = 0; u < T; ++u) handout.push_back(u);
  const int32_t mbs = order.m_block_prefix.back();
  std::vector<int32_t> fc1_done(mbs, 0);
  std::vector<CtaModel> cta(G);
  int64_t counter = G, completed = 0;
  for (int g = 0; g < G; ++g) {
    cta[g].tile = g < T ? handout[g] : -1;
    cta[g].producer_done = g >= T;
  }
  auto k_of = [&](int64_t u) { return u < T1 ? k1 : k2; };
  for (int64_t steps = 0; steps < 100000000; ++steps) {
    if (completed == T) return true;
    // Runnable actions; a CTA may move its producer or its math.
    std::vector<std::pair<int, int>> runnable;
    for (int g = 0; g < G; ++g) {
      CtaModel& c = cta[g];
      if (!c.producer_done && static_cast<int>(c.ring.size()) < S) {
        bool ready = true;
        if (c.tile >= T1 && c.k_issued == 0) {
          const int32_t mb = order.m_block_of(c.tile);
          ready = fc1_done[mb] == order.fc1_n_blocks;
        }
        if (ready) runnable.push_back({g, 0});
      }
      if (!c.ring.empty()) runnable.push_back({g, 1});
    }
    if (runnable.empty()) return false;  // deadlock
    const auto [g, what] = runnable[rng() % runnable.size()];
    CtaModel& c = cta[g];
    if (what == 0) {
      if (c.tile >= T1 && c.k_issued == 0) {
        // The FC1 tiles it waited on were handed out before it.
        for (int64_t u = 0; u < T1; ++u)
          if (order.m_block_of(u) == order.m_block_of(c.tile)) *max_wait_gap = std::max(*max_wait_gap, u - c.tile);
      }
      c.ring.push_back(c.tile);
      if (++c.k_issued == k_of(c.tile)) {
        c.k_issued = 0;
        c.tile = counter < T ? handout[counter++] : -1;
        if (c.tile < 0) c.producer_done = true;
      }
    } else {
      const int64_t u = c.ring.front();
      c.ring.pop_front();
      if (++c.k_consumed == k_of(u)) {
        c.k_consumed = 0;
        ++completed;
        if (u < T1) fc1_done[order.m_block_of(u)]++;
      }
    }
  }
  return false;
}

TEST(MegaSchedule, TileOrderNeverDeadlocks) {
  std::mt19937 rng(2024);
  for (int it = 0; it < 300; ++it) {
    const int E = 1 + static_cast<int>(rng() % 8), bm = kMegaBlockMs[rng() % 3];
    std::vector<int32_t> offsets(E + 1, 0), begin(E), num(E), prefix(E + 1);
    for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(rng() % 5 == 0 ? 0 : rng() % 400);
    gemm::build_grouped_tables(gemm::GroupedLayout::kContiguous, E, offsets.data(), nullptr, 0, bm, begin.data(), num.data(),
                               prefix.data());
    MegaTileOrder order;
    order.m_block_prefix = prefix;
    order.fc1_n_blocks = 1 + static_cast<int32_t>(rng() % 4);
    order.fc2_n_blocks = 1 + static_cast<int32_t>(rng() % 6);
    const int G = 1 + static_cast<int>(rng() % 9), S = 3 + static_cast<int>(rng() % 4);
    const int k1 = 1 + static_cast<int>(rng() % 5), k2 = 1 + static_cast<int>(rng() % 3);
    int64_t gap = INT64_MIN;
    ASSERT_TRUE(run_model(order, G, S, k1, k2, rng, &gap))
        << "deadlock: E=" << E << " BM=" << bm << " G=" << G << " S=" << S << " tiles=" << order.fc1_tiles() << "+"
        << order.fc2_tiles();
    EXPECT_LT(gap, 0) << "an FC2 tile waited on a tile handed out after it";
  }
}

// The model is not vacuous: a handout order that gives one CTA an FC2 tile before the FC1 tile it
// needs deadlocks there (the producer blocks on the FC2 tile; the FC1 tile waits behind it).
TEST(MegaSchedule, TheModelCatchesAnOrderThatWaitsOnALaterTile) {
  MegaTileOrder order;
  order.m_block_prefix = {0, 1};
  order.fc1_n_blocks = 1;
  order.fc2_n_blocks = 1;
  std::mt19937 rng(1);
  int64_t gap = INT64_MIN;
  EXPECT_TRUE(run_model(order, 1, 3, 2, 2, rng, &gap));                   // FC1 tile 0, then FC2 tile 1
  EXPECT_FALSE(run_model(order, 1, 3, 2, 2, rng, &gap, {1, 0}));          // FC2 first: deadlock
  EXPECT_TRUE(run_model(order, 2, 3, 2, 2, rng, &gap, {1, 0}));           // two CTAs: each holds one
}

MoeGeometry geo(int64_t H, int64_t I, int64_t E, int64_t k, int64_t R, int64_t T) {
  MoeGeometry g;
  g.hidden = H;
  g.intermediate = I;
  g.num_experts = E;
  g.top_k = k;
  g.ep_size = R;
  g.max_tokens_per_rank = T;
  return g;
}

// The mega layout at T_max 8192 is no larger than routed's (issue: "the symmetric workspace at T_max
// 8192 no larger than routed's"), with its count banks and TMA-aligned pool.
TEST(MegaWorkspace, NoLargerThanRoutedAtTMax8192) {
  for (const MoeGeometry& g0 : {geo(7168, 2048, 256, 8, 1, 8192), geo(4096, 2048, 256, 6, 1, 8192),
                                geo(2048, 768, 128, 8, 1, 8192), geo(7168, 2048, 256, 8, 2, 8192),
                                geo(4096, 2048, 256, 6, 4, 8191)}) {
    MoeConfig routed, mega;
    routed.backend = Backend::kRouted;
    mega.backend = Backend::kMega;
    const WorkspaceLayout r = WorkspaceLayout::make(workspace_params(g0, routed));
    const WorkspaceLayout m = WorkspaceLayout::make(workspace_params(g0, mega));
    EXPECT_LE(m.total_bytes, r.total_bytes) << g0.hidden << " R=" << g0.ep_size;
    EXPECT_EQ(m.pool_rows % 4, 0);
    EXPECT_GE(m.pool_rows, r.pool_rows);
    EXPECT_LT(m.pool_rows, r.pool_rows + 4);
    EXPECT_EQ(m.recv_expert_counts.bytes, 2 * r.recv_expert_counts.bytes);
    EXPECT_EQ(m.pool_src.bytes, 0);
    std::printf("[mega] H=%lld R=%lld: workspace %.1f MB (routed %.1f MB)\n", static_cast<long long>(g0.hidden),
                static_cast<long long>(g0.ep_size), m.total_bytes / 1e6, r.total_bytes / 1e6);
  }
}

// nvfp4 weights run on the bf16 machinery (bf16 dispatch and intermediate), so a mega nvfp4 layer's
// workspace is a mega bf16 layer's: the same parameters (one WorkspaceKey: the layers of a geometry
// share it whatever their weight format), not the fp8 one's.
TEST(MegaWorkspace, Nvfp4WeightsTakeTheBf16Layout) {
  for (CombineDtype wire : {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {
    const MoeGeometry g = geo(7168, 2048, 256, 8, 2, 512);
    MoeConfig bf16, nvfp4, fp8;
    bf16.backend = nvfp4.backend = fp8.backend = Backend::kMega;
    bf16.combine_dtype = nvfp4.combine_dtype = fp8.combine_dtype = wire;
    bf16.weight_format = WeightFormat::kBf16;
    nvfp4.weight_format = WeightFormat::kNvfp4;
    bf16.dispatch_format = nvfp4.dispatch_format = DispatchFormat::kBf16;
    const WorkspaceParams pb = workspace_params(g, bf16), pn = workspace_params(g, nvfp4), pf = workspace_params(g, fp8);
    EXPECT_EQ(pn.dispatch_format, kWsBf16);
    EXPECT_EQ(pn.intermediate_format, kWsBf16);
    WorkspaceKey kb, kn, kf;
    kb.params = pb;
    kn.params = pn;
    kf.params = pf;
    EXPECT_FALSE(kb < kn || kn < kb) << kn.to_string() << " vs " << kb.to_string();
    EXPECT_TRUE(kf < kn || kn < kf) << "the fp8 layout is another key";
    const WorkspaceLayout lb = WorkspaceLayout::make(pb), ln = WorkspaceLayout::make(pn);
    EXPECT_EQ(ln.total_bytes, lb.total_bytes) << to_string(wire);
    EXPECT_EQ(ln.pool_x.bytes, lb.pool_x.bytes);
    EXPECT_EQ(ln.intermediate.bytes, lb.intermediate.bytes);
    EXPECT_EQ(ln.pool_x_scales.bytes, 0);
    EXPECT_EQ(ln.intermediate_scales.bytes, 0);
  }
}

TEST(MegaGate, NamesTheRule) {
  const MoeGeometry g = geo(7168, 2048, 256, 8, 1, 128);
  EXPECT_TRUE(mega_format_gate(g, MoeConfig{}).is_ok());
  MoeConfig bf16;
  bf16.weight_format = WeightFormat::kBf16;
  bf16.dispatch_format = DispatchFormat::kBf16;
  EXPECT_TRUE(mega_format_gate(g, bf16).is_ok());
  struct Case {
    MoeGeometry g;
    MoeConfig c;
    const char* needle;
  };
  std::vector<Case> cases;
  MoeConfig c;
  c.dispatch_format = DispatchFormat::kBf16;
  cases.push_back({g, c, "dispatch_format"});
  for (CombineDtype wire : {CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {  // staged sends: every wire runs
    MoeConfig q;
    q.combine_dtype = wire;
    EXPECT_TRUE(mega_format_gate(g, q).is_ok()) << to_string(wire);
  }
  MoeConfig owner;
  owner.owner_reduce = OwnerReduce::kOn;
  EXPECT_TRUE(mega_format_gate(g, owner).is_ok());
  // nvfp4 weights with a bf16 dispatch (the bf16 machinery): every wire, with and without the owner
  // reduce (w2's global scale rides in the slot weights every wire applies).
  for (CombineDtype wire : {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4})
    for (OwnerReduce o : {OwnerReduce::kAuto, OwnerReduce::kOn, OwnerReduce::kOff}) {
      MoeConfig q;
      q.weight_format = WeightFormat::kNvfp4;
      q.dispatch_format = DispatchFormat::kBf16;
      q.combine_dtype = wire;
      q.owner_reduce = o;
      ASSERT_TRUE(q.validate(g).is_ok()) << q.validate(g).to_string();
      EXPECT_TRUE(mega_format_gate(g, q).is_ok()) << to_string(wire) << " " << mega_format_gate(g, q).message();
    }
  c = MoeConfig{};
  c.in_kernel_fc2_reduce = true;  // the kFc2Reduce kernels
  EXPECT_TRUE(mega_format_gate(g, c).is_ok()) << mega_format_gate(g, c).message();
  cases.push_back({geo(2944, 2048, 256, 8, 1, 128), MoeConfig{}, "multiple of 256"});
  cases.push_back({geo(7168, 2048, 1024, 8, 1, 128), MoeConfig{}, "512 local experts"});
  cases.push_back({geo(7168, 2048, 256, 8, 1, 0), MoeConfig{}, "max_tokens_per_rank"});
  c = MoeConfig{};
  c.weight_format = WeightFormat::kNvfp4;  // with the default fp8-block dispatch
  cases.push_back({g, c, "the mega backend runs nvfp4 weights with dispatch_format=bf16"});
  c.dispatch_format = DispatchFormat::kBf16;
  c.in_kernel_fc2_reduce = true;
  EXPECT_TRUE(mega_format_gate(g, c).is_ok()) << mega_format_gate(g, c).message();
  c.in_kernel_fc2_reduce = false;
  cases.push_back({geo(2944, 2048, 256, 8, 1, 128), c, "multiple of 256"});
  for (const Case& k : cases) {
    const Status st = mega_format_gate(k.g, k.c);
    EXPECT_FALSE(st.is_ok()) << k.needle;
    EXPECT_NE(st.message().find(k.needle), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace megamoe::mega
