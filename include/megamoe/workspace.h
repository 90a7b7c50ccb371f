// megamoe/workspace.h — the symmetric workspace: one layout struct for host (sizing, allocation)
// and device (carving), and the pool that shares one workspace between layers of a geometry.
//
// Contract:
// - WorkspaceLayout::make() is a pure function of WorkspaceParams, the same on every rank, so the
//   same offset names the same region in every peer's copy (what symmetric memory needs).
// - Every size follows the per-rank bound max_tokens_per_rank (T_max) and nothing else: no dp or ep
//   factor is applied to it. The total is affine in T_max (a constant for signals and per-expert
//   padding, plus a term proportional to T_max).
// - Usable from CUDA device code (MEGAMOE_HD); includes no CUDA header.
//
// Regions, in order (R ranks, E_l = experts per rank, k = top_k, H = hidden, I = intermediate,
// SA = segment_align; every region starts on a 256-byte boundary):
//   signals             R * kSignalSlots * 8          epoch-tagged counters peers bump (uint64)
//   error_cell          64                            first bounded-wait failure (WaitError)
//   recv_token_counts   R * 4                         tokens rank s sent here (int32, written by s)
//   recv_expert_counts  R * E_l * 4                   of those, rows per local expert (int32); mega:
//                       (x 2 with mega)               two banks [launch parity][source][local expert]
//                                                     that the sources add their rows to
//   recv_tokens         R * T_max * H * e_d           dispatch wire target, row s*T_max+i: the i-th
//                                                     token rank s sent here (e_d: 1 fp8, 2 bf16)
//   recv_scales         R * T_max * H/128 * 4         fp32 1x128 scales (fp8 dispatch only)
//   recv_meta           R * T_max * meta_bytes        TokenMeta: source token, per-slot local expert
//                                                     (-1: not here) and weight
//   expert_offsets      (E_l + 1) * 4                 prefix of per-expert rows padded to SA
//   pool_src            P * 4 (0 with mega)           expert-major row -> recv_row*k + slot (-1 pad)
//   pool_x              P * H * e_d                   expert-major FC1 input (A operand)
//   pool_x_scales       P * H/128 * 4                 (fp8 dispatch only)
//   intermediate        P * I * e_i                   SwiGLU output, FC2 input (e_i: 1 fp8, 2 bf16)
//   intermediate_scales P * I/128 * 4                 (fp8 intermediate only)
//   combine             T_max * n_c * wire_row_bytes  FC2 partials for this rank's tokens: n_c = k,
//                                                     row t*k+j (slot j's partial); with the owner
//                                                     reduce n_c = R, row t*R+r (the sum of owner r's
//                                                     slots); absent with the in-kernel FC2 reduce
// where P = pool_rows = round_up(R*T_max*min(k, E_l) + E_l*(SA-1), lcm(SA, 4)) (0 when T_max = 0):
// every (token, local expert) pair once, plus each expert's padding to a multiple of SA, rounded to a
// multiple of 4 rows: the pool's M-major scale arrays (pool_x_scales as FC1 reads them,
// intermediate_scales) have leading dimension P, and the GEMM's TMA needs rows of 16 bytes. Layers use
// SA = kPoolSegmentAlign = 1: the grouped GEMM runs any segment start and length (rows past a segment
// are loaded but never stored), so padding would only cost zero-fill bytes and pool rows.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif

