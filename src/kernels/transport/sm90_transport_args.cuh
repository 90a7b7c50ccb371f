// Arguments every EP-transport kernel receives, and small helpers they share.
#pragma once

#include <cstdint>

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
  InputStatus* input_status;

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
    a.input_status = p.input_status;
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

// invariant: the same rule decides a slot's validity in layout, dispatch and combine:
// valid iff 0 <= id < E and no earlier slot of the token has the same id.
__device__ __forceinline__ bool slot_valid(const int32_t* ids_row, int j, int64_t num_experts) {
  const int32_t id = ids_row[j];
  if (id < 0 || id >= num_experts) return false;
  for (int jj = 0; jj < j; ++jj)
    if (ids_row[jj] == id) return false;
  return true;
}

// A slot that is neither -1 nor valid: reported as bad input, then treated as -1.
__device__ __forceinline__ bool slot_bad(const int32_t* ids_row, int j, int64_t num_experts) {
  return ids_row[j] != -1 && !slot_valid(ids_row, j, num_experts);
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
