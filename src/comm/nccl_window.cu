#include "comm/nccl_window.h"

#include <nccl_device.h>

#include <map>
#include <mutex>
#include <string>

#include "comm/nccl_check.h"
#include "comm/nccl_comm.h"

namespace megamoe {
namespace {

std::mutex g_windows_mutex;
std::map<const void*, ncclWindow_t>& windows() {
  static auto* m = new std::map<const void*, ncclWindow_t>();
  return *m;
}

struct DeviceCommState {
  ncclComm_t comm = nullptr;
  ncclDevComm dev{};
  ~DeviceCommState() {
    if (comm) ncclDevCommDestroy(comm, &dev);
  }
};

}  // namespace

Status symmetric_alloc(const std::shared_ptr<NcclRankComm>& comm, int64_t bytes, void** base,
                       std::function<void(void*)>* release) {
  if (!comm) return Status(StatusCode::kInvalidArgument, "symmetric allocation: comm=null, needs an NCCL communicator");
  if (bytes <= 0) return Status(StatusCode::kInvalidArgument, "symmetric allocation: bytes=" + std::to_string(bytes) + ", must be > 0");
  MEGAMOE_CUDA_CHECK(cudaSetDevice(comm->device()));
  void* ptr = nullptr;
  MEGAMOE_NCCL_CHECK(ncclMemAlloc(&ptr, static_cast<size_t>(bytes)));
  Status st;
  ncclWindow_t win = nullptr;
  do {
    cudaError_t err = cudaMemset(ptr, 0, static_cast<size_t>(bytes));
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      st = cuda_status(err, "cudaMemset(workspace)", __FILE__, __LINE__);
      break;
    }
    const ncclResult_t res =
        ncclCommWindowRegister(comm->nccl(), ptr, static_cast<size_t>(bytes), &win, NCCL_WIN_COLL_SYMMETRIC);
    if (res != ncclSuccess) {
      st = nccl_status(res, "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)", __FILE__, __LINE__);
      break;
    }
    if (!win) {
      st = Status(StatusCode::kUnavailable,
                  "NCCL registered no symmetric window on rank " + std::to_string(comm->rank()) +
                      ": this NCCL build or system has no symmetric-memory support (needs NCCL >= 2.28, CUDA VMM "
                      "and P2P between the GPUs; NCCL_DEBUG=INFO tells why)");
      break;
    }
  } while (false);
  if (!st.is_ok()) {
    ncclMemFree(ptr);
    return st;
  }
  {
    std::lock_guard<std::mutex> lock(g_windows_mutex);
    windows()[ptr] = win;
  }
  *base = ptr;
  std::shared_ptr<NcclRankComm> keep = comm;  // the communicator outlives its windows
  // Deregistration is collective: only inside a CollectiveReleaseScope of a healthy group (every rank
  // releases there, after a barrier); otherwise the communicator's teardown takes the window.
  *release = [keep, win](void* p) {
    {
      std::lock_guard<std::mutex> lock(g_windows_mutex);
      windows().erase(p);
    }
    if (!CollectiveReleaseScope::active_for(keep.get()) || keep->broken()) {
      keep->defer_window(win, p);
      return;
    }
    CudaDeviceGuard guard(keep->device());
    cudaDeviceSynchronize();
    ncclCommWindowDeregister(keep->nccl(), win);
    ncclMemFree(p);
  };
  return Status::ok();
}

namespace {
__global__ void window_peer_bases_kernel(ncclWindow_t window, int num_ranks, void** out) {
  const int r = threadIdx.x;
  if (r < num_ranks) out[r] = ncclGetPeerPointer(window, 0, r);
}
}  // namespace

Status window_peer_bases(ncclWindow_t window, int num_ranks, int device, std::vector<void*>* out) {
  if (!window)
    return Status(StatusCode::kInvalidArgument,
                  "peer bases: the buffer has no NCCL window (not allocated by this communicator's symmetric_alloc)");
  if (num_ranks < 1 || num_ranks > 1024)
    return Status(StatusCode::kInvalidArgument, "peer bases: num_ranks=" + std::to_string(num_ranks) + ", must be in [1, 1024]");
  CudaDeviceGuard guard(device);
  void** d_out = nullptr;
  MEGAMOE_CUDA_CHECK(cudaMalloc(&d_out, sizeof(void*) * num_ranks));
  window_peer_bases_kernel<<<1, 32 * ((num_ranks + 31) / 32)>>>(window, num_ranks, d_out);
  cudaError_t err = cudaGetLastError();
  out->assign(num_ranks, nullptr);
  if (err == cudaSuccess) err = cudaMemcpy(out->data(), d_out, sizeof(void*) * num_ranks, cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  MEGAMOE_CUDA_CHECK(err);
  return Status::ok();
}

ncclWindow_t symmetric_window_of(const void* base) {
  std::lock_guard<std::mutex> lock(g_windows_mutex);
  auto it = windows().find(base);
  return it == windows().end() ? nullptr : it->second;
}

Status ensure_device_comm(NcclRankComm* comm) {
  if (!comm) return Status(StatusCode::kInvalidArgument, "device communicator: comm=null, needs an NCCL communicator");
  std::lock_guard<std::mutex> lock(comm->state_mutex());
  if (comm->device_state()) return Status::ok();
  MEGAMOE_CUDA_CHECK(cudaSetDevice(comm->device()));
  auto state = std::make_shared<DeviceCommState>();
  ncclDevCommRequirements req = {};  // NCCL 2.28.9 has no initializer macro; zero is "nothing extra"
  req.lsaBarrierCount = 1;
  const ncclResult_t res = ncclDevCommCreate(comm->nccl(), &req, &state->dev);
  if (res != ncclSuccess)
    return Status(StatusCode::kUnavailable,
                  "ncclDevCommCreate failed on rank " + std::to_string(comm->rank()) + ": " + ncclGetErrorString(res) +
                      " (the NCCL device API needs NCCL >= 2.28 and symmetric-memory support; NCCL_DEBUG=INFO "
                      "tells why)");
  state->comm = comm->nccl();
  if (state->dev.lsaSize != state->dev.nRanks || state->dev.nRanks != comm->size())
    return Status(StatusCode::kUnavailable,
                  "rank " + std::to_string(comm->rank()) + " reaches " + std::to_string(state->dev.lsaSize) + " of " +
                      std::to_string(state->dev.nRanks) +
                      " ranks by NVLink load/store (LSA); the EP transport needs every rank in one LSA team. "
                      "Multi-node expert parallelism (NCCL GIN) is designed for but not built yet");
  comm->device_state() = state;
  return Status::ok();
}

}  // namespace megamoe
