// Host launchers of the EP-transport kernels (checked; no synchronisation; capturable), and the plain
// parameter structs host code fills (no device code here, so host .cpp files can include it).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

#include "kernels/common/exact_div.h"
#include "megamoe/status.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace kernels {

constexpr int kMaxTransportRanks = 8;  // one NVLink domain (LSA team) of H100/H200 GPUs
constexpr int kPoolChunkRows = 32;     // recv rows ranked together by one warp in the pool build
constexpr int kMaxTopK = 16;           // top_k bound of the transport (meta row fits one warp)

// Dispatch wire modes (x format -> wire format).
enum DispatchMode : int { kBf16ToFp8 = 0, kFp8Copy = 1, kBf16Copy = 2, kFp8ToBf16 = 3 };

// Stage ids shared with the CPU reference (reference::ProtocolStage).
// The mega kernel's own waits: a grid barrier of its CTAs, and an FC2 tile waiting for its FC1 rows.
// (and an FC1 tile waiting for its expert's rows to be placed in the pool).
enum TransportStage : int32_t {
  kStageDispatchDone = 3,
  kStageCombineDone = 4,
  kStageMegaGrid = 5,
  kStageMegaFc1 = 6,
  kStageMegaPlaced = 7,
};

// Cells of the signals region (uint64 [R][WorkspaceLayout::kSignalSlots]); see sm90_signals.cuh.
enum SignalSlot : int {
  kSlotDispatch = 0,
  kSlotCombine = 1,
  kSlotAbort = 2,
  // Local cells (row = own rank).
  kLocalEpoch = 8,           // launch epoch, bumped by the dispatch kernel's last CTA (by ticket)
  kLocalDispatchTicket = 9,  // blocks of the dispatch kernel that finished (last one resets it)
  kLocalCombineTicket = 10,  // blocks of combine_kernel that finished sending (last one resets it)
  kLocalPoolTicket = 11,     // blocks of pool_offsets_kernel that finished (last one resets it)
};
// invariant: every per-launch counter (the tickets above, DispatchAccum, CombineCounters, the
// backend's counters) is also re-zeroed once per forward by a kernel that runs strictly between two
// of its uses (the pool build zeroes the combine's and the backend's, the combine the dispatch's and
// the pool build's), so a counter left off zero (a launch that died, a misuse) spoils one forward at
// most, never every later one.

// Combine progress cell values (sm90_combine.cuh): epoch << kCombineBoundBits | bound, modulo 2^64.
constexpr int kCombineBoundBits = 20;
constexpr uint64_t kCombineAllRows = (uint64_t(1) << kCombineBoundBits) - 1;  // > any recv row (T_max <= 65535)
MEGAMOE_HD uint64_t combine_progress(uint64_t epoch, uint64_t bound) { return epoch << kCombineBoundBits | bound; }
// Dispatch cell value once `launches` dispatches of a source have completed, modulo 2^64.
MEGAMOE_HD uint64_t dispatch_progress(uint64_t launches) { return launches << 32; }

// WaitError::flag values.
enum WaitErrorKind : int32_t {
  kWaitOk = 0,
  kWaitTimeout = 1,    // this rank gave up waiting for a peer
  kWaitPeerAbort = 2,  // a peer (or this rank, earlier) aborted the group
  kWaitDesync = 3,     // a peer's signal is ahead of this rank's epoch: the ranks ran different launch counts
};

// Bad routing input seen on the device (sticky until the host reads and clears it in check_error()).
struct InputStatus {
  int32_t bad_count;    // slots with an id outside [-1, E) or repeating an earlier slot's id
  int32_t first_token;  // first bad (token, slot) of the first launch that had one
  int32_t first_slot;
  int32_t first_value;
  int32_t pool_overflow;  // received rows that did not fit the expert pool (inconsistent peers)
  int32_t pad[3];
};

// Bad input the dispatch CTAs of a launch sum up for the last one to record (device scratch, zero
// between launches: the recording CTA returns it to zero).
struct DispatchAccum {
  unsigned long long first_bad;  // UINT64_MAX - (first bad token * k + slot), 0: none
  int32_t num_bad;
  int32_t pad;
};

// Combine progress (fused combine, sm90_combine.cuh): what the sending CTAs of one launch count, in
// device scratch (zero between launches: the last taker of each counter returns it to zero).
constexpr int kMaxCombineGroups = 8;
struct CombineCounters {
  uint64_t group_ticket[kMaxCombineGroups];  // sending CTAs done with group g
  unsigned long long next_token;             // the next token a reducing warp takes
  unsigned long long done;                   // CTAs finished
  uint64_t published;                        // groups whose progress is published (in group order)
};

// What a kernel needs to reach its peers' copies and to wait boundedly: the fields the host fills.
struct SignalParams {
  ncclWindow_t window;    // the symmetric workspace window
  char* own_base;         // this rank's copy of the workspace (local pointer)
  // Each rank's copy as this rank's kernels reach it, resolved once in warmup (GpuRankComm::peer_bases:
  // an LSA peer's window is one fixed mapping, so base + offset addresses any byte of it; a shared
  // GPU's siblings are plain device pointers); null: kernels ask ncclGetPeerPointer of `window`,
  // whose chain of dependent loads from the window's tables costs the dispatch ~5 us per launch.
  char* peer_base[kMaxTransportRanks];
  int64_t signals_offset;
  WaitError* error_cell;  // this rank's error cell (local)
  int rank;
  int num_ranks;
  int64_t timeout_ns;
};
// The same with the device accessors, declared for nvcc and defined in sm90_signals.cuh (they need
// NCCL's device API). A derived struct rather than one: merged, the kernels' copies of it compile to
// other instructions (the combine kernels' SASS changes).
struct SignalCtx : SignalParams {
#if defined(__CUDACC__)
  __device__ __forceinline__ uint64_t* own_signals() const;
  // Cell [row][slot] in this rank's copy.
  __device__ __forceinline__ uint64_t* own_cell(int row, int slot) const;
  // Any pointer into `peer`'s copy of the workspace, by byte offset.
  __device__ __forceinline__ char* peer_ptr(int peer, int64_t offset) const;
  // Cell [row][slot] in `peer`'s copy.
  __device__ __forceinline__ uint64_t* peer_cell(int peer, int row, int slot) const;
  __device__ __forceinline__ uint64_t local_epoch() const;
#endif
};

