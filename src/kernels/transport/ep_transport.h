// EpTransport: the expert-parallel token transport of the GPU backends over symmetric memory.
//
// One object per rank, built on that rank's GPU communicator (GpuRankComm: NCCL, one GPU per rank;
// or logical ranks sharing one GPU) and a WorkspaceLayout. It owns (shares, through WorkspacePool)
// the symmetric workspace, every rank's base address of it as this rank's kernels reach it (resolved
// once in warmup: the kernels use plain pointers, never the NCCL window), the local scratch, and the
// launch epoch (which lives in the workspace's signals, so CUDA-graph replays get fresh epochs).
// Grids: shaped for every SM of the device, or on a shared device for GpuRankComm::sm_budget() / 2
// SMs (its launchers make up to 2 CTAs per SM they shape for, so each kernel stays within the
// budget), and without programmatic dependent launch there (a kernel launched early would hold SMs
// outside the budget while it waits for its predecessor).
//
// Per forward, in stream order, with no host synchronisation (capturable in a CUDA graph):
//   dispatch()          one fused layout + copy kernel: counts, rows and metadata into every owner's
//                       receive regions; returns (on the device) once this rank's regions are complete
//   build_expert_pool() owner: expert_offsets, pool_src, pool_x(_scales) (expert-major, segments
//                       padded to segment_align rows: 1 in layers, no padding)
//   ... experts (FC1/FC2) ...; FC2 either writes the source's combine rows itself or calls
//   combine_send()      owner: partial = weight * out[pool row] -> wire format -> source's combine row
//                       (owner reduce: a received token's partials summed in slot order -> one row)
//   combine()           source: publish "my partials are sent", wait for every rank's, reduce the k
//                       partials of each token in slot order (fp32) into y (bf16) (owner reduce: the
//                       owners' rows in rank order)
//   send_and_combine()  combine_send() + combine() in one kernel (same bits, one launch fewer)
// Every rank calls these in the same order, the same number of times (a rank with 0 tokens too).
// check_error() synchronises the stream and turns the device error cell (bounded-wait timeouts, peer
// aborts) and the bad-input counters into a Status. After a timeout the group is aborted for good:
// build a new communicator and transport.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "megamoe/comm.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"
#include "megamoe/workspace.h"

namespace megamoe {

class GpuRankComm;
namespace kernels {
struct TransportArgs;
}

struct EpTransportOptions {
  WorkspaceParams params;      // ep_size must equal the communicator's size
  bool pow2_scales = false;    // bf16 x -> fp8 wire with power-of-two scales
  int num_sms = 0;             // SMs the copy kernels are shaped for: 0 = every SM (shared device: the budget)
  int64_t wait_timeout_ms = 0; // bound of every device wait; 0 = MEGAMOE_WAIT_TIMEOUT_MS
  // send_and_combine(): recv-row groups whose reduce overlaps the later groups' sends, 1..8; 0 = by
  // the token count (default_combine_groups).
  int combine_groups = 0;
  // Part of the workspace's pool key: transports of equal parameters share a workspace only within
  // one lane (MoeConfig::workspace_lane).
  int32_t workspace_lane = 0;
  Status validate() const;
};

// Groups of send_and_combine() for T tokens on this rank. Measured on 2 H200s (deepseek-v3, bf16
// wire, amortised, one group against the chosen count): 8 groups at 8192 tokens 1443 us against
// 1597; 4 at 4096 777 against 817; at 2048 +2%; at 1024 and below the per-group fence and ticket
// cost more than the overlap saves (249 us grouped against 223).
inline int default_combine_groups(int64_t num_tokens) { return num_tokens >= 6144 ? 8 : num_tokens >= 2048 ? 4 : 1; }

class EpTransport {
 public:
  static Status create(std::shared_ptr<Communicator> comm, const EpTransportOptions& options,
                       std::unique_ptr<EpTransport>* out);
  ~EpTransport();
  EpTransport(const EpTransport&) = delete;
  EpTransport& operator=(const EpTransport&) = delete;

  // Collective, blocking: device communicator, symmetric workspace, scratch. Refused during CUDA-graph
  // capture. Idempotent; a failed warmup keeps nothing and may be retried.
  Status warmup(cudaStream_t stream = nullptr);
  bool warmed_up() const { return warmed_up_; }
  // Collective, bounded by timeout_ms (<= 0: MEGAMOE_BARRIER_TIMEOUT_MS): a barrier, then the
  // scratch and this transport's workspace reference go (the last reference of a workspace
  // deregisters it collectively). A rank that does not arrive in time: kTimeout, the group is left
  // broken and the workspace to the communicator's teardown. Afterwards every call is refused.
  // Without release() the destructor frees the same, but never collectively (never waits for a peer).
  Status release(int64_t timeout_ms = 0);

  // x [T, H] bf16, or e4m3 with x_scale [T, H/128] fp32; topk_ids [T, k] int32; topk_weights [T, k]
  // fp32; all on this rank's device, contiguous. T <= max_tokens_per_rank (refused before launch).
  Status dispatch(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                  const TensorView& topk_weights, cudaStream_t stream);
  // gate_rows >= 0: also the two gated copies of expert_offsets (gated_offsets()): the second gets
  // the offsets when the pool's real rows reach gate_rows, the first otherwise, the other one zeros.
  // pool_weight_scale (null: none): device fp32 [experts_per_rank]; combine_targets().pool_weight[p]
  // is then fp32(routing weight * pool_weight_scale[e]) for row p's local expert e (a per-expert
  // factor of FC2 folded into its row weight: nvfp4's global scale).
  Status build_expert_pool(cudaStream_t stream, int64_t gate_rows = -1, const float* pool_weight_scale = nullptr);
  // expert_out [pool_rows, H] fp32 or bf16: the FC2 output of each pool row (before the weight).
  Status combine_send(const TensorView& expert_out, cudaStream_t stream);
  // topk_ids as given to dispatch(); y [T, H] bf16.
  Status combine(const TensorView& topk_ids, const TensorView& y, cudaStream_t stream);
  // combine_send() + combine() in one kernel, the same bits: progress is published as soon as the
  // rows are out (per recv-row group with combine_groups > 1, so the reduce runs behind the sends)
  // and the reduce needs no second launch (the backends with a local FC2 output).
  Status send_and_combine(const TensorView& expert_out, const TensorView& topk_ids, const TensorView& y,
                          cudaStream_t stream);

  // Test hook: this rank's copy of the signal cells as if `launches` forwards had run (the launch
  // epoch, every source's dispatch and combine progress), so tests run forwards across the cells'
  // wraps (the dispatch cell's at 2^32 launches). Every rank calls it after warmup() and before its
  // next forward, with the same value, while no forward runs. Synchronous.
  Status seed_epoch_for_test(uint64_t launches);

  // Synchronises `stream`; ok, or kTimeout (stage, peer, expected, seen), or kInvalidArgument (bad
  // topk ids: first bad token, slot, value; the counters are cleared once reported).
  Status check_error(cudaStream_t stream);

  // Whether check_error() has a failure to report, without a host synchronisation (an engine polls
  // it between steps). Reads the latest snapshot of the cells check_error() reads (the error cell,
  // every rank's abort cell in this rank's copy, the bad-input counters) that a private non-blocking
  // stream finished copying into pinned host memory, and starts the next snapshot once that one is
  // in. A call never waits: it queries an event and enqueues three small copies on that stream, so
  // it never orders against the forwards' streams nor the legacy default stream, and runs while a
  // kernel of this rank still waits for a peer (the copies need no SM). A failure therefore shows at
  // most one call late. *pending then stays true until check_error() reports. Before warmup(): false.
  // After release(): kFailedPrecondition. One host thread at a time (the one driving the layer).
  Status error_pending(bool* pending);

  // Where an FC2 epilogue writes the weighted partial of pool row p itself, instead of combine_send()
  // (bf16 wire): row pool_dst[p] = src * rows_per_rank + token * k + slot names row (token * k + slot)
  // of peer_combine[src] (rank src's combine region through its LSA pointer, rows of H bf16), -1 none;
  // the partial is pool_weight[p] * FC2 row in fp32, rounded to bf16 once. build_expert_pool()
  // rewrites both arrays each forward; combine() then publishes and reduces as after combine_send().
  // Valid after warmup(), and only without the owner reduce (WorkspaceParams::owner_reduce: the owner
  // sums a token's partials before one row goes out, so there is no per-pool-row target; num_ranks
  // is 0 then).
  static constexpr int kMaxCombinePeers = 8;  // = kernels::kMaxTransportRanks
  struct CombineTargets {
    const int32_t* pool_dst = nullptr;
    const float* pool_weight = nullptr;
    void* peer_combine[kMaxCombinePeers] = {};
    int num_ranks = 0;
    int64_t rows_per_rank = 0;
  };
  const CombineTargets& combine_targets() const { return combine_targets_; }

