#include "kernels/routed/sm90_routing.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>

namespace megamoe::kernels {
namespace {

constexpr int kThreads = 256;

template <bool kIds64, bool kWeightsBf16>
__global__ void routing_prep_kernel(const void* __restrict__ ids, const void* __restrict__ weights, float scale,
                                    int64_t n, int32_t* __restrict__ ids_out, float* __restrict__ weights_out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    if constexpr (kIds64) {
      const long long v = static_cast<const long long*>(ids)[i];
      ids_out[i] = static_cast<int32_t>(v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : v);
    } else {
      ids_out[i] = static_cast<const int32_t*>(ids)[i];
    }
    float w;
    if constexpr (kWeightsBf16) {
      w = __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[i]);
    } else {
      w = static_cast<const float*>(weights)[i];
    }
    weights_out[i] = __fmul_rn(scale, w);
  }
}

template <typename Count>
__global__ void accumulate_expert_counts_kernel(const int32_t* __restrict__ offsets, int64_t num_experts,
                                                Count* __restrict__ counts) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < num_experts;
       e += static_cast<int64_t>(gridDim.x) * kThreads)
    counts[e] += static_cast<Count>(offsets[e + 1] - offsets[e]);
}

unsigned blocks_for(int64_t n, int max_blocks) {
  const int64_t cap = max_blocks > 0 ? std::min(max_blocks, 1024) : 1024;
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, cap));
}

}  // namespace

cudaError_t launch_routing_prep(const void* ids, bool ids_int64, const void* weights, bool weights_bf16,
                                float output_scale, int64_t n, int32_t* ids_out, float* weights_out,
                                int max_blocks, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!ids || !weights || !ids_out || !weights_out) return cudaErrorInvalidValue;
  const unsigned blocks = blocks_for(n, max_blocks);
  if (ids_int64 && weights_bf16)
    routing_prep_kernel<true, true><<<blocks, kThreads, 0, stream>>>(ids, weights, output_scale, n, ids_out, weights_out);
  else if (ids_int64)
    routing_prep_kernel<true, false><<<blocks, kThreads, 0, stream>>>(ids, weights, output_scale, n, ids_out, weights_out);
  else if (weights_bf16)
    routing_prep_kernel<false, true><<<blocks, kThreads, 0, stream>>>(ids, weights, output_scale, n, ids_out, weights_out);
  else
    routing_prep_kernel<false, false><<<blocks, kThreads, 0, stream>>>(ids, weights, output_scale, n, ids_out, weights_out);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_expert_counts(const int32_t* expert_offsets, int64_t num_experts, void* counts,
                                            bool counts_int64, int max_blocks, cudaStream_t stream) {
  if (num_experts <= 0) return cudaSuccess;
  if (!expert_offsets || !counts) return cudaErrorInvalidValue;
  if (counts_int64)
    accumulate_expert_counts_kernel<<<blocks_for(num_experts, max_blocks), kThreads, 0, stream>>>(
        expert_offsets, num_experts, static_cast<long long*>(counts));
  else
    accumulate_expert_counts_kernel<<<blocks_for(num_experts, max_blocks), kThreads, 0, stream>>>(
        expert_offsets, num_experts, static_cast<int32_t*>(counts));
  return cudaGetLastError();
}

}  // namespace megamoe::kernels
