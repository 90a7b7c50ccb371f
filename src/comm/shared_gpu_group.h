// Several logical EP ranks sharing one GPU (create_shared_gpu_group): each rank with its own
// buffers and streams, driven by its own thread; peers reached through plain device pointers into
// the siblings' allocations. NCCL refuses two ranks on one device, so nothing here uses it.
//
// - symmetric_alloc(): one device allocation per rank (zeroed on the rank's own thread and
//   synchronised before its address is published), then an all-gather of the addresses over the
//   group's HostGroup (bounded by MEGAMOE_BARRIER_TIMEOUT_MS; the sizes are gathered first and must
//   agree). The R buffers of one collective allocation form one record, freed when the last rank
//   releases its part: releasing never waits for a peer, and no rank's buffer is freed while a peer
//   still holds the allocation.
// - peer_bases(): the record's addresses, in rank order.
// - barrier(): the HostGroup's bounded barrier.
// - sm_budget(): the device's SMs / size() (GpuRankComm::sm_budget states why).
// The device memory functions are injectable so the host-side collectives are testable without a
// GPU (tests/cpu/test_shared_gpu_group.cpp); the default is cudaMalloc / cudaFree on the device.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/gpu_comm.h"
#include "comm/host_group.h"

namespace megamoe {

struct SharedGpuMemory {
  // Zeroed device memory of `bytes` on `device`, visible to every stream when it returns.
  std::function<Status(int device, int64_t bytes, void** out)> alloc;
  std::function<void(int device, void* p)> free;
  static SharedGpuMemory cuda();
};

class SharedGpuGroup : public std::enable_shared_from_this<SharedGpuGroup> {
 public:
  SharedGpuGroup(int device, int size, int num_sms, uint64_t id, SharedGpuMemory memory);
  ~SharedGpuGroup();
  SharedGpuGroup(const SharedGpuGroup&) = delete;
  SharedGpuGroup& operator=(const SharedGpuGroup&) = delete;

  int device() const { return device_; }
  int size() const { return host_.size(); }
  int num_sms() const { return num_sms_; }
  uint64_t id() const { return host_.id(); }
  HostGroup& host() { return host_; }

  Status symmetric_alloc(int rank, int64_t bytes, void** base, std::function<void(void*)>* release);
  Status peer_bases(int rank, const void* base, std::vector<void*>* out);
  // Collective allocations alive (records with at least one rank's part not released).
  int64_t num_live_allocations() const;
  // The ranks' streams (create_shared_gpu_group creates them back to back; `destroy` frees each with
  // the group). Empty for a group over injected memory.
  void set_streams(std::vector<void*> streams, std::function<void(void*)> destroy) {
    streams_ = std::move(streams);
    destroy_stream_ = std::move(destroy);
  }
  void* stream(int rank) const { return rank >= 0 && rank < static_cast<int>(streams_.size()) ? streams_[rank] : nullptr; }

 private:
  struct Allocation;
  const int device_, num_sms_;
  HostGroup host_;
  SharedGpuMemory memory_;
  std::vector<void*> streams_;
  std::function<void(void*)> destroy_stream_;
  mutable std::mutex mutex_;
  // By rank 0's address (unique while alive): the record until every rank has taken its part.
  std::map<const void*, std::shared_ptr<Allocation>> pending_;
  // By each rank's own address: the record (lookup for peer_bases).
  std::map<const void*, std::weak_ptr<Allocation>> by_base_;
};

class SharedGpuRankComm final : public GpuRankComm {
 public:
  SharedGpuRankComm(std::shared_ptr<SharedGpuGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  CommKind kind() const override { return CommKind::kSharedGpu; }
  uint64_t group_id() const override { return group_->id(); }
  std::string to_string() const override;

  int device() const override { return group_->device(); }
  int sm_budget() const override { return std::max(1, group_->num_sms() / group_->size()); }
  bool shares_device() const override { return group_->size() > 1; }
  Status symmetric_alloc(int64_t bytes, void** base, std::function<void(void*)>* release) override {
    return group_->symmetric_alloc(rank_, bytes, base, release);
  }
  Status peer_bases(const void* base, std::vector<void*>* out) override {
    return group_->peer_bases(rank_, base, out);
  }
  Status barrier(const char* stage, int64_t timeout_ms) override;
  void mark_broken(const std::string& reason) override { group_->host().abort(rank_, reason, StatusCode::kTimeout); }
  bool broken() const override { return group_->host().aborted(); }

  SharedGpuGroup& group() const { return *group_; }

 private:
  std::shared_ptr<SharedGpuGroup> group_;
  int rank_;
};

// A group over injected memory functions (tests); create_shared_gpu_group() uses cuda memory and
// the device's SM count.
Status create_shared_gpu_group_with(int device, int size, int num_sms, SharedGpuMemory memory,
                                    std::vector<std::shared_ptr<Communicator>>* ranks);

// CUDA_DEVICE_MAX_CONNECTIONS (`value`, null when unset: CUDA's 8) against a group of `size` logical
// ranks: ok when every rank's stream can have its own hardware work queue (value >= size).
Status check_device_connections(const char* value, int size);

}  // namespace megamoe
