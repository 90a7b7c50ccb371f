#include "comm/nccl_comm.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/nccl_check.h"
#include "comm/nccl_window.h"
#include "core/env.h"
#include "core/log.h"

namespace megamoe {
namespace {

// Group ids of NCCL groups: a hash of the unique id (equal in every process of the group), with the
// top bit set so they never collide with the host groups' small counters.
uint64_t group_id_of(const ncclUniqueId& id) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    h ^= static_cast<unsigned char>(id.internal[i]);
    h *= 1099511628211ull;
  }
  return h | (1ull << 63);
}

std::string to_hex(const ncclUniqueId& id) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(2 * sizeof(id.internal));
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    const unsigned char c = static_cast<unsigned char>(id.internal[i]);
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

static_assert(2 * sizeof(ncclUniqueId::internal) == NcclBootstrap::kIdHexDigits, "MEGAMOE_NCCL_ID's length");

bool from_hex(const std::string& s, ncclUniqueId* id) {
  if (s.size() != 2 * sizeof(id->internal)) return false;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof(id->internal); ++i) {
    const int hi = val(s[2 * i]), lo = val(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    id->internal[i] = static_cast<char>(hi * 16 + lo);
  }
  return true;
}

// Rank 0: write the id to `path` atomically (temp file + rename), so readers never see half an id.
Status write_id_file(const std::string& path, const ncclUniqueId& id) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return Status(StatusCode::kIoError, "cannot write the NCCL id file: MEGAMOE_NCCL_ID_FILE=" + tmp);
    f << to_hex(id) << "\n";
    if (!f) return Status(StatusCode::kIoError, "cannot write the NCCL id file: MEGAMOE_NCCL_ID_FILE=" + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status(StatusCode::kIoError, "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  return Status::ok();
}

Status read_id_file(const std::string& path, int64_t timeout_ms, int rank, ncclUniqueId* id) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path);
    std::string hex;
    if (f && (f >> hex) && from_hex(hex, id)) return Status::ok();
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_ms)
      return Status(StatusCode::kTimeout, "rank " + std::to_string(rank) + " waited " + std::to_string(waited) +
                                              " ms for rank 0 to write the NCCL id to MEGAMOE_NCCL_ID_FILE=" + path +
                                              " (is rank 0 running, with the same path?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

NcclRankComm::NcclRankComm(ncclComm_t comm, int rank, int size, int device, uint64_t group_id, bool owns_comm)
    : comm_(comm), owns_comm_(owns_comm), rank_(rank), size_(size), device_(device), group_id_(group_id) {
  if (cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_) != cudaSuccess) {
    cudaGetLastError();
    num_sms_ = 1;
  }
}

NcclRankComm::~NcclRankComm() {
  CudaDeviceGuard guard(device_);
  device_state_.reset();  // the ncclDevComm goes before its communicator
  // A broken group may have operations pending on a dead peer (a barrier's all-reduce) that would
  // keep ncclCommDestroy from returning: abort it instead, which never waits.
  // Windows released outside a collective step are still registered: destroying the communicator
  // releases them with it (locally), then their memory goes. An adopted communicator (not ours to
  // destroy) keeps them registered: their memory stays with it.
  if (comm_ && owns_comm_) (broken() ? ncclCommAbort : ncclCommDestroy)(comm_);
  if (owns_comm_)
    for (const auto& d : deferred_) ncclMemFree(d.second);
  if (barrier_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(barrier_stream_));
  if (barrier_cell_) cudaFree(barrier_cell_);
}

void NcclRankComm::defer_window(void* window, void* base) {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_.emplace_back(window, base);
}

int64_t NcclRankComm::num_deferred_windows() {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  return static_cast<int64_t>(deferred_.size());
}

Status NcclRankComm::symmetric_alloc(int64_t bytes, void** base, std::function<void(void*)>* release) {
  MEGAMOE_RETURN_IF_ERROR(ensure_device_comm(this));  // collective, once: the LSA-team check
  return megamoe::symmetric_alloc(shared_from_this(), bytes, base, release);
}

Status NcclRankComm::peer_bases(const void* base, std::vector<void*>* out) {
  MEGAMOE_RETURN_IF_ERROR(window_peer_bases(symmetric_window_of(base), size_, device_, out));
  // invariant: this rank reaches its own copy through the allocation's own address (the kernels'
  // own_base), never through its LSA alias, so no kernel touches one buffer by two virtual addresses.
  (*out)[rank_] = const_cast<void*>(base);
  return Status::ok();
}

void NcclRankComm::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (broken_.load()) return;  // the first reason wins
  broken_reason_ = reason;
  broken_.store(true);
}

