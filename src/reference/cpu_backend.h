// The cpu backend: the reference semantics every GPU path is held to (ep_protocol.h states them).
//
// One CpuMoeLayer per rank; the ranks of a group are threads of one process (create_host_group),
// each driving its own layer. A forward runs the protocol stages with a group barrier between them:
//   validate args and ids -> [warmup if not done] -> encode wire rows -> (in-kernel reduce: y = 0)
//   -> barrier "dispatch-ready" (publishes y) -> layout + dispatch -> barrier "dispatch-done"
//   -> expert pool -> experts -> combine send -> barrier "combine-done" -> combine reduce.
// invariant: a rank's receive regions are written by peers only between its "dispatch-ready" and
// "dispatch-done" barriers, its combine rows (or y) only between "dispatch-done" and "combine-done";
// it reads them only after the barrier that closes the writing window.
// Any failure on one rank (bad arguments, bad ids, a timeout) aborts the group, so peers return
// promptly with the reason instead of waiting for the full timeout.
// The expert FFN of each rank runs on up to default_expert_workers(ep_size) threads, started per
// forward and joined before combine; its bits do not depend on the thread count.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/host_group.h"
#include "megamoe/layer.h"
#include "megamoe/workspace.h"
#include "reference/ep_protocol.h"

namespace megamoe {

// The factory MoeLayer::create() calls for Backend::kCpu (declared for core in core/backends.h).
Status create_cpu_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                        PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

class CpuMoeLayer final : public MoeLayer {
 public:
  CpuMoeLayer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
              PreparedWeights weights, reference::ExpertWeightsF32 expert_weights,
              std::shared_ptr<Communicator> comm, HostGroup* group);

  // Acquires this rank's workspace from WorkspacePool::global() (host memory, poisoned with 0xFF
  // except signals and counts) and exchanges workspace bases with the group. Collective; idempotent.
  Status warmup() override;
  // Collective. Runs warmup() first if it was not called (host memory needs no capture-safe setup).
  Status forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& y,
                 void* stream = nullptr, const TensorView& x_scale = TensorView()) override;

  // Marks the layer released: later forward() and error_pending() calls are refused. Its host
  // workspace goes with the layer object.
  Status release() override {
    released_ = true;
    return Status::ok();
  }
  // Always false: forward() reports every failure itself. After release(): kFailedPrecondition.
  Status error_pending(bool* pending) override;

  // Adds each forward's received rows per local expert (after the dispatch) to `counts` (host).
  Status set_expert_counts(const TensorView& counts) override;

  Backend backend() const override { return Backend::kCpu; }
  Device device() const override { return Device::cpu(); }

  // Test hook: replaces every expert's FFN (e.g. identity experts). Empty restores the real FFN.
  void set_expert_fn_for_testing(reference::ExpertFn fn) { expert_fn_ = std::move(fn); }
  // Test hook: the expert FFN runs on exactly `num_workers` threads (at most one per work unit),
  // however small the forward; num_workers <= 0 restores the default (default_expert_workers, and
  // fewer for small forwards). The output bits do not depend on it.
  void set_expert_workers_for_testing(int num_workers);
  int expert_workers() const { return expert_workers_; }
  const WorkspaceLayout& layout() const { return layout_; }
  // Null before warmup().
  void* workspace_base() const { return workspace_ ? workspace_->base : nullptr; }
  // The first bounded-wait failure this rank recorded (flag == 0: none).
  WaitError last_wait_error() const;

 private:
  Status run_forward(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                     const TensorView& topk_weights, const TensorView& y);
  // Barrier + pointer all-gather for `stage`; a no-op gather of one pointer without a group.
  Status sync(int32_t stage, void* publish, std::vector<void*>* gathered);
  // Aborts the group with this rank's reason (peers then fail fast) and returns `st`.
  Status fail(const Status& st);

  int rank_;
  WorkspaceLayout layout_;
  reference::ExpertWeightsF32 expert_weights_;
  reference::ExpertFn expert_fn_;
  std::shared_ptr<Communicator> comm_;
  HostGroup* group_;  // null without a communicator (ep_size == 1)
  std::shared_ptr<Workspace> workspace_;
  std::vector<void*> peer_bases_;
  TensorView expert_counts_;  // absent: not counting
  std::mutex own_output_lock_;  // the in-kernel reduce's lock when there is no group
  int expert_workers_;                  // run_experts' max_workers
  bool released_ = false;
  int64_t expert_min_fmas_per_worker_;  // run_experts' min_fmas_per_worker
};

// The most threads one rank's expert FFN uses.
constexpr int kMaxExpertWorkers = 16;
// Threads for one rank's expert FFN (and for dequantising its weights at creation) when `ep_size`
// ranks of this process compute at once: hardware_concurrency / ep_size, in [1, kMaxExpertWorkers].
int default_expert_workers(int64_t ep_size);

}  // namespace megamoe
