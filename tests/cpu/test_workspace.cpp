// Workspace layout and pool: sized from the per-rank bound only; shared between layers of one key.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "megamoe/workspace.h"

namespace megamoe {
namespace {

MoeGeometry deepseek(int64_t ep, int64_t t) {
  MoeGeometry g;
  g.hidden = 7168;
  g.intermediate = 2048;
  g.num_experts = 256;
  g.top_k = 8;
  g.ep_size = ep;
  g.max_tokens_per_rank = t;
  return g;
}

int64_t total(const MoeGeometry& g, const MoeConfig& c) { return WorkspaceLayout::make(workspace_params(g, c)).total_bytes; }

TEST(WorkspaceLayout, RegionsAreAlignedOrderedAndDisjoint) {
  MoeConfig c;
  WorkspaceLayout l = WorkspaceLayout::make(workspace_params(deepseek(8, 1000), c));
  int64_t prev_end = 0;
  for (int i = 0; i < WorkspaceLayout::kNumRegions; ++i) {
    const WorkspaceRegion& r = l.region(i);
    EXPECT_EQ(r.offset % WorkspaceLayout::kAlign, 0) << WorkspaceLayout::region_name(i);
    EXPECT_GE(r.offset, prev_end) << WorkspaceLayout::region_name(i);
    EXPECT_GE(r.bytes, 0);
    prev_end = r.end();
  }
  EXPECT_GE(l.total_bytes, prev_end);
}

TEST(WorkspaceLayout, RegionSizesFollowTheirFormulas) {
  MoeConfig c;  // fp8 dispatch, fp8 intermediate, bf16 combine
  const int64_t R = 8, T = 1000, El = 32, k = 8, H = 7168, I = 2048;
  WorkspaceLayout l = WorkspaceLayout::make(workspace_params(deepseek(R, T), c));
  EXPECT_EQ(l.params.segment_align, 1);   // layers do not pad expert segments
  const int64_t P = R * T * k;            // every (token, local expert) pair once
  EXPECT_EQ(El, l.params.experts_per_rank);
  // An aligned pool (the layout supports it) adds each expert's padding.
  WorkspaceParams aligned = l.params;
  aligned.segment_align = 128;
  EXPECT_EQ(WorkspaceLayout::make(aligned).pool_rows, (R * T * k + El * 127 + 127) / 128 * 128);
  EXPECT_EQ(l.pool_rows, P);
  EXPECT_EQ(l.recv_tokens.bytes, R * T * H);
  EXPECT_EQ(l.recv_scales.bytes, R * T * (H / 128) * 4);
  EXPECT_EQ(l.recv_meta.bytes, R * T * (((1 + 2 * k) * 4 + 15) / 16 * 16));
  EXPECT_EQ(l.pool_x.bytes, P * H);
  EXPECT_EQ(l.intermediate.bytes, P * I);
  EXPECT_EQ(l.intermediate_scales.bytes, P * (I / 128) * 4);
  EXPECT_EQ(l.combine.bytes, T * k * 2 * H);
  EXPECT_EQ(l.recv_expert_counts.bytes, R * El * 4);
}

// The pool's M-major scale arrays have leading dimension P, and the GEMM needs it to be a multiple
// of 4 (16-byte TMA rows): top-2 at T_max = 1 (mixtral-8x7b EP1) has 2 pairs, top-6 at T_max = 33
// (deepseek-v4-flash EP1) 198.
TEST(WorkspaceLayout, PoolRowsAreAMultipleOfFour) {
  MoeConfig c;
  struct Row { int64_t E, k, R, T, pairs; };
  for (const Row& r : {Row{8, 2, 1, 1, 2}, Row{256, 6, 1, 33, 198}, Row{16, 3, 1, 7, 21}, Row{16, 4, 2, 0, 0},
                       Row{256, 8, 2, 1023, 16368}}) {
    MoeGeometry g = deepseek(r.R, r.T);
    g.num_experts = r.E;
    g.top_k = r.k;
    const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
    SCOPED_TRACE(g.to_string());
    EXPECT_EQ(l.pool_rows % 4, 0);
    EXPECT_GE(l.pool_rows, r.pairs);
    EXPECT_LT(l.pool_rows, r.pairs + 4);
  }
  for (int64_t sa : {1, 2, 3, 6, 128}) {
    WorkspaceParams p = workspace_params(deepseek(1, 33), c);
    p.segment_align = sa;
    const int64_t P = WorkspaceLayout::make(p).pool_rows;
    EXPECT_EQ(P % 4, 0) << "segment_align " << sa;
    EXPECT_EQ(P % sa, 0) << "segment_align " << sa;
  }
}

TEST(WorkspaceLayout, MinOfTopKAndLocalExpertsBoundsThePool) {
  MoeConfig c;
  // EP 64: 4 experts per rank < top-8, so a token brings at most 4 rows to a rank.
  WorkspaceLayout l = WorkspaceLayout::make(workspace_params(deepseek(64, 100), c));
  EXPECT_EQ(l.pool_rows, 64 * 100 * 4);
}

TEST(WorkspaceLayout, SizeIsAffineInMaxTokensWithNoDpFactor) {
  MoeConfig c;
  for (int64_t ep : {1, 2, 8}) {
    const int64_t s1 = total(deepseek(ep, 1024), c), s2 = total(deepseek(ep, 2048), c),
                  s3 = total(deepseek(ep, 3072), c), s4 = total(deepseek(ep, 4096), c);
    // Equal increments for equal steps (up to 256-byte alignment of each region).
    const int64_t slack = WorkspaceLayout::kNumRegions * WorkspaceLayout::kAlign;
    EXPECT_LE(std::llabs((s2 - s1) - (s3 - s2)), slack);
    EXPECT_LE(std::llabs((s4 - s3) - (s2 - s1)), slack);
    EXPECT_GT(s2, s1);
  }
  // The T-proportional term is exactly the per-rank formula: per token of T_max, R receive rows
  // (tokens, scales, meta), R*min(k, E_l) pool rows (src index, x, x scales, intermediate and its
  // scales) and k combine rows. Nothing multiplies T_max by a dp factor.
  const int64_t R = 2, k = 8, H = 7168, I = 2048, meta = ((1 + 2 * k) * 4 + 15) / 16 * 16;
  const int64_t per_token = R * (H + H / 128 * 4 + meta) + R * k * (4 + H + H / 128 * 4 + I + I / 128 * 4) + k * 2 * H;
  const int64_t step = total(deepseek(R, 2048), c) - total(deepseek(R, 1024), c);
  EXPECT_LE(std::llabs(step - 1024 * per_token), WorkspaceLayout::kNumRegions * WorkspaceLayout::kAlign);
}

TEST(WorkspaceLayout, FormatsChangeTheRightRegions) {
  MoeGeometry g = deepseek(2, 64);
  MoeConfig c;
  c.dispatch_format = DispatchFormat::kBf16;
  c.weight_format = WeightFormat::kBf16;
  c.owner_reduce = OwnerReduce::kOff;  // per-slot combine rows: 8 per token in every wire format
  WorkspaceLayout bf = WorkspaceLayout::make(workspace_params(g, c));
  EXPECT_EQ(bf.recv_scales.bytes, 0);
  EXPECT_EQ(bf.intermediate_scales.bytes, 0);
  EXPECT_EQ(bf.recv_tokens.bytes, 2 * 64 * 7168 * 2);
  c.combine_dtype = CombineDtype::kNvfp4;
  EXPECT_EQ(WorkspaceLayout::make(workspace_params(g, c)).combine.bytes, 64 * 8 * (7168 / 2 + 7168 / 16 + 4));
  c.combine_dtype = CombineDtype::kMxfp8;
  EXPECT_EQ(WorkspaceLayout::make(workspace_params(g, c)).combine.bytes, 64 * 8 * (7168 + 7168 / 32));
  c.combine_dtype = CombineDtype::kBf16;
  c.in_kernel_fc2_reduce = true;
  WorkspaceParams p = workspace_params(g, c);
  EXPECT_EQ(WorkspaceLayout::make(p).combine.bytes, 0);  // the cpu protocol adds into y itself
  p.mega = 1;  // mega's accumulation rows: one bf16 row per token
  EXPECT_EQ(WorkspaceLayout::make(p).combine.bytes, 64 * 7168 * 2);
}

// One combine row per (token, owner rank) instead of per (token, slot); every other region unchanged.
TEST(WorkspaceLayout, OwnerReduceSizesTheCombineByRanks) {
  for (int64_t R : {2, 4, 16}) {
    const MoeGeometry g = deepseek(R, 64);
    for (CombineDtype d : {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {
      MoeConfig c;
      c.combine_dtype = d;
      EXPECT_EQ(workspace_params(g, c).owner_reduce, d == CombineDtype::kBf16 ? 0 : 1);  // auto
      c.owner_reduce = OwnerReduce::kOff;
      const WorkspaceLayout per_slot = WorkspaceLayout::make(workspace_params(g, c));
      c.owner_reduce = OwnerReduce::kOn;
      const WorkspaceParams p = workspace_params(g, c);
      EXPECT_EQ(p.owner_reduce, 1);
      EXPECT_EQ(WorkspaceLayout::combine_rows_per_token(p), R);
      const WorkspaceLayout owner = WorkspaceLayout::make(p);
      const int64_t wire = combine_row_bytes(p.combine_format, 7168);
      EXPECT_EQ(owner.wire_row_bytes, wire);
      EXPECT_EQ(per_slot.combine.bytes, 64 * 8 * wire) << "R=" << R << " " << to_string(d);
      EXPECT_EQ(owner.combine.bytes, 64 * R * wire) << "R=" << R << " " << to_string(d);
      for (int i = 0; i < WorkspaceLayout::kNumRegions; ++i) {
        if (&owner.region(i) == &owner.combine) continue;
        EXPECT_EQ(owner.region(i).bytes, per_slot.region(i).bytes) << WorkspaceLayout::region_name(i);
      }
    }
  }
}

TEST(WorkspaceLayout, ZeroTokensNeedNoPool) {
  MoeConfig c;
  WorkspaceLayout l = WorkspaceLayout::make(workspace_params(deepseek(2, 0), c));
  EXPECT_EQ(l.pool_rows, 0);
  EXPECT_EQ(l.recv_tokens.bytes, 0);
  EXPECT_GT(l.signals.bytes, 0);
}

// ---- pool ----

struct CountingAllocator {
  int allocations = 0, frees = 0;
  WorkspacePool::Allocator fn() {
    return [this](int64_t bytes, void** base, std::function<void(void*)>* release) {
      ++allocations;
      *base = std::malloc(static_cast<size_t>(bytes > 0 ? bytes : 1));
      *release = [this](void* p) {
        ++frees;
        std::free(p);
      };
      return Status::ok();
    };
  }
};

WorkspaceKey key_for(const MoeGeometry& g, const MoeConfig& c, uint64_t group = 7) {
  WorkspaceKey k;
  k.params = workspace_params(g, c);
  k.ep_rank = g.ep_rank;
  k.group_id = group;
  k.device = Device::cpu();
  return k;
}

TEST(WorkspacePool, SameGeometrySharesOneRefcountedWorkspace) {
  WorkspacePool pool;
  CountingAllocator alloc;
  MoeGeometry g = deepseek(2, 16);
  MoeConfig c;
  std::shared_ptr<Workspace> a, b, d;
  ASSERT_TRUE(pool.acquire(key_for(g, c), alloc.fn(), &a).is_ok());
  ASSERT_TRUE(pool.acquire(key_for(g, c), alloc.fn(), &b).is_ok());  // a second layer, same geometry
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(alloc.allocations, 1);
  EXPECT_EQ(pool.num_live(), 1);
  a.reset();
  EXPECT_EQ(alloc.frees, 0);  // still used by b
  b.reset();
  EXPECT_EQ(alloc.frees, 1);  // last user gone
  EXPECT_EQ(pool.num_live(), 0);
  ASSERT_TRUE(pool.acquire(key_for(g, c), alloc.fn(), &d).is_ok());
  EXPECT_EQ(alloc.allocations, 2);
}

TEST(WorkspacePool, DifferentGeometryOptionsRankOrGroupNeverShare) {
  WorkspacePool pool;
  CountingAllocator alloc;
  MoeGeometry g = deepseek(2, 16);
  MoeConfig c;
  std::shared_ptr<Workspace> base, other;
  ASSERT_TRUE(pool.acquire(key_for(g, c), alloc.fn(), &base).is_ok());
  auto expect_distinct = [&](const WorkspaceKey& k) {
    std::shared_ptr<Workspace> w;
    ASSERT_TRUE(pool.acquire(k, alloc.fn(), &w).is_ok());
    EXPECT_NE(w.get(), base.get()) << k.to_string();
  };
  MoeGeometry g2 = g;
  g2.max_tokens_per_rank = 32;
  expect_distinct(key_for(g2, c));
  g2 = g;
  g2.ep_rank = 1;
  expect_distinct(key_for(g2, c));
  MoeConfig c2 = c;
  c2.combine_dtype = CombineDtype::kMxfp8;
  expect_distinct(key_for(g, c2));
  c2 = c;
  c2.in_kernel_fc2_reduce = true;
  expect_distinct(key_for(g, c2));
  c2 = c;
  c2.owner_reduce = OwnerReduce::kOn;  // the combine region holds other rows
  EXPECT_NE(key_for(g, c2).to_string().find("owner_reduce=1"), std::string::npos) << key_for(g, c2).to_string();
  EXPECT_TRUE(key_for(g, c) < key_for(g, c2) || key_for(g, c2) < key_for(g, c));
  expect_distinct(key_for(g, c2));
  c2 = c;
  c2.knobs.block_m = 64;  // a GEMM tile, not a layout choice: layers of other knobs share
  EXPECT_FALSE(key_for(g, c2) < key_for(g, c) || key_for(g, c) < key_for(g, c2));
  expect_distinct(key_for(g, c, /*group=*/8));
  WorkspaceKey on_gpu = key_for(g, c);
  on_gpu.device = Device::cuda(0);
  expect_distinct(on_gpu);
}

// One key is allocated once, however many threads of the rank acquire it at the same time: a second
// collective allocation would have no partner on the peers (they allocate the key once) and hang or
// mismatch the group.
TEST(WorkspacePool, ThreadsAcquiringOneKeyTogetherAllocateItOnce) {
  WorkspacePool pool;
  std::atomic<int> allocations{0};
  auto slow = [&](int64_t bytes, void** base, std::function<void(void*)>* release) {
    ++allocations;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a collective step in progress
    *base = std::malloc(static_cast<size_t>(bytes));
    *release = [](void* p) { std::free(p); };
    return Status::ok();
  };
  const WorkspaceKey key = key_for(deepseek(2, 16), MoeConfig{});
  std::vector<std::shared_ptr<Workspace>> got(4);
  std::vector<Status> st(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { st[i] = pool.acquire(key, slow, &got[i]); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(st[i].is_ok()) << st[i].to_string();
    EXPECT_EQ(got[i].get(), got[0].get());
  }
  EXPECT_EQ(allocations.load(), 1);
  EXPECT_EQ(pool.num_live(), 1);
}

TEST(WorkspacePool, AThreadWaitingForAFailedAllocationGetsItsErrorAndARetryWorks) {
  WorkspacePool pool;
  std::atomic<int> calls{0};
  auto flaky = [&](int64_t bytes, void** base, std::function<void(void*)>* release) -> Status {
    if (calls.fetch_add(1) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return Status(StatusCode::kTimeout, "peer rank 1 did not arrive at symmetric-alloc");
    }
    *base = std::malloc(static_cast<size_t>(bytes));
    *release = [](void* p) { std::free(p); };
    return Status::ok();
  };
  const WorkspaceKey key = key_for(deepseek(2, 16), MoeConfig{});
  std::shared_ptr<Workspace> a, b;
  Status sa, sb;
  std::thread first([&] { sa = pool.acquire(key, flaky, &a); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::thread second([&] { sb = pool.acquire(key, flaky, &b); });
  first.join();
  second.join();
  EXPECT_EQ(sa.code(), StatusCode::kTimeout);
  EXPECT_EQ(sb.code(), StatusCode::kTimeout) << sb.to_string();
  EXPECT_NE(sb.message().find("peer rank 1"), std::string::npos) << sb.message();
  EXPECT_EQ(calls.load(), 1);  // the waiter did not allocate on its own
  EXPECT_EQ(pool.num_live(), 0);
  ASSERT_TRUE(pool.acquire(key, flaky, &a).is_ok());  // retryable
  EXPECT_EQ(pool.num_live(), 1);
}

TEST(WorkspacePool, AllocationFailureIsReported) {
  WorkspacePool pool;
  std::shared_ptr<Workspace> w;
  Status st = pool.acquire(key_for(deepseek(2, 16), MoeConfig{}),
                           [](int64_t, void**, std::function<void(void*)>*) {
                             return Status(StatusCode::kCudaError, "out of memory");
                           },
                           &w);
  EXPECT_EQ(st.code(), StatusCode::kCudaError);
  EXPECT_EQ(w, nullptr);
  EXPECT_EQ(pool.num_live(), 0);
}

}  // namespace
}  // namespace megamoe
