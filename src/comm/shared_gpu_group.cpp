#include "comm/shared_gpu_group.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <sstream>

#include "core/cuda_check.h"
#include "core/env.h"

namespace megamoe {

// One collective allocation: every rank's buffer, freed together when the last rank lets go.
struct SharedGpuGroup::Allocation {
  int device = 0;
  SharedGpuMemory memory;
  std::vector<void*> bases;  // [R], rank order
  int taken = 0;             // ranks that picked up their part (under the group's mutex)
  ~Allocation() {
    for (void* p : bases)
      if (p) memory.free(device, p);
  }
};

SharedGpuMemory SharedGpuMemory::cuda() {
  SharedGpuMemory m;
  m.alloc = [](int device, int64_t bytes, void** out) -> Status {
    CudaDeviceGuard guard(device);
    if (!guard.ok()) return Status(StatusCode::kCudaError, "cannot select cuda:" + std::to_string(device));
    void* p = nullptr;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
    // Zeroed on a private stream (not the legacy one, which would order against the other ranks'
    // streams on this device) and synchronised before the address is published.
    cudaStream_t s = nullptr;
    cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    if (s) cudaStreamDestroy(s);
    if (err != cudaSuccess) {
      cudaFree(p);
      return cuda_status(err, "zeroing the shared-GPU symmetric buffer", __FILE__, __LINE__);
    }
    *out = p;
    return Status::ok();
  };
  m.free = [](int device, void* p) {
    CudaDeviceGuard guard(device);
    cudaFree(p);  // waits for the device's work, whose waits are all bounded
  };
  return m;
}

SharedGpuGroup::SharedGpuGroup(int device, int size, int num_sms, uint64_t id, SharedGpuMemory memory)
    : device_(device), num_sms_(num_sms), host_(size, id), memory_(std::move(memory)) {}

// Records no rank took yet go with pending_.
SharedGpuGroup::~SharedGpuGroup() {
  if (destroy_stream_)
    for (void* s : streams_)
      if (s) destroy_stream_(s);
}

Status SharedGpuGroup::symmetric_alloc(int rank, int64_t bytes, void** base, std::function<void(void*)>* release) {
  if (rank < 0 || rank >= size())
    return invalid_argument("shared-GPU symmetric allocation", "rank", std::to_string(rank),
                            "must be in [0, size=" + std::to_string(size()) + ")");
  if (bytes <= 0)
    return invalid_argument("shared-GPU symmetric allocation", "bytes", std::to_string(bytes), "must be > 0");
  if (!base || !release)
    return invalid_argument("shared-GPU symmetric allocation", "base/release", "null", "must receive the buffer");
  const int64_t timeout_ms = env_knobs().barrier_timeout_ms;
  // The sizes first: a rank asking for another size is out of step (its layers differ).
  std::vector<void*> sizes;
  MEGAMOE_RETURN_IF_ERROR(host_.all_gather(rank, "symmetric-alloc-size",
                                           reinterpret_cast<void*>(static_cast<uintptr_t>(bytes)), &sizes, nullptr,
                                           timeout_ms));
  for (int p = 0; p < size(); ++p) {
    const int64_t theirs = static_cast<int64_t>(reinterpret_cast<uintptr_t>(sizes[p]));
    if (theirs == bytes) continue;
    const std::string why = "symmetric allocation out of step in shared-GPU group " + std::to_string(id()) +
                            ": rank " + std::to_string(rank) + " asked for " + std::to_string(bytes) + " bytes, rank " +
                            std::to_string(p) + " for " + std::to_string(theirs) +
                            " (every rank must build the same layers in the same order)";
    host_.abort(rank, why);
    return Status(StatusCode::kFailedPrecondition, why);
  }
  void* mine = nullptr;
  const Status alloc_st = memory_.alloc(device_, bytes, &mine);
  // A rank whose allocation failed still takes part (publishing null), so its peers fail with it
  // instead of waiting for it.
  std::vector<void*> all;
  const Status gather_st =
      host_.all_gather(rank, "symmetric-alloc", alloc_st.is_ok() ? mine : nullptr, &all, nullptr, timeout_ms);
  if (!alloc_st.is_ok() || !gather_st.is_ok()) {
    if (mine) memory_.free(device_, mine);
    return alloc_st.is_ok() ? gather_st : alloc_st;
  }
  for (int p = 0; p < size(); ++p) {
    if (all[p] != nullptr) continue;
    memory_.free(device_, mine);
    return Status(StatusCode::kUnavailable, "shared-GPU symmetric allocation of " + std::to_string(bytes) +
                                                " bytes failed on rank " + std::to_string(p) + " (rank " +
                                                std::to_string(rank) + " gave its part back)");
  }
  std::shared_ptr<Allocation> record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<Allocation>& slot = pending_[all[0]];
    if (!slot) {
      slot = std::make_shared<Allocation>();
      slot->device = device_;
      slot->memory = memory_;
      slot->bases = all;
    }
    record = slot;
    if (++record->taken == size()) pending_.erase(all[0]);
    by_base_[mine] = record;
  }
  *base = mine;
  // Never waits for a peer: the record (every rank's buffer) goes with the last rank's release.
  *release = [record, self = weak_from_this()](void* p) mutable {
    if (auto group = self.lock()) {
      std::lock_guard<std::mutex> lock(group->mutex_);
      group->by_base_.erase(p);
    }
    record.reset();
  };
  return Status::ok();
}

