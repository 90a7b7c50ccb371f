// The shared-GPU group's host-side collectives (create_shared_gpu_group's machinery) with host memory
// standing in for device memory: symmetric allocation (sizes checked, every rank's address gathered,
// one record freed with the last rank's release, never waiting for a peer), peer bases, the bounded
// barrier and the broken state. The kernels' side runs in tests/gpu/test_routed.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/gpu_comm.h"
#include "comm/shared_gpu_group.h"

namespace megamoe {
namespace {

struct HostMemory {
  std::atomic<int> allocs{0}, frees{0};
  std::atomic<int> fail_on_call{-1};  // the n-th alloc call fails (0-based), -1: none
  SharedGpuMemory memory() {
    SharedGpuMemory m;
    m.alloc = [this](int, int64_t bytes, void** out) -> Status {
      const int n = allocs.fetch_add(1);
      if (n == fail_on_call.load()) return Status(StatusCode::kCudaError, "out of memory (injected)");
      *out = std::calloc(1, static_cast<size_t>(bytes));
      return Status::ok();
    };
    m.free = [this](int, void* p) {
      frees.fetch_add(1);
      std::free(p);
    };
    return m;
  }
};

void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([r, &fn] { fn(r); });
  for (auto& t : threads) t.join();
}

GpuRankComm* gpu(const std::shared_ptr<Communicator>& c) { return gpu_rank_of(c.get()); }

TEST(SharedGpuGroup, RefusesBadArguments) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  EXPECT_EQ(create_shared_gpu_group_with(0, 0, 132, mem.memory(), &ranks).code(), StatusCode::kInvalidArgument);
  const Status st = create_shared_gpu_group_with(0, 9, 132, mem.memory(), &ranks);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("size=9"), std::string::npos) << st.message();
  EXPECT_EQ(create_shared_gpu_group_with(0, 4, 3, mem.memory(), &ranks).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_shared_gpu_group_with(0, 2, 132, SharedGpuMemory{}, &ranks).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_shared_gpu_group_with(0, 2, 132, mem.memory(), nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(SharedGpuGroup, HandlesDescribeOneGroupOnOneDeviceWithAnSmBudget) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(3, 4, 132, mem.memory(), &ranks).is_ok());
  ASSERT_EQ(ranks.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ranks[r]->rank(), r);
    EXPECT_EQ(ranks[r]->size(), 4);
    EXPECT_EQ(ranks[r]->kind(), CommKind::kSharedGpu);
    EXPECT_EQ(ranks[r]->group_id(), ranks[0]->group_id());
    ASSERT_NE(gpu(ranks[r]), nullptr);
    EXPECT_EQ(gpu(ranks[r])->device(), 3);
    EXPECT_EQ(gpu(ranks[r])->sm_budget(), 33);  // 132 SMs / 4 ranks
    EXPECT_TRUE(gpu(ranks[r])->shares_device());
  }
  std::vector<std::shared_ptr<Communicator>> other;
  ASSERT_TRUE(create_shared_gpu_group_with(3, 4, 132, mem.memory(), &other).is_ok());
  EXPECT_NE(other[0]->group_id(), ranks[0]->group_id());
  std::vector<std::shared_ptr<Communicator>> one;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 1, 132, mem.memory(), &one).is_ok());
  EXPECT_FALSE(gpu(one[0])->shares_device());
  EXPECT_EQ(gpu(one[0])->sm_budget(), 132);
}

// Each logical rank's stream needs its own hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS).
TEST(SharedGpuGroup, DeviceConnectionsMustCoverEveryRank) {
  EXPECT_TRUE(check_device_connections(nullptr, 8).is_ok());  // CUDA's default: 8
  EXPECT_TRUE(check_device_connections("", 2).is_ok());
  EXPECT_TRUE(check_device_connections("4", 4).is_ok());
  EXPECT_TRUE(check_device_connections("32", 8).is_ok());
  const Status few = check_device_connections("1", 2);
  EXPECT_EQ(few.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(few.message().find("CUDA_DEVICE_MAX_CONNECTIONS=1"), std::string::npos) << few.message();
  EXPECT_NE(few.message().find("size=2"), std::string::npos) << few.message();
  for (const char* bad : {"x", "0", "-3", "4k"}) {
    const Status st = check_device_connections(bad, 2);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("CUDA_DEVICE_MAX_CONNECTIONS"), std::string::npos) << st.message();
  }
}

// A group over injected memory has no streams: shared_gpu_stream says so; other communicators are refused.
TEST(SharedGpuGroup, StreamOfAGroupWithoutStreamsIsRefused) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 2, 132, mem.memory(), &ranks).is_ok());
  void* s = reinterpret_cast<void*>(1);
  EXPECT_EQ(shared_gpu_stream(*ranks[1], &s).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s, nullptr);
  std::vector<std::shared_ptr<Communicator>> host;
  ASSERT_TRUE(create_host_group(2, &host).is_ok());
  EXPECT_EQ(shared_gpu_stream(*host[0], &s).code(), StatusCode::kInvalidArgument);
}

