// Small per-forward kernels of the routed backend around the transport: the routing as the
// transport reads it, and the per-local-expert receive counters. Both are stream-ordered and
// capturable; n == 0 launches nothing. max_blocks > 0 caps the grid (a rank sharing its GPU keeps to
// its SM budget); 0 = as many as the work needs (at most 1024).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::kernels {

// ids_out[i] = int32(ids[i]) (int64 ids saturate to the int32 range, so an id outside it stays a
// bad id for the dispatch to report); weights_out[i] = output_scale * float(weights[i]) in fp32
// (weights fp32, or bf16 when weights_bf16). i in [0, n).
cudaError_t launch_routing_prep(const void* ids, bool ids_int64, const void* weights, bool weights_bf16,
                                float output_scale, int64_t n, int32_t* ids_out, float* weights_out,
                                int max_blocks, cudaStream_t stream);

// counts[e] += expert_offsets[e + 1] - expert_offsets[e] for e in [0, num_experts): the rows each
// local expert received this forward (expert_offsets: the pool's prefix, built by build_expert_pool).
// counts is int64 (counts_int64) or int32.
cudaError_t launch_accumulate_expert_counts(const int32_t* expert_offsets, int64_t num_experts, void* counts,
                                            bool counts_int64, int max_blocks, cudaStream_t stream);

}  // namespace megamoe::kernels
