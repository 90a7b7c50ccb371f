// layer_harness.h — the GPU layer tests' group harness: an EP group of a GPU backend (one GPU per rank
// over NCCL, or R logical ranks sharing GPU 0) beside the cpu backend on the same inputs, driven one
// thread per rank; rel-L2 helpers. Header-only, for the tests of tests/gpu.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "reference/problem.h"
#include "rank_stream.h"

namespace megamoe::gpu_test {

using reference::MoeProblem;
using reference::RankInputs;

// Squared difference and squared reference norm, so rel-L2 can be pooled over many outputs.
struct L2Sums {
  double diff = 0, ref = 0;
  void add(const std::vector<uint16_t>& y, const std::vector<uint16_t>& ref_y) {
    for (size_t i = 0; i < y.size(); ++i) {
      const double a = fmt::bf16_to_float(y[i]), b = fmt::bf16_to_float(ref_y[i]);
      diff += std::isfinite(a) ? (a - b) * (a - b) : INFINITY;
      ref += b * b;
    }
  }
  double rel() const { return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff); }
};

inline double rel_l2_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  L2Sums s;  // a poisoned (never written) element or a NaN makes it infinite
  s.add(a, b);
  return s.rel();
}

// A reusable barrier of n host threads (C++17 has no std::barrier).
class PhaseBarrier {
 public:
  explicit PhaseBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(m_);
    const int64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }

 private:
  const int n_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  std::mutex m_;
  std::condition_variable cv_;
};

// How the ranks of an EP > 1 group are connected.
enum class GroupKind { kNcclGpus, kSharedGpu };
inline const char* group_suffix(GroupKind k) { return k == GroupKind::kSharedGpu ? "SharedGpu" : "Gpus"; }

// One EP group of a GPU backend (GPUs 0..R-1, or R logical ranks on GPU 0) beside one of the cpu
// backend (host threads). With `extra` problems (same geometry, other weights) every rank holds one
// more layer pair per problem, built on the same communicators, so the layers of a geometry share one
// workspace; run(..., layer) runs one of them.
class Harness {
 public:
  Harness(const MoeProblem& p, const MoeConfig& c, GroupKind kind = GroupKind::kNcclGpus,
          Backend gpu_backend = Backend::kRouted, std::vector<const MoeProblem*> extra = {})
      : problem_(p), config_(c), R_(static_cast<int>(p.geometry.ep_size)), kind_(kind), backend_(gpu_backend),
        problems_{&p} {
    for (const MoeProblem* e : extra) problems_.push_back(e);
  }
  int num_layers() const { return static_cast<int>(problems_.size()); }
  MoeLayer* gpu_layer(int r, int layer = 0) { return gpu_[layer * R_ + r].get(); }

  int device_of(int r) const { return kind_ == GroupKind::kSharedGpu ? 0 : r; }