Status NcclRankComm::barrier(const char* stage, int64_t timeout_ms) {
  if (broken()) {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    return Status(StatusCode::kFailedPrecondition, "rank " + std::to_string(rank_) + " cannot enter barrier '" + stage +
                                                       "': its NCCL group is broken (" + broken_reason_ +
                                                       "); rebuild the communicator");
  }
  const int64_t bound = timeout_ms > 0 ? timeout_ms : env_knobs().barrier_timeout_ms;
  CudaDeviceGuard guard(device_);
  if (!barrier_stream_) {
    cudaStream_t s = nullptr;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    barrier_stream_ = s;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&barrier_cell_, sizeof(int32_t)));
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(barrier_cell_, 0, sizeof(int32_t), s));
  }
  cudaStream_t stream = static_cast<cudaStream_t>(barrier_stream_);
  const int64_t n = ++barriers_;
  MEGAMOE_NCCL_CHECK(ncclAllReduce(barrier_cell_, barrier_cell_, 1, ncclInt32, ncclSum, comm_, stream));
  const auto start = std::chrono::steady_clock::now();
  std::string what;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return Status::ok();
    if (q != cudaErrorNotReady) {
      what = std::string("the all-reduce failed: ") + cudaGetErrorString(q);
      break;
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      what = std::string("NCCL reports ") + ncclGetErrorString(async) + " on the communicator (a peer gone?)";
      break;
    }
    const int64_t waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (waited > bound) {
      what = "not every rank arrived within " + std::to_string(bound) + " ms (MEGAMOE_BARRIER_TIMEOUT_MS)";
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::ostringstream os;
  os << "timeout: rank " << rank_ << " at barrier '" << stage << "' (barrier " << n << " of NCCL group 0x" << std::hex
     << group_id_ << std::dec << ", " << size_ << " ranks): " << what
     << "; the communicator is broken (it will be aborted, not destroyed): rebuild it";
  mark_broken(os.str());
  return Status(StatusCode::kTimeout, os.str());
}

std::string NcclRankComm::to_string() const {
  std::ostringstream os;
  os << "NcclRankComm(rank=" << rank_ << ", size=" << size_ << ", device=cuda:" << device_ << ", group=0x" << std::hex
     << group_id_ << ")";
  return os.str();
}

NcclRankComm* nccl_rank_of(const Communicator* comm) {
  if (!comm || comm->kind() != CommKind::kNccl) return nullptr;
  return const_cast<NcclRankComm*>(dynamic_cast<const NcclRankComm*>(comm));
}

Status check_nccl_runtime() {
  int v = 0;
  MEGAMOE_NCCL_CHECK(ncclGetVersion(&v));
  if (v < kMinNcclVersionCode) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "NCCL %d.%d.%d loaded, the EP transport needs >= 2.28 (device API)", v / 10000,
                  (v % 10000) / 100, v % 100);
    return Status(StatusCode::kUnavailable,
                  std::string(buf) + "; put NCCL 2.28+ first on LD_LIBRARY_PATH (e.g. the nvidia-nccl-cu13 wheel)");
  }
  return Status::ok();
}

Status check_cuda_device(int device) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    cudaGetLastError();
    return Status(StatusCode::kUnavailable, std::string("no CUDA device: ") + cudaGetErrorString(err));
  }
  if (device < 0 || device >= n)
    return invalid_argument("NCCL group", "device", std::to_string(device),
                            "must be a CUDA ordinal in [0, " + std::to_string(n) + ")");
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 9)
    return Status(StatusCode::kUnavailable, "device cuda:" + std::to_string(device) + " (" + prop.name + ") is sm_" +
                                                std::to_string(prop.major * 10 + prop.minor) +
                                                "; the EP transport kernels need sm_90a (Hopper)");
  return Status::ok();
}

Status nccl_unique_id_hex(std::string* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a string");
  MEGAMOE_RETURN_IF_ERROR(check_nccl_runtime());
  ncclUniqueId id;
  MEGAMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  *out = to_hex(id);
  return Status::ok();
}

Status create_nccl_group(const std::vector<int>& devices, std::vector<std::shared_ptr<Communicator>>* ranks) {
  if (!ranks) return invalid_argument("argument", "ranks", "null", "must point to a vector to receive the handles");
  if (devices.empty())
    return invalid_argument("NCCL group", "devices", "[]", "must list at least one CUDA ordinal");
  MEGAMOE_RETURN_IF_ERROR(check_nccl_runtime());
  for (size_t i = 0; i < devices.size(); ++i) {
    MEGAMOE_RETURN_IF_ERROR(check_cuda_device(devices[i]));
    for (size_t j = 0; j < i; ++j)
      if (devices[j] == devices[i])
        return invalid_argument("NCCL group", "devices", "cuda:" + std::to_string(devices[i]) + " twice",
                                "one rank per GPU");
  }
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(n);
  MEGAMOE_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  // A group id equal for all handles: derive it from a fresh unique id (never used to bootstrap).
  ncclUniqueId tag;
  MEGAMOE_NCCL_CHECK(ncclGetUniqueId(&tag));
  const uint64_t gid = group_id_of(tag);
  ranks->clear();
  for (int r = 0; r < n; ++r) ranks->push_back(std::make_shared<NcclRankComm>(comms[r], r, n, devices[r], gid));
  return Status::ok();
}

