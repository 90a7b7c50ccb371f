#include "ranks.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include "comm/nccl_comm.h"
#include "core/cuda_check.h"
#include "core/env.h"

#include "megamoe/formats.h"
#include "reference/problem.h"

namespace megamoe::tool {
namespace {

constexpr uint16_t kBf16Poison = 0x7FC1;  // a quiet bf16 NaN no rounding produces

bool is_cuda(Device d) { return d.kind == DeviceKind::kCuda; }

Status alloc(Device d, int64_t bytes, void** out) {
  *out = nullptr;
  if (bytes <= 0) return Status::ok();
  if (!is_cuda(d)) {
    *out = std::malloc(static_cast<size_t>(bytes));
    return *out ? Status::ok() : Status(StatusCode::kInternal, "out of host memory for " + std::to_string(bytes) + " bytes");
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(d.index));
  MEGAMOE_CUDA_CHECK(cudaMalloc(out, static_cast<size_t>(bytes)));
  return Status::ok();
}

void release_ptr(Device d, void* p) {
  if (!p) return;
  if (is_cuda(d)) cudaFree(p);
  else std::free(p);
}

Status copy_in(Device d, void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return Status::ok();
  if (!is_cuda(d)) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return Status::ok();
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  return Status::ok();
}

}  // namespace

Status run_on_ranks(int64_t n, const std::function<Status(int64_t)>& fn) {
  std::vector<Status> results(static_cast<size_t>(n));
  auto body = [&](int64_t r) {
    try {
      results[r] = fn(r);
    } catch (const std::exception& e) {
      results[r] = Status(StatusCode::kInternal, "rank " + std::to_string(r) + ": " + e.what());
    } catch (...) {
      results[r] = Status(StatusCode::kInternal, "rank " + std::to_string(r) + ": unknown exception");
    }
  };
  if (n == 1) {
    body(0);
  } else {
    std::vector<std::thread> threads;
    for (int64_t r = 0; r < n; ++r) threads.emplace_back(body, r);
    for (std::thread& t : threads) t.join();
  }
  const Status* first = nullptr;
  for (const Status& s : results) {
    if (s) continue;
    if (!first) first = &s;
    // A timeout or an abort on one rank is usually the echo of another rank's real failure.
    const bool echo = s.code() == StatusCode::kTimeout || s.message().find("abort") != std::string::npos;
    if (!echo) return s;
  }
  return first ? *first : Status::ok();
}

std::string ProcessRanks::describe() const {
  if (shared_gpu) return "all " + std::to_string(ep_size) + " rank(s) in this process, logical ranks sharing cuda:0";
  if (!launched) return "all " + std::to_string(ep_size) + " rank(s) in this process";
  return "rank " + std::to_string(bootstrap.rank) + " of " + std::to_string(ep_size) +
         " in this process (megamoe launch: one process per GPU, cuda:" + std::to_string(device_of(bootstrap.rank)) + ")";
}

Status process_ranks(int64_t ep_size, bool on_gpu, ProcessRanks* out, bool shared_gpu) {
  *out = ProcessRanks();
  out->ep_size = ep_size;
  if (shared_gpu) {
    if (!on_gpu)
      return invalid_argument("flag", "--shared-gpu", "set", "logical ranks of one GPU need a GPU backend (routed, mega)");
    if (!env_knobs().rank.empty())
      return invalid_argument("flag", "--shared-gpu", "set", "the logical ranks of one GPU run in one process (not under megamoe launch)");
    out->shared_gpu = true;
    return Status::ok();
  }
  if (env_knobs().rank.empty()) return Status::ok();
  if (!on_gpu)
    return invalid_argument("launch", "backend", "cpu",
                            "one process per rank needs a GPU backend (the cpu backend's ranks share host memory: "
                            "run it without megamoe launch)");
  MEGAMOE_RETURN_IF_ERROR(NcclBootstrap::from_env(&out->bootstrap));
  if (out->bootstrap.world_size != ep_size)
    return invalid_argument("launch", "MEGAMOE_WORLD_SIZE", std::to_string(out->bootstrap.world_size),
                            "must equal --ep=" + std::to_string(ep_size) + " (one process per EP rank)");
  if (ep_size > 1) MEGAMOE_RETURN_IF_ERROR(create_nccl_rank(out->bootstrap, &out->comm));
  out->launched = true;
  return Status::ok();
}

Status run_on_local_ranks(const ProcessRanks& pr, const std::function<Status(int64_t)>& fn) {
  if (!pr.launched) return run_on_ranks(pr.ep_size, fn);
  return run_on_ranks(1, [&](int64_t) { return fn(pr.bootstrap.rank); });
}

MoeLayer* first_local_layer(const RankGroup& group) {
  for (const auto& l : group.layers)
    if (l) return l.get();
  return nullptr;
}

Status build_group(const MoeGeometry& g, const MoeConfig& c, const RankWeightsFn& weights_of, RankGroup* out,
                   BuildTimes* times, const ProcessRanks* ranks) {
  ProcessRanks all;
  all.ep_size = g.ep_size;
  const ProcessRanks& pr = ranks ? *ranks : all;
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  out->layers.clear();
  out->comms.clear();
  out->layers.resize(static_cast<size_t>(g.ep_size));
  // GPU backends exchange through NCCL (rank r on CUDA device r); the cpu backend through host memory.
  const Backend backend = select_backend(g, c).backend;
  const bool on_gpu = backend == Backend::kRouted || backend == Backend::kMega;
  if (g.ep_size > 1) {
    if (on_gpu && pr.launched) {
      out->comms.resize(static_cast<size_t>(g.ep_size));
      out->comms[pr.bootstrap.rank] = pr.comm;
    } else if (on_gpu && pr.shared_gpu) {
      MEGAMOE_RETURN_IF_ERROR(create_shared_gpu_group(0, static_cast<int>(g.ep_size), &out->comms));
    } else if (on_gpu) {
      std::vector<int> devices;
      for (int64_t r = 0; r < g.ep_size; ++r) devices.push_back(static_cast<int>(r));
      MEGAMOE_RETURN_IF_ERROR(create_nccl_group(devices, &out->comms));
    } else {
      MEGAMOE_RETURN_IF_ERROR(create_host_group(static_cast<int>(g.ep_size), &out->comms));
    }
  }
  auto select_device = [on_gpu, &pr](int64_t r) {
    if (on_gpu) MEGAMOE_CUDA_CHECK(cudaSetDevice(pr.device_of(r)));
    return Status::ok();
  };
  std::vector<BuildTimes> rank_times(static_cast<size_t>(g.ep_size));
  // Creation is local (no collective): a rank that fails does not strand the others.
  Status st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    MEGAMOE_RETURN_IF_ERROR(select_device(r));
    std::shared_ptr<Communicator> comm = g.ep_size > 1 ? out->comms[r] : nullptr;
    Clock::time_point t0 = Clock::now();
    RankWeights source;
    Status rst = weights_of(r, &source);
    rank_times[r].source_s = seconds_since(t0);
    t0 = Clock::now();
    if (rst) rst = MoeLayer::create(g.for_rank(r), c, source.views, comm, &out->layers[r]);
    rank_times[r].create_s = seconds_since(t0);
    source = RankWeights();  // the layer holds its prepared copy; the source goes now
    if (!rst) return Status(rst.code(), "rank " + std::to_string(r) + ": " + rst.message());
    return rst;
  });
  if (st) {
    st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
      MEGAMOE_RETURN_IF_ERROR(select_device(r));
      const Clock::time_point t0 = Clock::now();
      const Status rst = out->layers[r]->warmup();
      rank_times[r].warmup_s = seconds_since(t0);
      if (!rst) return Status(rst.code(), "rank " + std::to_string(r) + " warmup: " + rst.message());
      return rst;
    });
  }
  if (times) {
    *times = BuildTimes();
    for (const BuildTimes& t : rank_times) {
      times->source_s = std::max(times->source_s, t.source_s);
      times->create_s = std::max(times->create_s, t.create_s);
      times->warmup_s = std::max(times->warmup_s, t.warmup_s);
    }
  }
  return st;
}

