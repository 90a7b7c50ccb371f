// Hardening of the routed layer on the device: faults at EP2 on two logical ranks of one GPU (a rank
// that stops launching mid-run, a rank that sends bad expert ids), two layers of different geometry
// overlapping on two streams, and an error an earlier operation left pending that the GEMM launch must
// not take for its own. Every wait is bounded: a test that would hang fails within its bound.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/gpu_comm.h"
#include "core/env.h"
#include "gpu/gpu_skip.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "reference/error_model.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::MoeProblem;
using reference::RankInputs;

MoeGeometry small_geometry(int64_t R, int64_t T, int64_t H = 512, int64_t I = 256, int64_t E = 16, int64_t k = 4) {
  MoeGeometry g;
  g.hidden = H;
  g.intermediate = I;
  g.num_experts = E;
  g.top_k = k;
  g.ep_size = R;
  g.max_tokens_per_rank = T;
  return g;
}

double rel_l2(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = fmt::bf16_to_float(a[i]), y = fmt::bf16_to_float(b[i]);
    d += std::isfinite(x) ? (x - y) * (x - y) : INFINITY;
    r += y * y;
  }
  return r > 0 ? std::sqrt(d / r) : std::sqrt(d);
}

// One rank's inputs and output on the device, with the rank's own non-blocking stream.
struct DeviceIo {
  int device = 0;
  cudaStream_t stream = nullptr;
  int64_t T = 0, H = 0, k = 0;
  void *x = nullptr, *ids = nullptr, *w = nullptr, *y = nullptr;
  ~DeviceIo() {
    for (void* p : {x, ids, w, y})
      if (p) cudaFree(p);
    if (stream) cudaStreamDestroy(stream);
  }
  void stage(int dev, const RankInputs& in, int64_t hidden, int64_t top_k) {
    device = dev;
    T = in.num_tokens;
    H = hidden;
    k = top_k;
    cudaSetDevice(dev);
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    const size_t xb = std::max<size_t>(16, T * H * 2), ib = std::max<size_t>(16, T * k * 4);
    cudaMalloc(&x, xb);
    cudaMalloc(&ids, ib);
    cudaMalloc(&w, ib);
    cudaMalloc(&y, xb);
    cudaMemcpyAsync(x, in.x_bf16.data(), T * H * 2, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(ids, in.topk_ids.data(), T * k * 4, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(w, in.topk_weights.data(), T * k * 4, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  Status forward(MoeLayer* layer) {
    cudaMemsetAsync(y, 0xFF, std::max<size_t>(16, T * H * 2), stream);
    const Device d = Device::cuda(device);
    return layer->forward(TensorView(x, DType::kBFloat16, {T, H}, d), TensorView(ids, DType::kInt32, {T, k}, d),
                          TensorView(w, DType::kFloat32, {T, k}, d), TensorView(y, DType::kBFloat16, {T, H}, d),
                          stream);
  }
  std::vector<uint16_t> output() {
    std::vector<uint16_t> v(T * H);
    cudaMemcpyAsync(v.data(), y, T * H * 2, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    return v;
  }
};

// The cpu backend's y for every rank of `problem` (host threads).
std::vector<std::vector<uint16_t>> cpu_outputs(const MoeProblem& problem, const MoeConfig& config) {
  const MoeGeometry& g = problem.geometry;
  const int R = static_cast<int>(g.ep_size);
  std::vector<std::shared_ptr<Communicator>> host;
  if (R > 1) create_host_group(R, &host);
  std::vector<std::vector<uint16_t>> out(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      MoeConfig c = config;
      c.backend = Backend::kCpu;
      std::unique_ptr<MoeLayer> layer;
      Status st = MoeLayer::create(g.for_rank(r), c, reference::local_weights(problem, r), R > 1 ? host[r] : nullptr, &layer);
      if (st.is_ok()) st = layer->warmup();
      const RankInputs& in = problem.ranks[r];
      const int64_t T = in.num_tokens, H = g.hidden, k = g.top_k;
      std::vector<uint16_t> y(T * H, 0);
      if (st.is_ok())
        st = layer->forward(TensorView(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, H}),
                            TensorView(const_cast<int32_t*>(in.topk_ids.data()), DType::kInt32, {T, k}),
                            TensorView(const_cast<float*>(in.topk_weights.data()), DType::kFloat32, {T, k}),
                            TensorView(y.data(), DType::kBFloat16, {T, H}));
      if (st.is_ok()) out[r] = std::move(y);
    });
  for (auto& t : threads) t.join();
  return out;
}

void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([r, &fn] { fn(r); });
  for (auto& t : threads) t.join();
}

// Routed layers of `problem` on a fresh group of R logical ranks of GPU 0, warmed up.
Status build_shared_group(const MoeProblem& problem, std::vector<std::unique_ptr<MoeLayer>>* layers,
                          std::vector<std::shared_ptr<Communicator>>* comms) {
  const int R = static_cast<int>(problem.geometry.ep_size);
  MEGAMOE_RETURN_IF_ERROR(create_shared_gpu_group(0, R, comms));
  layers->clear();
  layers->resize(R);
  std::vector<Status> st(R);
  run_ranks(R, [&](int r) {
    cudaSetDevice(0);
    MoeConfig c;
    c.backend = Backend::kRouted;
    st[r] = MoeLayer::create(problem.geometry.for_rank(r), c, reference::local_weights(problem, r), (*comms)[r],
                             &(*layers)[r]);
    if (st[r].is_ok()) st[r] = (*layers)[r]->warmup();
  });
  for (const Status& s : st) MEGAMOE_RETURN_IF_ERROR(s);
  return Status::ok();
}

class WaitTimeout {  // MEGAMOE_WAIT_TIMEOUT_MS for one test
 public:
  explicit WaitTimeout(int64_t ms) {
    setenv("MEGAMOE_WAIT_TIMEOUT_MS", std::to_string(ms).c_str(), 1);
    reload_env_knobs();
  }
  ~WaitTimeout() {
    unsetenv("MEGAMOE_WAIT_TIMEOUT_MS");
    reload_env_knobs();
  }
};

// The one-forward same-points bound (bf16 wire) of a rank's tokens.
double one_forward_bound(const RankInputs& in) {
  return reference::same_points_bound_one_forward(CombineDtype::kBf16, in.num_tokens).rel_l2;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A rank that stops launching mid-run: the live rank's forward returns (no hang), check_error names
// the stage and the peer within MEGAMOE_WAIT_TIMEOUT_MS + 1 s, the layer is latched broken, the
// communicator is marked broken (teardown skips collective steps), and a new layer on a fresh group
// works afterwards.
TEST(Sm90RoutedFaults, ARankThatStopsLaunchingMidRun_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const int64_t kTimeoutMs = 2000;
  WaitTimeout bound(kTimeoutMs);
  const MoeProblem problem = reference::make_random_problem(small_geometry(2, 32), 5, {32, 24});
  const auto want = cpu_outputs(problem, MoeConfig{});
  {
    std::vector<std::unique_ptr<MoeLayer>> layers;
    std::vector<std::shared_ptr<Communicator>> comms;
    ASSERT_TRUE(build_shared_group(problem, &layers, &comms).is_ok());
    std::vector<DeviceIo> io(2);
    for (int r = 0; r < 2; ++r) io[r].stage(0, problem.ranks[r], 512, 4);
    std::vector<Status> st(2);
    for (int it = 0; it < 3; ++it) {  // healthy forwards first
      run_ranks(2, [&](int r) {
        cudaSetDevice(0);
        st[r] = io[r].forward(layers[r].get());
        if (st[r].is_ok()) st[r] = layers[r]->check_error(io[r].stream);
      });
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
        EXPECT_LE(rel_l2(io[r].output(), want[r]), one_forward_bound(problem.ranks[r])) << "rank " << r;
      }
    }
    // Rank 1 stops: only rank 0 launches.
    cudaSetDevice(0);
    const auto t0 = std::chrono::steady_clock::now();
    Status fwd = io[0].forward(layers[0].get());
    Status err = fwd.is_ok() ? layers[0]->check_error(io[0].stream) : fwd;
    const double secs = seconds_since(t0);
    std::printf("[faults] stopped peer: rank 0 got after %.2f s: %s\n", secs, err.to_string().c_str());
    EXPECT_EQ(err.code(), StatusCode::kTimeout) << err.to_string();
    EXPECT_NE(err.message().find("dispatch-done"), std::string::npos) << err.message();
    EXPECT_NE(err.message().find("peer rank 1"), std::string::npos) << err.message();
    EXPECT_LT(secs, kTimeoutMs / 1000.0 + 1.0);
    const Status later = io[0].forward(layers[0].get());
    EXPECT_FALSE(later.is_ok());  // latched
    EXPECT_NE(later.message().find("earlier forward"), std::string::npos) << later.message();
    EXPECT_TRUE(gpu_rank_of(comms[0].get())->broken());
    // Teardown of the broken group: bounded (no collective step waits for anyone).
    const auto t1 = std::chrono::steady_clock::now();
    run_ranks(2, [&](int r) {
      cudaSetDevice(0);
      layers[r].reset();
    });
    EXPECT_LT(seconds_since(t1), kTimeoutMs / 1000.0 + 1.0);
  }
  // A fresh group works.
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<std::shared_ptr<Communicator>> comms;
  ASSERT_TRUE(build_shared_group(problem, &layers, &comms).is_ok());
  std::vector<DeviceIo> io(2);
  for (int r = 0; r < 2; ++r) io[r].stage(0, problem.ranks[r], 512, 4);
  std::vector<Status> st(2);
  run_ranks(2, [&](int r) {
    cudaSetDevice(0);
    st[r] = io[r].forward(layers[r].get());
    if (st[r].is_ok()) st[r] = layers[r]->check_error(io[r].stream);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
    EXPECT_LE(rel_l2(io[r].output(), want[r]), one_forward_bound(problem.ranks[r])) << "rank " << r;
  }
}

// error_pending() polled on the host while rank 0's forward waits for a rank that stopped launching:
// every call returns at once (no host sync: a synchronising call would block for the whole wait),
// it is false while the wait runs, turns true within MEGAMOE_WAIT_TIMEOUT_MS + 1 s, and check_error()
// then reports the timeout with stage and peer.
TEST(Sm90RoutedFaults, ErrorPendingSeesAStoppedPeerWithoutASync_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const int64_t kTimeoutMs = 2000;
  WaitTimeout bound(kTimeoutMs);
  const MoeProblem problem = reference::make_random_problem(small_geometry(2, 32), 7, {32, 24});
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<std::shared_ptr<Communicator>> comms;
  ASSERT_TRUE(build_shared_group(problem, &layers, &comms).is_ok());
  std::vector<DeviceIo> io(2);
  for (int r = 0; r < 2; ++r) io[r].stage(0, problem.ranks[r], 512, 4);
  std::vector<Status> st(2);
  std::vector<int> pending_after_healthy(2, -1);
  run_ranks(2, [&](int r) {  // a healthy forward: nothing pending, now or once the snapshots are in
    cudaSetDevice(0);
    st[r] = io[r].forward(layers[r].get());
    if (st[r].is_ok()) st[r] = layers[r]->check_error(io[r].stream);
    bool any = false;
    for (int i = 0; i < 5 && st[r].is_ok(); ++i) {
      bool p = true;
      st[r] = layers[r]->error_pending(&p);
      any = any || p;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pending_after_healthy[r] = any ? 1 : 0;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].to_string();
    EXPECT_EQ(pending_after_healthy[r], 0) << "rank " << r;
  }
  // Rank 1 stops: only rank 0 launches, then polls.
  cudaSetDevice(0);
  ASSERT_TRUE(io[0].forward(layers[0].get()).is_ok());
  const auto t0 = std::chrono::steady_clock::now();
  bool pending = false;
  double longest_call = 0, pending_at = -1;
  int calls = 0;
  while (seconds_since(t0) < kTimeoutMs / 1000.0 + 1.0) {
    const auto c0 = std::chrono::steady_clock::now();
    const Status p = layers[0]->error_pending(&pending);
    longest_call = std::max(longest_call, seconds_since(c0));
    ++calls;
    ASSERT_TRUE(p.is_ok()) << p.to_string();
    if (pending) {
      pending_at = seconds_since(t0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("[faults] error_pending: true after %.3f s (%d calls, longest call %.1f us; wait bound %lld ms)\n",
              pending_at, calls, longest_call * 1e6, static_cast<long long>(kTimeoutMs));
  ASSERT_TRUE(pending) << "error_pending() still false " << kTimeoutMs << " ms + 1 s after the peer stopped";
  EXPECT_GE(pending_at, 0.9 * kTimeoutMs / 1000.0) << "pending before the wait could have timed out";
  EXPECT_LT(longest_call, 0.1) << "an error_pending() call waited for the device";
  bool still = false;
  ASSERT_TRUE(layers[0]->error_pending(&still).is_ok());
  EXPECT_TRUE(still) << "pending stays set until check_error()";
  const Status err = layers[0]->check_error(io[0].stream);
  EXPECT_EQ(err.code(), StatusCode::kTimeout) << err.to_string();
  EXPECT_NE(err.message().find("dispatch-done"), std::string::npos) << err.message();
  EXPECT_NE(err.message().find("peer rank 1"), std::string::npos) << err.message();
  run_ranks(2, [&](int r) {  // teardown of the broken group: bounded
    cudaSetDevice(0);
    layers[r].reset();
  });
}

// Bad expert ids from rank 1: its error_pending() turns true once the snapshot is in (bounded poll),
// check_error() reports the first bad slot and clears the counters, and error_pending() is false again
// afterwards (the group is healthy). After release(): refused.
TEST(Sm90RoutedFaults, ErrorPendingSeesBadIdsAndClearsWithCheckError_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  WaitTimeout bound(2000);
  MoeProblem problem = reference::make_random_problem(small_geometry(2, 32), 8, {32, 32});
  problem.ranks[1].topk_ids[4 * 4 + 2] = 16 + 3;  // token 4, slot 2
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<std::shared_ptr<Communicator>> comms;
  ASSERT_TRUE(build_shared_group(problem, &layers, &comms).is_ok());
  std::vector<DeviceIo> io(2);
  for (int r = 0; r < 2; ++r) io[r].stage(0, problem.ranks[r], 512, 4);
  std::vector<Status> st(2), err(2);
  std::vector<int> seen(2, -1), after(2, -1);
  run_ranks(2, [&](int r) {
    cudaSetDevice(0);
    st[r] = io[r].forward(layers[r].get());
    if (st[r].is_ok()) st[r] = cudaStreamSynchronize(io[r].stream) == cudaSuccess ? Status::ok() : Status(StatusCode::kCudaError, "sync");
    bool p = false;
    const auto t0 = std::chrono::steady_clock::now();
    while (st[r].is_ok() && !p && seconds_since(t0) < 1.0) {
      st[r] = layers[r]->error_pending(&p);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    seen[r] = p ? 1 : 0;
    err[r] = layers[r]->check_error(io[r].stream);
    bool any = false;
    for (int i = 0; i < 5 && st[r].is_ok(); ++i) {
      st[r] = layers[r]->error_pending(&p);
      any = any || p;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    after[r] = any ? 1 : 0;
  });
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  EXPECT_EQ(seen[0], 0) << "rank 0 sent good ids";
  EXPECT_EQ(seen[1], 1) << "rank 1's bad ids never showed in error_pending()";
  EXPECT_TRUE(err[0].is_ok()) << err[0].to_string();
  EXPECT_EQ(err[1].code(), StatusCode::kInvalidArgument) << err[1].to_string();
  EXPECT_NE(err[1].message().find("topk_ids[4, 2]=19"), std::string::npos) << err[1].message();
  EXPECT_EQ(after[0], 0);
  EXPECT_EQ(after[1], 0) << "check_error() cleared the counters: nothing pending";
  std::vector<Status> rel(2);
  run_ranks(2, [&](int r) {
    cudaSetDevice(0);
    rel[r] = layers[r]->release();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(rel[r].is_ok()) << rel[r].to_string();
    bool p = true;
    const Status s = layers[r]->error_pending(&p);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
    EXPECT_NE(s.message().find("error_pending() after release()"), std::string::npos) << s.message();
    EXPECT_FALSE(p);
  }
}

// A rank that sends bad expert ids: no hang; the sender's check_error names the first bad token, slot
// and value; the bad slots count as -1, so every rank's output is the cpu backend's for the ids with
// those slots dropped; the group keeps working.
TEST(Sm90RoutedFaults, ARankThatSendsBadExpertIds_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  WaitTimeout bound(2000);
  MoeProblem problem = reference::make_random_problem(small_geometry(2, 32), 6, {32, 32});
  MoeProblem dropped = problem;
  const int64_t k = 4;
  problem.ranks[1].topk_ids[3 * k + 1] = 16 + 5;  // first bad: token 3, slot 1
  problem.ranks[1].topk_ids[9 * k + 2] = -7;
  dropped.ranks[1].topk_ids[3 * k + 1] = -1;
  dropped.ranks[1].topk_ids[9 * k + 2] = -1;
  const auto want = cpu_outputs(dropped, MoeConfig{});
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<std::shared_ptr<Communicator>> comms;
  ASSERT_TRUE(build_shared_group(problem, &layers, &comms).is_ok());
  std::vector<DeviceIo> io(2);
  for (int r = 0; r < 2; ++r) io[r].stage(0, problem.ranks[r], 512, 4);
  for (int it = 0; it < 2; ++it) {
    std::vector<Status> st(2);
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(2, [&](int r) {
      cudaSetDevice(0);
      st[r] = io[r].forward(layers[r].get());
      if (st[r].is_ok()) st[r] = layers[r]->check_error(io[r].stream);
    });
    EXPECT_LT(seconds_since(t0), 3.0);
    EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
    EXPECT_EQ(st[1].code(), StatusCode::kInvalidArgument) << st[1].to_string();
    EXPECT_NE(st[1].message().find("topk_ids[3, 1]=21"), std::string::npos) << st[1].message();
    for (int r = 0; r < 2; ++r)
      EXPECT_LE(rel_l2(io[r].output(), want[r]), one_forward_bound(problem.ranks[r])) << "rank " << r << " iteration " << it;
  }
}

// Two layers of different geometry overlap on two streams (issued from one thread, no
// synchronisation in between): they share nothing mutable (their scratch and tile counters are their
// own), so every output equals the one of a forward alone.
TEST(Sm90RoutedSharing, TwoLayersOfDifferentGeometryOverlapOnTwoStreams_EP1) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  const MoeProblem pa = reference::make_random_problem(small_geometry(1, 64), 1, {64});
  const MoeProblem pb = reference::make_random_problem(small_geometry(1, 96, 1024, 512, 32, 8), 2, {96});
  MoeConfig c;
  c.backend = Backend::kRouted;
  std::unique_ptr<MoeLayer> la, lb;
  ASSERT_TRUE(MoeLayer::create(pa.geometry, c, reference::local_weights(pa, 0), nullptr, &la).is_ok());
  ASSERT_TRUE(MoeLayer::create(pb.geometry, c, reference::local_weights(pb, 0), nullptr, &lb).is_ok());
  ASSERT_TRUE(la->warmup().is_ok());
  ASSERT_TRUE(lb->warmup().is_ok());
  constexpr int kIters = 8;
  std::vector<DeviceIo> a(kIters), b(kIters);
  for (int i = 0; i < kIters; ++i) {
    a[i].stage(0, pa.ranks[0], 512, 4);
    b[i].stage(0, pb.ranks[0], 1024, 8);
  }
  // Alone first (the reference bits).
  ASSERT_TRUE(a[0].forward(la.get()).is_ok());
  ASSERT_TRUE(la->check_error(a[0].stream).is_ok());
  ASSERT_TRUE(b[0].forward(lb.get()).is_ok());
  ASSERT_TRUE(lb->check_error(b[0].stream).is_ok());
  const auto ya = a[0].output(), yb = b[0].output();
  const auto want_a = cpu_outputs(pa, MoeConfig{}), want_b = cpu_outputs(pb, MoeConfig{});
  EXPECT_LE(rel_l2(ya, want_a[0]), one_forward_bound(pa.ranks[0]));
  EXPECT_LE(rel_l2(yb, want_b[0]), one_forward_bound(pb.ranks[0]));
  // Each layer on its own stream (iteration i of a layer after its iteration i - 1, by an event).
  cudaEvent_t ev_a, ev_b;
  cudaEventCreateWithFlags(&ev_a, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&ev_b, cudaEventDisableTiming);
  for (int i = 1; i < kIters; ++i) {
    cudaStreamWaitEvent(a[i].stream, ev_a);
    cudaStreamWaitEvent(b[i].stream, ev_b);
    ASSERT_TRUE(a[i].forward(la.get()).is_ok());
    ASSERT_TRUE(b[i].forward(lb.get()).is_ok());
    cudaEventRecord(ev_a, a[i].stream);
    cudaEventRecord(ev_b, b[i].stream);
  }
  for (int i = 1; i < kIters; ++i) {
    ASSERT_TRUE(la->check_error(a[i].stream).is_ok());
    ASSERT_TRUE(lb->check_error(b[i].stream).is_ok());
    EXPECT_EQ(a[i].output(), ya) << "layer A, iteration " << i;
    EXPECT_EQ(b[i].output(), yb) << "layer B, iteration " << i;
  }
  cudaEventDestroy(ev_a);
  cudaEventDestroy(ev_b);
}

// An error an earlier asynchronous operation left pending is reported as that by the GEMM launcher,
// not as the GEMM's launch failure.
TEST(Sm90GemmErrors, APendingErrorIsNotBlamedOnTheGemm) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  void* junk = nullptr;
  ASSERT_EQ(cudaMalloc(&junk, 1 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemset(junk, 0, 1 << 20), cudaSuccess);
  // A refused call leaves its (non-sticky) error as the thread's last error.
  ASSERT_NE(cudaMemset(reinterpret_cast<void*>(uintptr_t(16)), 0, 16), cudaSuccess);
  gemm::GroupedGemmArgs g;
  g.dtype = gemm::GemmDtype::kBf16;
  g.epilogue = gemm::GemmEpilogue::kStoreBf16;
  g.num_experts = 1;
  g.n = 128;
  g.k = 128;
  g.a = g.b = g.d = junk;
  g.m_rows = 16;
  int32_t* offsets = static_cast<int32_t*>(junk);
  g.expert_offsets = offsets;  // zeros: no rows
  const Status st = gemm::launch_grouped_gemm(g, nullptr);
  cudaDeviceSynchronize();
  cudaFree(junk);
  if (st.is_ok()) GTEST_SKIP() << "the runtime left no error pending after the refused call";
  EXPECT_NE(st.message().find("pending before the grouped GEMM launch"), std::string::npos) << st.message();
  EXPECT_EQ(st.message().find("grouped GEMM launch failed"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe
