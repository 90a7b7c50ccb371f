// GpuRankComm: what the GPU backends need from one rank's handle on an EP group, whatever connects
// the ranks. Implemented by NcclRankComm (one GPU per rank, NCCL symmetric memory over NVLink) and
// SharedGpuRankComm (several logical ranks sharing one GPU: tests, benches, single-GPU development).
//
// Kernels reach a peer's copy of a symmetric buffer through plain device pointers (peer_bases()),
// resolved once at warmup; nothing on the host side of the transport names NCCL.
//
// Contract:
// - symmetric_alloc() is collective: every rank calls it with the same size, in the same order, each
//   from its own thread or process. On return the memory is zeroed on every rank, and no peer could
//   have written to it before (peers learn its address only inside the collective step).
// - The release function it returns never waits for a peer: NCCL deregisters the window (which is
//   collective) only inside a CollectiveReleaseScope, else leaves it to the communicator's teardown;
//   a shared GPU frees the buffers with the last rank's release.
// - barrier() is bounded: it returns kTimeout naming this rank, the stage, the bound and what it saw
//   once `timeout_ms` (<= 0: MEGAMOE_BARRIER_TIMEOUT_MS) has passed, and marks the group broken.
// - mark_broken() records that the group is out of step (a timed-out device wait, a rank that left);
//   collective teardown is skipped from then on, so nothing blocks on a dead peer.
// invariant: collective calls on one handle come from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/status.h"

namespace megamoe {

class GpuRankComm : public Communicator {
 public:
  // CUDA ordinal of this rank's device.
  virtual int device() const = 0;
  // SMs this rank's kernels may occupy at once. A rank that owns its device: all of them. R ranks
  // sharing one device: SMs / R, and every kernel a rank launches must stay within that many CTAs:
  // then even when the block scheduler spreads the other ranks' (spinning) CTAs one per SM, SMs / R
  // SMs stay free for this rank, so the ranks' kernels are resident at once and none waits for an
  // SM a waiting peer holds.
  virtual int sm_budget() const = 0;
  // True when several ranks of the group run on this rank's device (no NVLink between them).
  virtual bool shares_device() const = 0;

  virtual Status symmetric_alloc(int64_t bytes, void** base, std::function<void(void*)>* release) = 0;
  // (*out)[r] = rank r's copy of the symmetric buffer that symmetric_alloc() returned here as `base`,
  // as this rank's kernels address it (r in [0, size())). Not collective; may synchronise the device
  // (warmup only).
  virtual Status peer_bases(const void* base, std::vector<void*>* out) = 0;
  // Collective and bounded (see above).
  virtual Status barrier(const char* stage, int64_t timeout_ms) = 0;

  virtual void mark_broken(const std::string& reason) = 0;
  virtual bool broken() const = 0;
};

// The GPU rank behind `comm`, or null when comm is null or not a GPU group's handle.
GpuRankComm* gpu_rank_of(const Communicator* comm);

// Inside its scope (on this thread) a release of one of `comm`'s symmetric buffers may be collective
// (NCCL: the window is deregistered, and every rank must do the same): only where every rank is in
// the same step, after a barrier (MoeLayer::release, EpTransport::release). Outside it a release that
// would be collective is deferred to the communicator's teardown, so a destructor never waits for a
// peer.
// (Header-only: the CUDA side, nccl_window.cu, asks it too.)
class CollectiveReleaseScope {
 public:
  explicit CollectiveReleaseScope(const GpuRankComm* comm) : previous_(current()) { current() = comm; }
  ~CollectiveReleaseScope() { current() = previous_; }
  CollectiveReleaseScope(const CollectiveReleaseScope&) = delete;
  CollectiveReleaseScope& operator=(const CollectiveReleaseScope&) = delete;
  static bool active_for(const GpuRankComm* comm) { return comm && current() == comm; }

 private:
  static const GpuRankComm*& current() {
    static thread_local const GpuRankComm* scope = nullptr;
    return scope;
  }
  const GpuRankComm* previous_;
};

}  // namespace megamoe