RankWeightsFn generated_weights(const MoeGeometry& g, uint64_t seed) {
  const int threads = std::max<int>(1, reference::default_generate_threads() / static_cast<int>(g.ep_size));
  return [g, seed, threads](int64_t r, RankWeights* out) {
    auto slice = std::make_shared<reference::ExpertWeights>(reference::make_rank_weights(g, seed, r, threads));
    out->views = slice->view();
    out->storage = std::move(slice);
    return Status::ok();
  };
}

MoeWeights source_views(const PreparedWeights& p) { return p.as_source(); }

RankGroup::~RankGroup() {
  // release() first (collective, bounded): the workspaces go back now, not with the communicator.
  run_on_ranks(static_cast<int64_t>(layers.size()), [this](int64_t r) {
    if (layers[r]) layers[r]->release();
    layers[r].reset();
    return Status::ok();
  });
}

RankBarrier::RankBarrier(const ProcessRanks& pr, const RankGroup& group)
    : pr_(pr), group_(group), threads_(pr.launched ? 1 : pr.ep_size) {}

RankBarrier::~RankBarrier() {
  if (flag_) cudaFree(flag_);
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Status RankBarrier::wait(int64_t rank) {
  if (!pr_.launched || pr_.ep_size == 1) {
    threads_.wait();
    return Status::ok();
  }
  const NcclRankComm* nccl = nccl_rank_of(group_.comms[rank].get());
  if (!nccl) return Status(StatusCode::kInternal, "rank barrier: rank " + std::to_string(rank) + " has no NCCL communicator");
  if (!flag_) {
    MEGAMOE_CUDA_CHECK(cudaSetDevice(pr_.device_of(rank)));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&flag_, sizeof(float)));
    cudaStream_t s = nullptr;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
  }
  return nccl_barrier(nccl->nccl(), flag_, stream_, rank, "rank barrier");
}