namespace megamoe {

// Wire/storage codes for the workspace (plain ints so device code needs no enum header).
enum WsFormat : int32_t { kWsBf16 = 0, kWsFp8Block = 1, kWsMxfp8 = 2, kWsNvfp4 = 3 };

// The expert pool's segment alignment in rows that layers build (see above).
constexpr int64_t kPoolSegmentAlign = 1;

struct WorkspaceParams {
  int64_t ep_size = 1;
  int64_t experts_per_rank = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t max_tokens_per_rank = 0;
  int64_t segment_align = 1;  // rows; every expert segment of the pool starts on a multiple
  int32_t dispatch_format = kWsFp8Block;      // kWsBf16 | kWsFp8Block
  int32_t intermediate_format = kWsFp8Block;  // kWsBf16 | kWsFp8Block
  int32_t combine_format = kWsBf16;           // kWsBf16 | kWsMxfp8 | kWsNvfp4
  int32_t in_kernel_fc2_reduce = 0;
  // Each owner sums its slots' partials of a token (fp32, slot order) and sends one combine row per
  // (token, owner) instead of one per (token, slot); the source sums the owners' rows in rank order.
  int32_t owner_reduce = 0;
  // The mega backend's layout (the one-kernel forward): two count banks, pool rows a multiple of 4, no
  // pool_src (its placement needs no inverse map).
  int32_t mega = 0;
};

struct WorkspaceRegion {
  int64_t offset = 0;
  int64_t bytes = 0;
  MEGAMOE_HD int64_t end() const { return offset + bytes; }
};

// Per received token: its index on the source rank and, per top-k slot, the local expert it goes to
// here (-1 when that slot's expert lives elsewhere or is -1) and the slot's routing weight.
// Stored as int32 src_token, int32 local_expert[k], float weight[k], padded to 16 bytes.
MEGAMOE_HD int64_t token_meta_bytes(int64_t top_k) { return ((1 + 2 * top_k) * 4 + 15) / 16 * 16; }

// Bytes of one combine-wire row of H values.
//   bf16:  2H
//   mxfp8: H (e4m3) + H/32 (e8m0 scales)
//   nvfp4: H/2 (packed e2m1) + H/16 (e4m3 scales) + 4 (fp32 global scale)
MEGAMOE_HD int64_t combine_row_bytes(int32_t combine_format, int64_t hidden) {
  switch (combine_format) {
    case kWsMxfp8: return hidden + hidden / 32;
    case kWsNvfp4: return hidden / 2 + hidden / 16 + 4;
    default: return 2 * hidden;
  }
}

MEGAMOE_HD int64_t ws_elem_bytes(int32_t format) { return format == kWsBf16 ? 2 : 1; }

struct WaitError {
  int32_t flag;      // 0 = none; else 1
  int32_t rank;      // rank that timed out
  int32_t sm;        // SM (or host thread) that waited
  int32_t stage;     // what it waited for (backend-defined stage id)
  int32_t peer;      // the peer it waited on
  int32_t pad;
  int64_t expected;  // value it waited for
  int64_t seen;      // value it last saw
};

struct WorkspaceLayout {
  static constexpr int64_t kAlign = 256;
  static constexpr int64_t kSignalSlots = 16;

  WorkspaceParams params;
  int64_t pool_rows = 0;
  int64_t meta_bytes = 0;
  int64_t wire_row_bytes = 0;

  WorkspaceRegion signals, error_cell, recv_token_counts, recv_expert_counts, recv_tokens, recv_scales,
      recv_meta, expert_offsets, pool_src, pool_x, pool_x_scales, intermediate, intermediate_scales,
      combine;
  int64_t total_bytes = 0;

  static constexpr int kNumRegions = 14;

  MEGAMOE_HD static int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

  // Combine rows per token: one per slot (k), or one per owner rank (R) with the owner reduce.
  MEGAMOE_HD static int64_t combine_rows_per_token(const WorkspaceParams& p) {
    return p.owner_reduce ? p.ep_size : p.top_k;
  }

  // Rows of the pool are a multiple of this (and of segment_align): lcm(segment_align, 4).
  MEGAMOE_HD static int64_t pool_row_multiple(int64_t segment_align) {
    const int64_t sa = segment_align > 0 ? segment_align : 1;
    return sa % 4 == 0 ? sa : sa % 2 == 0 ? 2 * sa : 4 * sa;
  }

  MEGAMOE_HD static int64_t pool_rows_for(const WorkspaceParams& p) {
    if (p.max_tokens_per_rank <= 0 || p.experts_per_rank <= 0) return 0;
    const int64_t k_here = p.top_k < p.experts_per_rank ? p.top_k : p.experts_per_rank;
    const int64_t pairs = p.ep_size * p.max_tokens_per_rank * k_here;
    return align_up(pairs + p.experts_per_rank * (p.segment_align - 1), pool_row_multiple(p.segment_align));
  }