Status create_nccl_rank(const NcclBootstrap& b, std::shared_ptr<Communicator>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a Communicator handle");
  if (b.world_size < 1)
    return invalid_argument("NCCL bootstrap", "world_size", std::to_string(b.world_size), "must be >= 1");
  if (b.rank < 0 || b.rank >= b.world_size)
    return invalid_argument("NCCL bootstrap", "rank", std::to_string(b.rank),
                            "must be in [0, world_size=" + std::to_string(b.world_size) + ")");
  MEGAMOE_RETURN_IF_ERROR(check_nccl_runtime());
  const int device = b.device >= 0 ? b.device : b.rank;
  MEGAMOE_RETURN_IF_ERROR(check_cuda_device(device));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (!b.id_hex.empty()) {
    if (!from_hex(b.id_hex, &id))
      return invalid_argument("NCCL bootstrap", "MEGAMOE_NCCL_ID", b.id_hex.substr(0, 16) + "...",
                              "must be 256 hex digits (nccl_unique_id_hex())");
  } else if (!b.id_file.empty()) {
    if (b.rank == 0) {
      MEGAMOE_NCCL_CHECK(ncclGetUniqueId(&id));
      MEGAMOE_RETURN_IF_ERROR(write_id_file(b.id_file, id));
    } else {
      MEGAMOE_RETURN_IF_ERROR(read_id_file(b.id_file, b.id_timeout_ms, b.rank, &id));
    }
  } else {
    return invalid_argument("NCCL bootstrap", "id_file", "empty", "give id_file or id_hex");
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  MEGAMOE_NCCL_CHECK(ncclCommInitRank(&comm, b.world_size, id, b.rank));
  *out = std::make_shared<NcclRankComm>(comm, b.rank, b.world_size, device, group_id_of(id));
  return Status::ok();
}

namespace {

// The distinct paths of the libnccl objects mapped in this process.
int collect_libnccl(dl_phdr_info* info, size_t, void* data) {
  const std::string path = info->dlpi_name ? info->dlpi_name : "";
  const size_t slash = path.rfind('/');
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  auto* paths = static_cast<std::vector<std::string>*>(data);
  if (base.rfind("libnccl.so", 0) == 0 && std::find(paths->begin(), paths->end(), path) == paths->end())
    paths->push_back(path);
  return 0;
}

}  // namespace

Status adopt_nccl_comm(void* nccl_comm, int device, std::shared_ptr<Communicator>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a Communicator handle");
  if (!nccl_comm)
    return invalid_argument("NCCL adoption", "nccl_comm", "null",
                            "must be a live ncclComm_t (torch creates its communicator at the first collective on "
                            "the group: run one first, or use comm_from_process_group)");
  std::vector<std::string> libs;
  dl_iterate_phdr(collect_libnccl, &libs);
  if (libs.size() > 1) {
    std::string all;
    for (const std::string& l : libs) all += (all.empty() ? "" : ", ") + l;
    return Status(StatusCode::kFailedPrecondition,
                  "NCCL adoption: " + std::to_string(libs.size()) + " libnccl are loaded (" + all +
                      "); a communicator of one cannot be used through the other: load one NCCL (put torch's "
                      "nvidia-nccl first on LD_LIBRARY_PATH)");
  }
  MEGAMOE_RETURN_IF_ERROR(check_nccl_runtime());
  int runtime = 0;
  MEGAMOE_NCCL_CHECK(ncclGetVersion(&runtime));
  constexpr int kStableDevCommVersion = 23100;  // NCCL 2.31: the device communicator's layout is versioned
  if (runtime < kStableDevCommVersion && runtime != NCCL_VERSION_CODE)
    return Status(StatusCode::kUnavailable,
                  "NCCL adoption: the loaded NCCL is " + std::to_string(runtime) + " but megamoe was compiled against " +
                      std::to_string(NCCL_VERSION_CODE) +
                      "; before NCCL 2.31 the device communicator's layout is fixed at compile time: load the same "
                      "NCCL, or use comm_from_process_group (megamoe's own communicator)");
  MEGAMOE_RETURN_IF_ERROR(check_cuda_device(device));
  ncclComm_t comm = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0, size = 0, comm_device = -1;
  MEGAMOE_NCCL_CHECK(ncclCommUserRank(comm, &rank));
  MEGAMOE_NCCL_CHECK(ncclCommCount(comm, &size));
  MEGAMOE_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device));
  if (comm_device != device)
    return invalid_argument("NCCL adoption", "device", std::to_string(device),
                            "must be the communicator's device cuda:" + std::to_string(comm_device));
  const uint64_t gid = (reinterpret_cast<uintptr_t>(nccl_comm) * 0x9E3779B97F4A7C15ull) | (1ull << 63);
  *out = std::make_shared<NcclRankComm>(comm, rank, size, device, gid, /*owns_comm=*/false);
  return Status::ok();
}

}  // namespace megamoe
