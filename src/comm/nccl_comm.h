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
// invariant: all collective calls on one NcclRankComm come from one thread at a time (NCCL's rule).
#pragma once

#include <nccl.h>

#include <memory>
#include <mutex>
#include <string>

#include "megamoe/comm.h"
#include "megamoe/status.h"

namespace megamoe {

// Minimum NCCL version with the device API (symmetric windows, ncclDevComm, LSA pointers).
constexpr int kMinNcclVersionCode = 22800;

class NcclRankComm final : public Communicator {
 public:
  NcclRankComm(ncclComm_t comm, int rank, int size, int device, uint64_t group_id);
  ~NcclRankComm() override;
  NcclRankComm(const NcclRankComm&) = delete;
  NcclRankComm& operator=(const NcclRankComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  CommKind kind() const override { return CommKind::kNccl; }
  uint64_t group_id() const override { return group_id_; }
  std::string to_string() const override;

  ncclComm_t nccl() const { return comm_; }
  int device() const { return device_; }

  std::mutex& state_mutex() { return state_mutex_; }
  std::shared_ptr<void>& device_state() { return device_state_; }

 private:
  ncclComm_t comm_;
  int rank_, size_, device_;
  uint64_t group_id_;
  std::mutex state_mutex_;
  std::shared_ptr<void> device_state_;
};

// The NCCL rank behind `comm`, or null when comm is null or not an NCCL handle.
NcclRankComm* nccl_rank_of(const Communicator* comm);

// Runtime checks shared by both bootstraps: NCCL version, device arch.
Status check_nccl_runtime();
Status check_cuda_device(int device);

}  // namespace megamoe