TEST(SharedGpuGroup, SymmetricAllocGathersEveryRanksBufferAndFreesWithTheLastRelease) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 3, 132, mem.memory(), &ranks).is_ok());
  auto& group = dynamic_cast<SharedGpuRankComm&>(*ranks[0]).group();
  std::vector<void*> base(3);
  std::vector<std::function<void(void*)>> release(3);
  std::vector<std::vector<void*>> peers(3);
  std::vector<Status> st(3);
  run_ranks(3, [&](int r) {
    st[r] = gpu(ranks[r])->symmetric_alloc(4096, &base[r], &release[r]);
    if (st[r].is_ok()) st[r] = gpu(ranks[r])->peer_bases(base[r], &peers[r]);
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
  EXPECT_EQ(mem.allocs.load(), 3);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(peers[r].size(), 3u);
    for (int p = 0; p < 3; ++p) EXPECT_EQ(peers[r][p], base[p]) << "rank " << r << " peer " << p;
    for (int i = 0; i < 4096; ++i) ASSERT_EQ(static_cast<char*>(base[r])[i], 0);  // zeroed
  }
  EXPECT_NE(base[0], base[1]);
  EXPECT_EQ(group.num_live_allocations(), 1);
  // A peer writes into rank 2's buffer as a kernel would.
  static_cast<char*>(peers[0][2])[7] = 42;
  EXPECT_EQ(static_cast<char*>(base[2])[7], 42);
  // Releases never wait for peers; nothing is freed until the last rank lets go.
  release[1](base[1]);
  release[0](base[0]);
  EXPECT_EQ(mem.frees.load(), 0);
  std::vector<void*> gone;
  EXPECT_EQ(gpu(ranks[0])->peer_bases(base[0], &gone).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu(ranks[2])->peer_bases(base[2], &gone).is_ok());  // still held by rank 2
  release[2](base[2]);
  EXPECT_EQ(mem.frees.load(), 3);
  EXPECT_EQ(group.num_live_allocations(), 0);
}

TEST(SharedGpuGroup, ReleaseAfterTheGroupIsGoneIsSafe) {
  HostMemory mem;
  void* base = nullptr;
  std::function<void(void*)> release;
  {
    std::vector<std::shared_ptr<Communicator>> ranks;
    ASSERT_TRUE(create_shared_gpu_group_with(0, 1, 132, mem.memory(), &ranks).is_ok());
    ASSERT_TRUE(gpu(ranks[0])->symmetric_alloc(64, &base, &release).is_ok());
  }
  release(base);
  EXPECT_EQ(mem.frees.load(), 1);
}

TEST(SharedGpuGroup, SizesThatDisagreeAbortTheGroupOnEveryRank) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 2, 132, mem.memory(), &ranks).is_ok());
  std::vector<Status> st(2);
  run_ranks(2, [&](int r) {
    void* b = nullptr;
    std::function<void(void*)> rel;
    st[r] = gpu(ranks[r])->symmetric_alloc(r == 0 ? 1024 : 2048, &b, &rel);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(st[r].is_ok());
    EXPECT_NE(st[r].message().find("1024"), std::string::npos) << st[r].message();
    EXPECT_NE(st[r].message().find("2048"), std::string::npos) << st[r].message();
  }
  EXPECT_EQ(mem.allocs.load(), 0);
  EXPECT_TRUE(gpu(ranks[0])->broken());
}

TEST(SharedGpuGroup, OneRanksFailedAllocationFailsEveryRankAndLeaksNothing) {
  HostMemory mem;
  mem.fail_on_call = 1;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 3, 132, mem.memory(), &ranks).is_ok());
  std::vector<Status> st(3);
  run_ranks(3, [&](int r) {
    void* b = nullptr;
    std::function<void(void*)> rel;
    st[r] = gpu(ranks[r])->symmetric_alloc(512, &b, &rel);
  });
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(st[r].is_ok()) << "rank " << r;
  EXPECT_EQ(mem.allocs.load(), 3);
  EXPECT_EQ(mem.frees.load(), 2);  // the two that succeeded gave theirs back
}

TEST(SharedGpuGroup, BarrierIsBoundedAndNamesTheMissingPeer) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 2, 132, mem.memory(), &ranks).is_ok());
  std::vector<Status> ok(2);
  run_ranks(2, [&](int r) { ok[r] = gpu(ranks[r])->barrier("first", 2000); });
  ASSERT_TRUE(ok[0].is_ok() && ok[1].is_ok());
  const auto start = std::chrono::steady_clock::now();
  const Status st = gpu(ranks[0])->barrier("release", 200);  // rank 1 never comes
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(st.code(), StatusCode::kTimeout);
  EXPECT_NE(st.message().find("release"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("[1]"), std::string::npos) << st.message();
  EXPECT_LT(ms, 2000);
  EXPECT_TRUE(gpu(ranks[1])->broken());
  EXPECT_FALSE(gpu(ranks[1])->barrier("later", 200).is_ok());  // fails fast
}

TEST(SharedGpuGroup, MarkBrokenFailsLaterCollectivesFast) {
  HostMemory mem;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group_with(0, 2, 132, mem.memory(), &ranks).is_ok());
  gpu(ranks[1])->mark_broken("rank 1 timed out at stage combine-done");
  EXPECT_TRUE(gpu(ranks[0])->broken());
  void* b = nullptr;
  std::function<void(void*)> rel;
  const Status st = gpu(ranks[0])->symmetric_alloc(64, &b, &rel);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("combine-done"), std::string::npos) << st.message();
  EXPECT_EQ(mem.allocs.load(), 0);
}

}  // namespace
}  // namespace megamoe