Status SharedGpuGroup::peer_bases(int rank, const void* base, std::vector<void*>* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_base_.find(base);
  std::shared_ptr<Allocation> record = it == by_base_.end() ? nullptr : it->second.lock();
  if (!record)
    return invalid_argument("shared-GPU peer bases", "base", "an unknown address",
                            "must be a live buffer of this group's symmetric_alloc (rank " + std::to_string(rank) + ")");
  *out = record->bases;
  return Status::ok();
}

int64_t SharedGpuGroup::num_live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const Allocation*> seen;
  for (const auto& e : by_base_)
    if (auto r = e.second.lock()) {
      bool dup = false;
      for (const Allocation* s : seen) dup |= s == r.get();
      if (!dup) seen.push_back(r.get());
    }
  for (const auto& e : pending_) {
    bool dup = false;
    for (const Allocation* s : seen) dup |= s == e.second.get();
    if (!dup) seen.push_back(e.second.get());
  }
  return static_cast<int64_t>(seen.size());
}

std::string SharedGpuRankComm::to_string() const {
  std::ostringstream os;
  os << "SharedGpuRankComm(rank=" << rank_ << ", size=" << group_->size() << ", device=cuda:" << group_->device()
     << ", group=" << group_->id() << ", sm_budget=" << sm_budget() << ")";
  return os.str();
}

Status SharedGpuRankComm::barrier(const char* stage, int64_t timeout_ms) {
  return group_->host().barrier(rank_, stage, nullptr, timeout_ms > 0 ? timeout_ms : env_knobs().barrier_timeout_ms);
}

Status create_shared_gpu_group_with(int device, int size, int num_sms, SharedGpuMemory memory,
                                    std::vector<std::shared_ptr<Communicator>>* ranks) {
  if (!ranks) return invalid_argument("argument", "ranks", "null", "must point to a vector to receive the handles");
  if (size < 1 || size > 8)
    return invalid_argument("shared-GPU group", "size", std::to_string(size),
                            "must be in [1, 8] (the EP transport reaches at most 8 ranks)");
  if (num_sms < size)
    return invalid_argument("shared-GPU group", "num_sms", std::to_string(num_sms),
                            "must be at least size=" + std::to_string(size) + " (one SM per rank)");
  if (!memory.alloc || !memory.free)
    return invalid_argument("shared-GPU group", "memory", "incomplete", "needs both alloc and free");
  auto group = std::make_shared<SharedGpuGroup>(device, size, num_sms, next_in_process_group_id(), std::move(memory));
  ranks->clear();
  for (int r = 0; r < size; ++r) ranks->push_back(std::make_shared<SharedGpuRankComm>(group, r));
  return Status::ok();
}

namespace {

// With lazy module loading (CUDA's default), a rank's first launch of a kernel loads it, and a load
// may wait for the device's running kernels: one of them a peer's kernel that waits for this rank's
// launch. The group then stalls until the wait bound. Eager loading has every kernel loaded when the
// context is created.
Status check_eager_module_loading() {
  using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return Status::ok();  // a driver without the query loads eagerly
  }
  CUmoduleLoadingMode mode{};
  if (reinterpret_cast<GetLoadingMode>(fn)(&mode) != CUDA_SUCCESS || mode != CU_MODULE_LAZY_LOADING) return Status::ok();
  return Status(StatusCode::kFailedPrecondition,
                "shared-GPU group: CUDA lazy module loading is on (CUDA_MODULE_LOADING unset or LAZY); a rank's "
                "first launch of a kernel can then wait for a peer's running kernel that waits for it. Set "
                "CUDA_MODULE_LOADING=EAGER in the environment before the process's first CUDA call");
}

}  // namespace