// The arguments of every EP-transport kernel (and the transport part of the mega kernel's), passed
// by value: filled by the host (EpTransport::kernel_params), read on the device with the helpers
// of sm90_transport_args.cuh.
struct TransportArgs {
  SignalCtx sig;
  WorkspaceLayout layout;
  int64_t num_experts;  // E = R * E_l
  int64_t num_tokens;   // T of this launch (this rank)
  bool pow2_scales;
  // Local (non-symmetric) scratch, allocated at warmup.
  int32_t* pool_intra;  // [R * T_max, k] rank of (recv row, slot) among its chunk's rows of that expert
  int32_t* pool_hist;   // [R, chunks, E_l] rows per expert per chunk, then exclusive prefix (base)
  int32_t* seg_total;   // [E_l] real rows per local expert
  int32_t* pool_dst;    // [P] where pool row p's partial goes: src rank * T_max*k + token*k + slot (-1: none)
  float* pool_weight;   // [P] its routing weight
  int32_t* recv_pool_row;  // [R * T_max, k] pool row of (recv row, slot), -1: none (owner reduce only)
  InputStatus* input_status;
  DispatchAccum* dispatch_accum;
  int32_t* token_rows;           // [T_max, R] this rank's token t's recv row at owner r (-1: none), by dispatch
  CombineCounters* combine_counters;
  bool allow_pdl;  // programmatic dependent launch for small launches (off on a shared device)
  // The backend's per-forward counters ([kBackendCounterWords] int32, per layer: the GEMMs' tile
  // counters), zeroed by the pool build every forward before any later kernel of it runs.
  int32_t* backend_counters;
  // gate_rows >= 0: the pool build also writes expert_offsets into gated_offsets + (real rows >=
  // gate_rows ? E_l + 1 : 0) and zeros into the other copy ([2][E_l + 1] int32), so of two kernels
  // launched one on each copy exactly one has rows (the tile bucket chosen on the device).
  int32_t* gated_offsets;
  int64_t gate_rows;
  ExactDiv16 el_div;  // n / experts_per_rank: the owner rank of expert n, the rank of a (rank, expert) index

  MEGAMOE_HD int64_t hidden() const { return layout.params.hidden; }
  MEGAMOE_HD int64_t top_k() const { return layout.params.top_k; }
  MEGAMOE_HD int64_t t_max() const { return layout.params.max_tokens_per_rank; }
  MEGAMOE_HD int64_t experts_per_rank() const { return layout.params.experts_per_rank; }
  MEGAMOE_HD int64_t num_chunks() const { return (t_max() + kPoolChunkRows - 1) / kPoolChunkRows; }
  template <typename T>
  MEGAMOE_HD T* own(const WorkspaceRegion& r) const {
    return reinterpret_cast<T*>(sig.own_base + r.offset);
  }
};

constexpr int kBackendCounterWords = 8;

// Dispatch: one fused layout + copy kernel for `mode`, shaped for `num_sms` SMs.
Status launch_dispatch(const TransportArgs& args, int mode, const void* x, const float* x_scale,
                       const int32_t* topk_ids, const float* topk_weights, int num_sms, cudaStream_t stream);
// pool_weight_scale (null: none): fp32 [experts_per_rank], each pool row's weight times its local
// expert's entry (pool_scatter_scaled_kernel).
Status launch_expert_pool(const TransportArgs& args, int num_sms, cudaStream_t stream,
                          const float* pool_weight_scale = nullptr);
// The pool build's choice between the two gated copies of expert_offsets (gate_rows >= 0), for tests.
MEGAMOE_HD int gated_copy_for(int64_t real_rows, int64_t gate_rows) { return real_rows >= gate_rows ? 1 : 0; }
// expert_out: fp32 when out_is_fp32, else bf16. Grids are shaped for `num_sms` SMs.
Status launch_combine_send(const TransportArgs& args, const void* expert_out, bool out_is_fp32, int num_sms,
                           cudaStream_t stream);
Status launch_combine_reduce(const TransportArgs& args, const int32_t* topk_ids, uint16_t* y, int num_sms,
                             cudaStream_t stream);
// Both in one kernel (combine_kernel): send, publish progress, wait, reduce. groups > 1: the rows go
// out in `groups` recv-row groups, each published as it completes, and an eighth of the CTAs reduce
// the tokens whose rows have all arrived while the others still send (see combine_kernel).
// Its CTAs wait on each other, so all must be resident: `cooperative` launches it so (the driver
// refuses a grid that cannot be); on a device shared by logical ranks it is a plain launch within the
// rank's SM budget instead (every rank's grids fit at once by that budget, and two ranks' cooperative
// grids on two streams need not be scheduled together: each could wait for the other's SMs).
Status launch_combine(const TransportArgs& args, const void* expert_out, bool out_is_fp32, const int32_t* topk_ids,
                      uint16_t* y, int groups, int num_sms, bool cooperative, cudaStream_t stream);

}  // namespace kernels
}  // namespace megamoe
