// Device helpers every EP-transport kernel shares (their arguments, TransportArgs: sm90_launch.h).
#pragma once

#include <cstdint>

#include "kernels/common/pdl.cuh"
#include "kernels/common/sm90_signals.cuh"
#include "kernels/transport/sm90_launch.h"
#include "megamoe/formats.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace kernels {

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