Status check_device_connections(const char* value, int size) {
  int64_t n = 8;  // CUDA's default
  if (value != nullptr && *value != '\0') {
    char* end = nullptr;
    n = std::strtoll(value, &end, 10);
    if (end == value || *end != '\0' || n < 1)
      return invalid_argument("shared-GPU group", "CUDA_DEVICE_MAX_CONNECTIONS", std::string("\"") + value + "\"",
                              "must be a positive integer (CUDA's hardware work queues per device)");
  }
  if (n < size)
    return Status(StatusCode::kFailedPrecondition,
                  "shared-GPU group: CUDA_DEVICE_MAX_CONNECTIONS=" + std::to_string(n) + " (" +
                      (value != nullptr && *value != '\0' ? "set" : "CUDA's default") + ") is below size=" +
                      std::to_string(size) +
                      ": each logical rank's stream needs its own hardware work queue, or a rank's kernel waits "
                      "behind a peer's kernel that waits for it. Set CUDA_DEVICE_MAX_CONNECTIONS to at least " +
                      std::to_string(size) + " before the process's first CUDA call");
  return Status::ok();
}

Status shared_gpu_stream(const Communicator& rank, void** stream) {
  if (!stream) return invalid_argument("argument", "stream", "null", "must point to where the stream goes");
  *stream = nullptr;
  const auto* shared = dynamic_cast<const SharedGpuRankComm*>(&rank);
  if (!shared)
    return invalid_argument("shared_gpu_stream", "rank", rank.to_string(),
                            "must be a rank of create_shared_gpu_group()");
  *stream = shared->group().stream(shared->rank());
  if (!*stream)
    return Status(StatusCode::kFailedPrecondition,
                  "shared_gpu_stream: " + rank.to_string() + " has no stream (a group over injected memory)");
  return Status::ok();
}

Status create_shared_gpu_group(int device, int size, std::vector<std::shared_ptr<Communicator>>* ranks) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    cudaGetLastError();
    return Status(StatusCode::kUnavailable, std::string("shared-GPU group: no CUDA device (") +
                                                (err != cudaSuccess ? cudaGetErrorString(err) : "count 0") + ")");
  }
  if (device < 0 || device >= n)
    return invalid_argument("shared-GPU group", "device", std::to_string(device),
                            "must be a CUDA ordinal in [0, " + std::to_string(n) + ")");
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 9)
    return Status(StatusCode::kUnavailable, "shared-GPU group: cuda:" + std::to_string(device) + " (" + prop.name +
                                                ") is sm_" + std::to_string(prop.major * 10 + prop.minor) +
                                                "; the EP transport kernels need sm_90a (Hopper)");
  MEGAMOE_RETURN_IF_ERROR(check_eager_module_loading());
  MEGAMOE_RETURN_IF_ERROR(check_device_connections(std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), size));
  std::vector<std::shared_ptr<Communicator>> made;
  MEGAMOE_RETURN_IF_ERROR(create_shared_gpu_group_with(device, size, prop.multiProcessorCount, SharedGpuMemory::cuda(), &made));
  // The ranks' streams back to back (nothing else created in between by this thread): CUDA does not
  // document how streams take queues, but with queues to spare consecutive streams rarely share one.
  CudaDeviceGuard guard(device);
  if (!guard.ok()) return Status(StatusCode::kCudaError, "shared-GPU group: cannot select cuda:" + std::to_string(device));
  std::vector<void*> streams(static_cast<size_t>(size), nullptr);
  const auto destroy = [device](void* s) {
    CudaDeviceGuard g(device);
    cudaStreamDestroy(static_cast<cudaStream_t>(s));
  };
  for (int r = 0; r < size; ++r) {
    cudaStream_t s = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (void* t : streams)
        if (t) destroy(t);
      return cuda_status(err, "shared-GPU group: creating the ranks' streams", __FILE__, __LINE__);
    }
    streams[r] = s;
  }
  static_cast<SharedGpuRankComm&>(*made[0]).group().set_streams(std::move(streams), destroy);
  *ranks = std::move(made);
  return Status::ok();
}
}  // namespace megamoe