  // The transport kernels' arguments for a launch of `num_tokens` tokens on this rank: what a fused
  // kernel that runs the transport's device code itself needs (signals, peer bases, workspace layout,
  // scratch). Valid after warmup().
  void kernel_params(int64_t num_tokens, kernels::TransportArgs* out) const;
  // [kernels::kBackendCounterWords] int32 of this transport's scratch that the pool build zeroes
  // every forward before any later kernel of it: the backend's per-forward counters (the GEMMs' tile
  // counters). Valid after warmup().
  int32_t* backend_counters() const { return backend_counters_; }
  // Copy i (0, 1) of the gated expert offsets ([E_l + 1] int32), see build_expert_pool().
  const int32_t* gated_offsets(int i) const {
    return gated_offsets_ ? gated_offsets_ + i * (options_.params.experts_per_rank + 1) : nullptr;
  }

  const WorkspaceLayout& layout() const { return layout_; }
  void* base() const { return base_; }  // this rank's copy of the workspace
  // Rank r's copy as this rank's kernels reach it (resolved in warmup; null before).
  void* peer_base(int r) const { return r >= 0 && r < kMaxCombinePeers ? peer_base_[r] : nullptr; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  Communicator* communicator() const { return comm_.get(); }
  int num_sms() const { return num_sms_; }  // SMs the grids are shaped for
  // The launch shape of later calls: EpTransportOptions::num_sms and ::combine_groups, validated as
  // create() does. Between forwards only (no call of this transport in flight or being captured).
  Status set_launch_options(int num_sms, int combine_groups);
  // Bytes this rank's last dispatch/combine configuration moves are computed by callers (bench).

 private:
  EpTransport() = default;
  Status check_ready(cudaStream_t stream, const char* what) const;
  Status check_staged_combine(const char* what) const;  // refuses the combine calls on an in-kernel-reduce workspace
  Status check_tokens(const TensorView& topk_ids, const char* what, int64_t* num_tokens) const;
  Status check_expert_out(const TensorView& expert_out, const char* what) const;
  Status check_output(const TensorView& topk_ids, const TensorView& y, const char* what, int64_t* num_tokens) const;
  // Pinned host snapshot of the error state and the private stream and event that copy it (warmup).
  Status make_error_snapshot();
  void free_error_snapshot();

  std::shared_ptr<Communicator> comm_;
  GpuRankComm* gpu_ = nullptr;
  EpTransportOptions options_;
  WorkspaceLayout layout_;
  int rank_ = 0, size_ = 1, device_ = 0, num_sms_ = 0;
  int shape_sms_ = 0;  // what num_sms = 0 shapes for (the device's SMs, or the shared device's budget / 2)
  int64_t num_experts_ = 0;
  std::shared_ptr<Workspace> workspace_;
  void* base_ = nullptr;
  void* scratch_ = nullptr; // local: pool_intra, pool_hist, seg_total, input status
  int64_t scratch_bytes_ = 0;
  int64_t last_num_tokens_ = 0;
  CombineTargets combine_targets_;
  void* peer_base_[kMaxCombinePeers] = {};  // every rank's workspace copy (warmup)
  bool allow_pdl_ = true;
  bool shares_device_ = false;  // logical ranks on one GPU: the one-kernel combine is a plain launch
  bool warmed_up_ = false, released_ = false;
  int32_t* backend_counters_ = nullptr;
  int32_t* gated_offsets_ = nullptr;
  // error_pending(): [WaitError][signals region][InputStatus] in pinned host memory.
  char* snapshot_ = nullptr;
  cudaStream_t snapshot_stream_ = nullptr;
  cudaEvent_t snapshot_done_ = nullptr;
  bool snapshot_in_flight_ = false;
  bool error_seen_ = false;
};

// Stage names of the transport's waits ("dispatch-done", "combine-done").
const char* transport_stage_name(int32_t stage);

}  // namespace megamoe