ProcessMax::~ProcessMax() {
  if (value_) cudaFree(value_);
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Status ProcessMax::operator()(double* value) {
  if (!pr_.launched || pr_.ep_size == 1) return Status::ok();
  const int64_t rank = pr_.first();
  const NcclRankComm* nccl = nccl_rank_of(pr_.comm.get());
  if (!nccl) return Status(StatusCode::kInternal, "process maximum: rank " + std::to_string(rank) + " has no NCCL communicator");
  MEGAMOE_CUDA_CHECK(cudaSetDevice(pr_.device_of(rank)));
  if (!value_) {
    MEGAMOE_CUDA_CHECK(cudaMalloc(&value_, sizeof(double)));
    cudaStream_t s = nullptr;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream_);
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(value_, value, sizeof(double), cudaMemcpyHostToDevice, s));
  MEGAMOE_RETURN_IF_ERROR(
      nccl_all_reduce_bounded(nccl->nccl(), value_, 1, ncclDouble, ncclMax, stream_, rank, "the process maximum"));
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(value, value_, sizeof(double), cudaMemcpyDeviceToHost, s));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return Status::ok();
}

Status nccl_barrier(ncclComm_t comm, void* flag, void* stream, int64_t rank, const char* what) {
  return nccl_all_reduce_bounded(comm, flag, 1, ncclFloat, ncclSum, stream, rank, what);
}

Status nccl_all_reduce_bounded(ncclComm_t comm, void* buf, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               void* stream_ptr, int64_t rank, const char* what) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const ncclResult_t r = ncclAllReduce(buf, buf, count, type, op, comm, stream);
  if (r != ncclSuccess)
    return Status(StatusCode::kInternal, std::string(what) + ": ncclAllReduce failed: " + ncclGetErrorString(r));
  const int64_t bound_ms = env_knobs().barrier_timeout_ms;
  const auto start = std::chrono::steady_clock::now();
  std::string failure;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return Status::ok();
    if (q != cudaErrorNotReady) {
      failure = std::string("the all-reduce failed on the device: ") + cudaGetErrorString(q);
      break;
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      failure = std::string("NCCL reports ") + ncclGetErrorString(async) + " on the communicator (a peer process gone?)";
      break;
    }
    const int64_t waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (waited > bound_ms) {
      failure = "no peer arrived within " + std::to_string(bound_ms) +
                " ms (MEGAMOE_BARRIER_TIMEOUT_MS); a peer process is stuck or gone";
      break;
    }
    std::this_thread::yield();  // no sleep: a rank that left late would carry the delay into the forward it times
  }
  std::fprintf(stderr,
               "megamoe: rank %lld: %s over the launched processes: %s; aborting the NCCL communicator and exiting "
               "with %d without cleanup (its pending all-reduce keeps it from being destroyed)\n",
               static_cast<long long>(rank), what, failure.c_str(), kBarrierExitCode);
  std::fflush(stderr);
  ncclCommAbort(comm);
  std::_Exit(kBarrierExitCode);
}

void ThreadBarrier::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t gen = generation_;
  if (++arrived_ == n_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen; });
}

RankIo::~RankIo() { release(); }

void RankIo::release() {
  for (void** p : {&x_, &ids_, &weights_, &y_, &chain_[0], &chain_[1]}) {
    release_ptr(device_, *p);
    *p = nullptr;
  }
}

