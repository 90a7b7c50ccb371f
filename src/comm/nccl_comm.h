// NCCL EP group: one rank's handle on an NCCL communicator (one GPU per rank).
//
// - Built by create_nccl_group() (ncclCommInitAll, one process, several GPUs) or create_nccl_rank()
//   (ncclCommInitRank, one process per GPU, unique id through a file or the environment).
// - Start-up checks: NCCL >= 2.28 at run time (the device API), a device of compute capability >= 9.0.
//   The LSA check (every rank reachable by NVLink load/store) needs the device communicator and
//   happens in nccl_window.cu when the transport is warmed up; a group that fails it is refused
//   with "multi-node (GIN) transport not built yet".
// - device_state(): an opaque slot the CUDA side (nccl_window.cu) fills once, under state_mutex():
//   the ncclDevComm. It is destroyed before the communicator.
// - As a GpuRankComm: symmetric_alloc() creates the device communicator (collective, once) and
//   allocates through nccl_window.h; peer_bases() resolves every rank's LSA address of a window once;
//   barrier() is an all-reduce of one int on a private stream, polled until a deadline (and the
//   communicator's async error); a broken communicator (barrier timeout, mark_broken()) is aborted
//   in the destructor instead of destroyed, so teardown never waits for a dead peer.
// invariant: all collective calls on one NcclRankComm come from one thread at a time (NCCL's rule).
#pragma once

#include <nccl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/gpu_comm.h"
#include "megamoe/comm.h"
#include "megamoe/status.h"

namespace megamoe {

// Minimum NCCL version with the device API (symmetric windows, ncclDevComm, LSA pointers).
constexpr int kMinNcclVersionCode = 22800;

class NcclRankComm final : public GpuRankComm, public std::enable_shared_from_this<NcclRankComm> {
 public:
  // owns_comm = false: an adopted communicator (adopt_nccl_comm), never destroyed or aborted here.
  NcclRankComm(ncclComm_t comm, int rank, int size, int device, uint64_t group_id, bool owns_comm = true);
  ~NcclRankComm() override;
  NcclRankComm(const NcclRankComm&) = delete;
  NcclRankComm& operator=(const NcclRankComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  CommKind kind() const override { return CommKind::kNccl; }
  uint64_t group_id() const override { return group_id_; }
  std::string to_string() const override;

  ncclComm_t nccl() const { return comm_; }
  int device() const override { return device_; }
  int sm_budget() const override { return num_sms_; }
  bool shares_device() const override { return false; }
  Status symmetric_alloc(int64_t bytes, void** base, std::function<void(void*)>* release) override;
  Status peer_bases(const void* base, std::vector<void*>* out) override;
  Status barrier(const char* stage, int64_t timeout_ms) override;
  void mark_broken(const std::string& reason) override;
  bool broken() const override { return broken_.load(); }

  std::mutex& state_mutex() { return state_mutex_; }
  std::shared_ptr<void>& device_state() { return device_state_; }
  // A symmetric buffer released outside a CollectiveReleaseScope: deregistered (or, broken, just
  // dropped with the aborted communicator) and freed in the destructor, never by a lone rank.
  void defer_window(void* window, void* base);
  int64_t num_deferred_windows();

 private:
  ncclComm_t comm_;
  bool owns_comm_;
  int rank_, size_, device_, num_sms_ = 0;
  uint64_t group_id_;
  std::mutex state_mutex_;
  std::shared_ptr<void> device_state_;
  std::atomic<bool> broken_{false};
  std::mutex broken_mutex_;
  std::string broken_reason_;
  void* barrier_stream_ = nullptr;  // cudaStream_t, made at the first barrier
  void* barrier_cell_ = nullptr;    // one int on the device
  int64_t barriers_ = 0;
  std::mutex deferred_mutex_;
  std::vector<std::pair<void*, void*>> deferred_;  // (ncclWindow_t, base)
};

// The NCCL rank behind `comm`, or null when comm is null or not an NCCL handle.
NcclRankComm* nccl_rank_of(const Communicator* comm);

// Runtime checks shared by both bootstraps: NCCL version, device arch.
Status check_nccl_runtime();
Status check_cuda_device(int device);

}  // namespace megamoe