  ::testing::AssertionResult build() {
    const MoeGeometry& g = problem_.geometry;
    std::vector<int> devices;
    for (int r = 0; r < R_; ++r) devices.push_back(r);
    std::vector<std::shared_ptr<Communicator>> nccl, host;
    if (R_ > 1) {
      Status st = kind_ == GroupKind::kSharedGpu ? create_shared_gpu_group(0, R_, &nccl) : create_nccl_group(devices, &nccl);
      if (!st.is_ok()) return ::testing::AssertionFailure() << st.to_string();
      st = create_host_group(R_, &host);
      if (!st.is_ok()) return ::testing::AssertionFailure() << st.to_string();
    }
    comms_ = nccl;
    gpu_.resize(R_ * num_layers());
    cpu_.resize(R_ * num_layers());
    streams_.resize(R_);
    std::vector<Status> status(R_);
    std::vector<std::thread> threads;
    for (int r = 0; r < R_; ++r) {
      threads.emplace_back([&, r] {
        cudaSetDevice(device_of(r));
        // non-blocking: the harness's own copies (legacy stream) must not wait for a logical peer's
        // kernels on a shared GPU; there, the group's stream of the rank (its own hardware queue)
        streams_[r] = make_rank_stream(R_ > 1 ? nccl[r].get() : nullptr);
        MoeConfig gc = config_, cc = config_;
        gc.backend = backend_;
        cc.backend = Backend::kCpu;
        Status st;
        for (int L = 0; L < num_layers() && st.is_ok(); ++L) {
          const MoeWeights w = reference::local_weights(*problems_[L], r);
          const int i = L * R_ + r;
          st = MoeLayer::create(g.for_rank(r), gc, w, R_ > 1 ? nccl[r] : nullptr, &gpu_[i]);
          if (st.is_ok()) st = gpu_[i]->warmup();
          if (st.is_ok()) st = MoeLayer::create(g.for_rank(r), cc, w, R_ > 1 ? host[r] : nullptr, &cpu_[i]);
          if (st.is_ok()) st = cpu_[i]->warmup();
        }
        status[r] = st;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < R_; ++r)
      if (!status[r].is_ok()) return ::testing::AssertionFailure() << "rank " << r << ": " << status[r].to_string();
    return ::testing::AssertionSuccess();
  }

  // One forward of both groups on `in`; y (bf16 bits) per rank. The GPU output is poisoned first.
  // Three phases, every rank finishing one before any starts the next: (1) the cpu backend's
  // forward, device buffers, copies and (graph) the capture; (2) the GPU forwards, their error checks
  // and output copies; (3) frees. A rank's forward waits for its peers' launches (bounded by
  // MEGAMOE_WAIT_TIMEOUT_MS), so nothing slow (the cpu reference) and nothing that synchronises the
  // device (cudaMalloc, cudaFree, graph instantiation) may run on one rank while a peer's kernel waits.
  ::testing::AssertionResult run(const std::vector<RankInputs>& in, std::vector<std::vector<uint16_t>>* y_gpu,
                                 std::vector<std::vector<uint16_t>>* y_cpu, bool graph = false, int layer = 0) {
    const MoeGeometry& g = problem_.geometry;
    const int64_t H = g.hidden, k = g.top_k;
    y_gpu->assign(R_, {});
    y_cpu->assign(R_, {});
    std::vector<std::string> errors(R_);
    PhaseBarrier barrier(R_);
    std::vector<std::thread> threads;
    for (int r = 0; r < R_; ++r) {
      threads.emplace_back([&, r] {
        const RankInputs& x = in[r];
        const int64_t T = x.num_tokens;
        auto fail = [&](const std::string& m) {
          if (errors[r].empty()) errors[r] = m;
        };
        const int li = layer * R_ + r;
        void *dx = nullptr, *dids = nullptr, *dw = nullptr, *dy = nullptr;
        cudaGraph_t gr = nullptr;
        cudaGraphExec_t exec = nullptr;
        const size_t xb = std::max<size_t>(1, T * H * 2), ib = std::max<size_t>(1, T * k * 4);
        // (1)
        [&] {
          std::vector<uint16_t> yc(T * H, 0xFFFF);
          TensorView cx(const_cast<uint16_t*>(x.x_bf16.data()), DType::kBFloat16, {T, H});
          TensorView cids(const_cast<int32_t*>(x.topk_ids.data()), DType::kInt32, {T, k});
          TensorView cw(const_cast<float*>(x.topk_weights.data()), DType::kFloat32, {T, k});
          Status st = cpu_[li]->forward(cx, cids, cw, TensorView(yc.data(), DType::kBFloat16, {T, H}));
          if (!st.is_ok()) return fail("cpu: " + st.to_string());
          (*y_cpu)[r] = std::move(yc);
          cudaSetDevice(device_of(r));
          if (cudaMalloc(&dx, xb) || cudaMalloc(&dids, ib) || cudaMalloc(&dw, ib) || cudaMalloc(&dy, xb))
            return fail("cudaMalloc failed");
          // On the rank's stream: ordered before its forward, and never waiting for a peer's work.
          cudaMemcpyAsync(dx, x.x_bf16.data(), T * H * 2, cudaMemcpyHostToDevice, streams_[r]);
          cudaMemcpyAsync(dids, x.topk_ids.data(), T * k * 4, cudaMemcpyHostToDevice, streams_[r]);
          cudaMemcpyAsync(dw, x.topk_weights.data(), T * k * 4, cudaMemcpyHostToDevice, streams_[r]);
          cudaMemsetAsync(dy, 0xFF, xb, streams_[r]);
          cudaStreamSynchronize(streams_[r]);  // the host vectors may go before the copies ran
          if (graph) {
            const Device d = Device::cuda(device_of(r));
            TensorView gx(dx, DType::kBFloat16, {T, H}, d), gids(dids, DType::kInt32, {T, k}, d),
                gw(dw, DType::kFloat32, {T, k}, d), gy(dy, DType::kBFloat16, {T, H}, d);
            cudaStreamBeginCapture(streams_[r], cudaStreamCaptureModeThreadLocal);
            st = gpu_[li]->forward(gx, gids, gw, gy, streams_[r]);
            cudaStreamEndCapture(streams_[r], &gr);
            if (!st.is_ok()) return fail("gpu capture: " + st.to_string());
            if (cudaGraphInstantiate(&exec, gr, 0) != cudaSuccess) return fail("graph instantiate failed");
          }
        }();
        barrier.arrive_and_wait();
        // (2) every rank launches, even after a failure of its own above: a rank that skips its
        // launch leaves its peers waiting (bounded) and they report it.
        cudaSetDevice(device_of(r));
        if (errors[r].empty()) {
          const Device d = Device::cuda(device_of(r));
          TensorView gx(dx, DType::kBFloat16, {T, H}, d), gids(dids, DType::kInt32, {T, k}, d),
              gw(dw, DType::kFloat32, {T, k}, d), gy(dy, DType::kBFloat16, {T, H}, d);
          Status st;
          if (graph) {
            for (int rep = 0; rep < 3; ++rep) cudaGraphLaunch(exec, streams_[r]);
          } else {
            st = gpu_[li]->forward(gx, gids, gw, gy, streams_[r]);
            if (!st.is_ok()) fail("gpu: " + st.to_string());
          }
          if (st.is_ok()) {
            st = gpu_[li]->check_error(streams_[r]);
            if (!st.is_ok()) fail("gpu check_error: " + st.to_string());
          }
          if (st.is_ok()) {
            std::vector<uint16_t> yg(T * H);
            cudaMemcpyAsync(yg.data(), dy, T * H * 2, cudaMemcpyDeviceToHost, streams_[r]);
            cudaStreamSynchronize(streams_[r]);
            (*y_gpu)[r] = std::move(yg);
          }
        }
        barrier.arrive_and_wait();
        // (3)
        if (exec) cudaGraphExecDestroy(exec);
        if (gr) cudaGraphDestroy(gr);
        cudaFree(dx);
        cudaFree(dids);
        cudaFree(dw);
        cudaFree(dy);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) fail(std::string("CUDA: ") + cudaGetErrorString(err));
      });
    }
    for (auto& t : threads) t.join();
    // Every failing rank's error: the first to fail names the cause, its peers' aborts follow.
    ::testing::AssertionResult result = ::testing::AssertionSuccess();
    for (int r = 0; r < R_; ++r)
      if (!errors[r].empty()) {
        if (result) result = ::testing::AssertionFailure();
        result << "rank " << r << ": " << errors[r] << "\n";
      }
    return result;
  }

  // release() on every rank's thread (collective, bounded); ok or the first rank's error.
  ::testing::AssertionResult release_all() {
    std::vector<Status> st(R_);
    std::vector<std::thread> threads;
    for (int r = 0; r < R_; ++r)
      threads.emplace_back([&, r] {
        cudaSetDevice(device_of(r));
        for (int L = 0; L < num_layers(); ++L)
          if (L * R_ + r < static_cast<int>(gpu_.size()) && gpu_[L * R_ + r]) {
            const Status s = gpu_[L * R_ + r]->release();
            if (st[r].is_ok()) st[r] = s;
          }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < R_; ++r)
      if (!st[r].is_ok()) return ::testing::AssertionFailure() << "rank " << r << ": " << st[r].to_string();
    return ::testing::AssertionSuccess();
  }

  ~Harness() {
    release_all();  // collective and bounded; a layer released already answers ok
    std::vector<std::thread> threads;
    for (int r = 0; r < R_; ++r)
      threads.emplace_back([&, r] {
        cudaSetDevice(device_of(r));
        for (int L = 0; L < num_layers(); ++L)
          if (L * R_ + r < static_cast<int>(gpu_.size())) gpu_[L * R_ + r].reset();
        if (r < static_cast<int>(streams_.size()) && streams_[r])
          drop_rank_stream(r < static_cast<int>(comms_.size()) ? comms_[r].get() : nullptr, streams_[r]);
      });
    for (auto& t : threads) t.join();
  }

 private:
  const MoeProblem& problem_;
  MoeConfig config_;
  int R_;
  GroupKind kind_;
  Backend backend_;
  std::vector<const MoeProblem*> problems_;  // [layers]; the layers of problem L are gpu_[L * R + r]
  std::vector<std::unique_ptr<MoeLayer>> gpu_, cpu_;
  std::vector<cudaStream_t> streams_;
  std::vector<std::shared_ptr<Communicator>> comms_;  // the GPU group's ranks (R > 1)
};

}  // namespace megamoe::gpu_test
