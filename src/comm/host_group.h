// Host-thread EP group: R ranks as threads of one process, exchanging through host memory.
//
// This is the cpu backend's stand-in for NCCL symmetric memory and device barriers:
// - barrier(): generation-tagged. Rank r's n-th barrier has epoch n; it returns once every rank has
//   entered its n-th barrier. Epochs only grow, so nothing is ever reset between uses.
// - all_gather(): a barrier that also publishes one pointer per rank (workspace bases at warmup, the
//   output pointer per forward). Rank r may then write into peer p's memory at the same
//   WorkspaceLayout offsets, as a GPU rank writes through an LSA pointer.
// - Every wait is bounded (env_knobs().wait_timeout_ms, or set_wait_timeout_ms() for tests). On
//   timeout the waiter returns kTimeout naming its rank, the stage, the peers that did not arrive and
//   the expected/seen counts, and aborts the group: every other waiter returns promptly with that
//   reason. abort() does the same explicitly (e.g. a rank that refused its inputs).
// - After an abort every call fails fast with the first reason. A group is not reusable after an
//   abort: build a new one.
//
// invariant: all ranks call barrier()/all_gather() with the same stage names in the same order; a
// rank that arrives at epoch n with a stage name different from a peer's stage at epoch n aborts the
// group (the collective order is broken and waiting would only hide it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/status.h"
#include "megamoe/workspace.h"

namespace megamoe {

class HostGroup {
 public:
  HostGroup(int size, uint64_t id);
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  int size() const { return size_; }
  uint64_t id() const { return id_; }

  // Bound of every wait in this group; ms <= 0 restores the default (env_knobs().wait_timeout_ms,
  // read at each wait).
  void set_wait_timeout_ms(int64_t ms);
  int64_t wait_timeout_ms() const;

  // Collective. Returns ok once all ranks have entered this epoch's barrier. On failure, `error`
  // (optional) receives rank, stage is left to the caller, peer = first missing peer (or -1),
  // expected = ranks expected, seen = ranks that arrived. timeout_ms > 0 bounds this wait instead of
  // wait_timeout_ms().
  Status barrier(int rank, const char* stage, WaitError* error = nullptr, int64_t timeout_ms = 0);
  // Collective barrier that also gathers one pointer per rank: (*all)[p] is what rank p passed.
  Status all_gather(int rank, const char* stage, void* mine, std::vector<void*>* all, WaitError* error = nullptr,
                    int64_t timeout_ms = 0);

  // Marks the group aborted (first reason wins) and wakes every waiter. `code` is the code every
  // rank's pending and later calls return.
  void abort(int rank, const std::string& reason, StatusCode code = StatusCode::kFailedPrecondition);
  bool aborted() const;
  // ok, or the abort reason as seen from `rank`.
  Status check(int rank) const;

  // Serialises adds into rank p's output (in-kernel FC2 reduce stand-in for red.add).
  std::mutex& destination_lock(int rank) { return *destination_locks_[rank]; }

  // Barriers rank r has entered so far.
  int64_t epoch(int rank) const;

 private:
  Status barrier_impl(int rank, const char* stage, void* publish, std::vector<void*>* gathered, WaitError* error,
                      int64_t timeout_ms);
  // Callers hold mutex_.
  Status abort_status_locked(int rank, const char* stage) const;
  void abort_locked(int rank, const std::string& reason, StatusCode code);

  const int size_;
  const uint64_t id_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int64_t timeout_override_ms_ = 0;
  std::vector<int64_t> arrived_;            // [R] epoch of the last barrier each rank entered
  std::vector<std::string> stage_;          // [R] stage name of that barrier
  std::vector<void*> published_[2];         // [R] per epoch parity (see barrier_impl)
  bool aborted_ = false;
  StatusCode abort_code_ = StatusCode::kOk;
  std::string abort_reason_;
  std::vector<std::unique_ptr<std::mutex>> destination_locks_;
};

// One rank's handle on a HostGroup (what create_host_group() returns).
class HostRankComm final : public Communicator {
 public:
  HostRankComm(std::shared_ptr<HostGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  CommKind kind() const override { return CommKind::kHostThreads; }
  uint64_t group_id() const override { return group_->id(); }
  std::string to_string() const override;
  HostGroup& group() const { return *group_; }

 private:
  std::shared_ptr<HostGroup> group_;
  int rank_;
};

// The host group behind `comm`, or null when comm is null or not a host-threads handle.
HostGroup* host_group_of(const Communicator* comm);

// A fresh id for an in-process group (host threads, shared GPU): small, never reused in a process.
uint64_t next_in_process_group_id();

}  // namespace megamoe