  MEGAMOE_HD static WorkspaceLayout make(const WorkspaceParams& p) {
    WorkspaceLayout l;
    l.params = p;
    l.pool_rows = pool_rows_for(p);
    l.meta_bytes = token_meta_bytes(p.top_k);
    l.wire_row_bytes = combine_row_bytes(p.combine_format, p.hidden);
    const int64_t R = p.ep_size, T = p.max_tokens_per_rank, El = p.experts_per_rank, H = p.hidden;
    const int64_t I = p.intermediate, P = l.pool_rows;
    const bool fp8_d = p.dispatch_format == kWsFp8Block;
    const bool fp8_i = p.intermediate_format == kWsFp8Block;
    int64_t cursor = 0;
    auto take = [&cursor](WorkspaceRegion& r, int64_t bytes) {
      r.offset = cursor;
      r.bytes = bytes;
      cursor = align_up(cursor + bytes, kAlign);
    };
    take(l.signals, R * kSignalSlots * 8);
    take(l.error_cell, 64);
    take(l.recv_token_counts, R * 4);
    take(l.recv_expert_counts, (p.mega ? 2 : 1) * R * El * 4);
    take(l.recv_tokens, R * T * H * ws_elem_bytes(p.dispatch_format));
    take(l.recv_scales, fp8_d ? R * T * (H / 128) * 4 : 0);
    take(l.recv_meta, R * T * l.meta_bytes);
    take(l.expert_offsets, (El + 1) * 4);
    take(l.pool_src, p.mega ? 0 : P * 4);
    take(l.pool_x, P * H * ws_elem_bytes(p.dispatch_format));
    take(l.pool_x_scales, fp8_d ? P * (H / 128) * 4 : 0);
    take(l.intermediate, P * I * ws_elem_bytes(p.intermediate_format));
    take(l.intermediate_scales, fp8_i ? P * (I / 128) * 4 : 0);
    // in-kernel FC2 reduce: mega's bf16 accumulation row per token (the owners add into it, the source
    // copies it to y and zeroes it); the cpu protocol adds into y itself
    take(l.combine, p.in_kernel_fc2_reduce ? (p.mega ? T * H * 2 : 0) : T * combine_rows_per_token(p) * l.wire_row_bytes);
    l.total_bytes = cursor;
    return l;
  }

  // Region by index, in the order above (for printing and tests).
  MEGAMOE_HD const WorkspaceRegion& region(int i) const {
    const WorkspaceRegion* all[kNumRegions] = {&signals, &error_cell, &recv_token_counts,
                                               &recv_expert_counts, &recv_tokens, &recv_scales,
                                               &recv_meta, &expert_offsets, &pool_src, &pool_x,
                                               &pool_x_scales, &intermediate, &intermediate_scales,
                                               &combine};
    return *all[i];
  }
  static const char* region_name(int i);
  static const char* region_formula(int i);

  template <typename T>
  MEGAMOE_HD T* at(void* base, const WorkspaceRegion& r) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + r.offset);
  }
};

}  // namespace megamoe

#if !defined(__CUDACC_RTC__)
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"

namespace megamoe {

// The parameters a layer with this geometry and config needs.
WorkspaceParams workspace_params(const MoeGeometry& geometry, const MoeConfig& config);

// One allocated workspace. Freed (through its deleter) when the last layer using it goes away.
struct Workspace {
  WorkspaceLayout layout;
  void* base = nullptr;
  Device device;
  std::function<void(void*)> release;
  ~Workspace() {
    if (release && base) release(base);
  }
};

// What makes two layers' workspaces interchangeable: the layout parameters, the rank, the group, the
// device and the lane (MoeConfig::workspace_lane: layers that may run concurrently take different
// lanes). Never the identity of per-layer tensors.
struct WorkspaceKey {
  WorkspaceParams params;
  int64_t ep_rank = 0;
  uint64_t group_id = 0;
  Device device;
  int32_t lane = 0;
  bool operator<(const WorkspaceKey& o) const;
  std::string to_string() const;
};

// Shares one workspace between all live layers with the same key (refcounted through shared_ptr).
// Safe because layers of one key run one after another on a stream (layer.h states the rules).
// Allocation through the pool is collective when `allocate` is: all ranks must acquire the same keys
// in the same order. One key is allocated at most once at a time: a second acquirer of a key whose
// allocation is under way (another thread of the same rank) waits for it (bounded by
// MEGAMOE_BARRIER_TIMEOUT_MS) and shares the result, or gets its error; it never runs a second
// collective allocation that its peers would not match. A failed allocation leaves nothing behind, so
// acquire() may be retried.
class WorkspacePool {
 public:
  using Allocator = std::function<Status(int64_t bytes, void** base, std::function<void(void*)>* release)>;

  static WorkspacePool& global();

  Status acquire(const WorkspaceKey& key, const Allocator& allocate, std::shared_ptr<Workspace>* out);
  // Live workspaces (for tests and `megamoe info`).
  int64_t num_live() const;
  int64_t live_bytes() const;

 private:
  struct Entry;
  mutable std::mutex mutex_;
  std::map<WorkspaceKey, std::shared_ptr<Entry>> entries_;
};

}  // namespace megamoe
#endif
