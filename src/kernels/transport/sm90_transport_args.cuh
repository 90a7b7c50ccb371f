// Arguments every EP-transport kernel receives, and small helpers they share.
#pragma once

#include <cstdint>

#include "kernels/common/exact_div.h"
#include "kernels/common/pdl.cuh"
#include "kernels/common/sm90_signals.cuh"
#include "megamoe/formats.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace kernels {

// Kernel-side view of TransportParams (same fields; SignalCtx adds the device methods).
struct TransportArgs {
  SignalCtx sig;
  WorkspaceLayout layout;
  int64_t num_experts;
  int64_t num_tokens;
  bool pow2_scales;
  int32_t* pool_intra;
  int32_t* pool_hist;
  int32_t* seg_total;
  int32_t* pool_dst;
  float* pool_weight;
  int32_t* recv_pool_row;
  InputStatus* input_status;
  DispatchAccum* dispatch_accum;
  int32_t* token_rows;
  CombineCounters* combine_counters;
  bool allow_pdl;
  int32_t* backend_counters;
  int32_t* gated_offsets;
  int64_t gate_rows;
  ExactDiv16 el_div;  // n / experts_per_rank: the owner rank of expert n, the rank of a (rank, expert) index

  static TransportArgs from(const TransportParams& p) {
    TransportArgs a;
    static_cast<SignalParams&>(a.sig) = p.sig;
    a.layout = p.layout;
    a.num_experts = p.num_experts;
    a.num_tokens = p.num_tokens;
    a.pow2_scales = p.pow2_scales;
    a.pool_intra = p.pool_intra;
    a.pool_hist = p.pool_hist;
    a.seg_total = p.seg_total;
    a.pool_dst = p.pool_dst;
    a.pool_weight = p.pool_weight;
    a.recv_pool_row = p.recv_pool_row;
    a.input_status = p.input_status;
    a.dispatch_accum = p.dispatch_accum;
    a.token_rows = p.token_rows;
    a.combine_counters = p.combine_counters;
    a.allow_pdl = p.allow_pdl;
    a.backend_counters = p.backend_counters;
    a.gated_offsets = p.gated_offsets;
    a.gate_rows = p.gate_rows;
    a.el_div = ExactDiv16::make(static_cast<uint32_t>(p.layout.params.experts_per_rank));
    return a;
  }

__device__ __forceinline__ int64_t hidden() const { return layout.params.hidden; }
  __host__ __device__ __forceinline__ int64_t top_k() const { return layout.params.top_k; }
  __host__ __device__ __forceinline__ int64_t t_max() const { return layout.params.max_tokens_per_rank; }
  __host__ __device__ __forceinline__ int64_t experts_per_rank() const { return layout.params.experts_per_rank; }
  __host__ __device__ __forceinline__ int64_t num_chunks() const { return (t_max() + kPoolChunkRows - 1) / kPoolChunkRows; }
  template <typename T>
  __device__ __forceinline__ T* own(const WorkspaceRegion& r) const {
    return reinterpret_cast<T*>(sig.own_base + r.offset);
  }
};

// Counters the next forward's dispatch and pool build use: zeroed by the combine (one thread).
__device__ __forceinline__ void zero_next_forward_counters(const TransportArgs& a) {
  *a.sig.own_cell(a.sig.rank, kLocalDispatchTicket) = 0;
  *a.sig.own_cell(a.sig.rank, kLocalPoolTicket) = 0;
  *a.dispatch_accum = DispatchAccum{};
}

// Programmatic dependent launch for this launch (pdl.cuh): small launches, where allowed.
inline bool use_pdl(const TransportArgs& a) { return a.allow_pdl && pdl_wanted(a.num_tokens); }

// invariant: the same rule decides a slot's validity in layout, dispatch and combine (and the CPU
// protocol): valid iff 0 <= id < E and no earlier slot of the token has the same id; a slot that is
// neither -1 nor valid is bad input (reported, then treated as -1). The dispatch's check pass
// applies it to 32 / k tokens per warp with the same __match_any_sync test keyed by token.
// The rule for one token, by a whole warp at once (all 32 lanes call it): lane j < k reads
// slot j (*my_id; -1 on the other lanes) and __match_any_sync finds a repeat of a lower slot, so the
// token costs one load latency instead of a chain of dependent loads (~1 us each when cold).
// Returns the mask of valid slots (the same on every lane); *my_valid: this lane's slot is valid.
__device__ __forceinline__ uint32_t warp_valid_slots(const int32_t* __restrict__ ids_row, int k, int64_t num_experts,
                                                     int lane, int32_t* my_id, bool* my_valid) {
  const int32_t id = lane < k ? __ldg(ids_row + lane) : -1;
  const uint32_t same = __match_any_sync(0xFFFFFFFFu, static_cast<uint32_t>(id));
  const bool valid = lane < k && id >= 0 && id < num_experts && (same & ((1u << lane) - 1u)) == 0;
  *my_id = id;
  *my_valid = valid;
  return __ballot_sync(0xFFFFFFFFu, valid);
}

__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st_v4(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace kernels
}  // namespace megamoe