Status RankIo::stage(Device device, int64_t tokens, int64_t hidden, int64_t top_k, const uint16_t* x,
                     const int32_t* ids, const float* weights) {
  release();
  device_ = device;
  tokens_ = tokens;
  hidden_ = hidden;
  top_k_ = top_k;
  MEGAMOE_RETURN_IF_ERROR(alloc(device, tokens * hidden * 2, &x_));
  MEGAMOE_RETURN_IF_ERROR(alloc(device, tokens * top_k * 4, &ids_));
  MEGAMOE_RETURN_IF_ERROR(alloc(device, tokens * top_k * 4, &weights_));
  MEGAMOE_RETURN_IF_ERROR(alloc(device, tokens * hidden * 2, &y_));
  MEGAMOE_RETURN_IF_ERROR(copy_in(device, x_, x, tokens * hidden * 2));
  MEGAMOE_RETURN_IF_ERROR(copy_in(device, ids_, ids, tokens * top_k * 4));
  MEGAMOE_RETURN_IF_ERROR(copy_in(device, weights_, weights, tokens * top_k * 4));
  // The layer runs on a non-blocking stream, which does not order against the legacy-stream copies.
  if (is_cuda(device)) MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return Status::ok();
}

Status RankIo::poison_output() {
  const int64_t n = tokens_ * hidden_;
  if (n == 0) return Status::ok();
  if (!is_cuda(device_)) {
    std::fill(static_cast<uint16_t*>(y_), static_cast<uint16_t*>(y_) + n, kBf16Poison);
    return Status::ok();
  }
  // 0x7F7F... as bf16 is 3.39e38: not a NaN, but far outside any output the layer computes.
  MEGAMOE_CUDA_CHECK(cudaMemset(y_, 0x7F, static_cast<size_t>(n * 2)));
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());  // see stage()
  return Status::ok();
}

Status RankIo::forward(MoeLayer* layer, void* stream) {
  const TensorView x(x_, DType::kBFloat16, {tokens_, hidden_}, device_);
  const TensorView ids(ids_, DType::kInt32, {tokens_, top_k_}, device_);
  const TensorView w(weights_, DType::kFloat32, {tokens_, top_k_}, device_);
  const TensorView y(y_, DType::kBFloat16, {tokens_, hidden_}, device_);
  return layer->forward(x, ids, w, y, stream);
}

Status RankIo::reserve_chain() {
  for (void*& a : chain_)
    if (!a) MEGAMOE_RETURN_IF_ERROR(alloc(device_, tokens_ * hidden_ * 2, &a));
  return Status::ok();
}

Status RankIo::forward_layers(const std::vector<MoeLayer*>& layers, void* stream) {
  const int64_t n = static_cast<int64_t>(layers.size());
  if (n > 1 && (!chain_[0] || !chain_[1]))
    return Status(StatusCode::kFailedPrecondition, "RankIo::forward_layers: reserve_chain() first");
  const TensorView ids(ids_, DType::kInt32, {tokens_, top_k_}, device_);
  const TensorView w(weights_, DType::kFloat32, {tokens_, top_k_}, device_);
  for (int64_t l = 0; l < n; ++l) {
    void* in = l == 0 ? x_ : chain_[(l - 1) & 1];
    void* out = l == n - 1 ? y_ : chain_[l & 1];
    MEGAMOE_RETURN_IF_ERROR(layers[l]->forward(TensorView(in, DType::kBFloat16, {tokens_, hidden_}, device_), ids, w,
                                               TensorView(out, DType::kBFloat16, {tokens_, hidden_}, device_), stream));
  }
  return Status::ok();
}

Status RankIo::read_output(uint16_t* y) const {
  const int64_t bytes = tokens_ * hidden_ * 2;
  if (bytes == 0) return Status::ok();
  if (!is_cuda(device_)) {
    std::memcpy(y, y_, static_cast<size_t>(bytes));
    return Status::ok();
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpy(y, y_, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  return Status::ok();
}

Status create_rank_stream(const RankGroup& g, int64_t r, void** stream) {
  *stream = nullptr;
  const Device device = g.layers[r]->device();
  if (!is_cuda(device)) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device.index));
  const Communicator* comm = r < static_cast<int64_t>(g.comms.size()) ? g.comms[r].get() : nullptr;
  if (comm != nullptr && comm->kind() == CommKind::kSharedGpu) return shared_gpu_stream(*comm, stream);
  cudaStream_t s = nullptr;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = s;
  return Status::ok();
}

void destroy_rank_stream(const RankGroup& g, int64_t r, void* stream) {
  const Communicator* comm = r < static_cast<int64_t>(g.comms.size()) ? g.comms[r].get() : nullptr;
  if (comm != nullptr && comm->kind() == CommKind::kSharedGpu) return;  // the group's
  if (is_cuda(g.layers[r]->device()) && stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

Status synchronize(Device device, void* stream) {
  if (!is_cuda(device)) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

}  // namespace megamoe::tool
