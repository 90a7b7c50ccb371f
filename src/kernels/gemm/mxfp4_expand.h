// mxfp4_expand.h — an mxfp4 GEMM image (gemm_weights.h) expanded on the device into fp8-block weights; an
// nvfp4 one into bf16 weights (below).
//
// The e4m3 codes are the ones the mxfp4 GEMM computes with (gemm::mxfp4_gemm_e4m3, i.e.
// fmt::mxfp4_to_fp8_128x128's), written row-major [E, N, K]; the 128 x 128 block scales are the
// image's own first region (mxfp4_image_block_scales), already [E, N/128, K/128] fp32. So a kFp8Block
// GEMM with b = the expansion and b_scales = the image's block scales multiplies exactly the values
// the kMxfp4 GEMM multiplies, with fp8-block's tiles (128 x 256, clusters): what the routed backend
// runs at prefill, where those tiles' MMA rate matters more than the extra bytes (docs/GEMM.md,
// "FP4 weights at prefill").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::gemm {

// The fp32 block scales [E, N/128, K/128] at the start of an mxfp4 device image (device_image()).
inline const float* mxfp4_image_block_scales(const void* image) { return static_cast<const float*>(image); }

// Bytes of the expansion of num_experts x n x k weights (one e4m3 byte each).
constexpr int64_t mxfp4_expanded_bytes(int64_t num_experts, int64_t n, int64_t k) { return num_experts * n * k; }

// Expands experts [first_expert, first_expert + count) of `image` (device, device_image() of an
// Mxfp4GemmWeights of num_experts x n x k: n a multiple of 64, k of 128) into `out` (device,
// mxfp4_expanded_bytes(count, n, k), 16-byte aligned; expert first_expert + i at i * n * k).
// expert_offsets (device int32 [num_experts + 1], indexed by the image's expert; may be null): experts
// whose segment [offsets[e], offsets[e+1]) is empty are skipped and their bytes of `out` left as they
// were (no GEMM tile reads them). max_ctas > 0 bounds the grid (a shared device's SM budget); 0: as
// many as keep the copy at HBM speed. Launches on `stream`, no host synchronisation, capturable.
// cudaErrorInvalidValue for a shape or range outside those rules.
cudaError_t launch_expand_mxfp4(const void* image, int32_t num_experts, int32_t n, int32_t k, int32_t first_expert,
                                int32_t count, const int32_t* expert_offsets, void* out, int max_ctas,
                                cudaStream_t stream);

// nvfp4: the bf16 values the nvfp4 GEMM computes with (gemm::nvfp4_gemm_bf16 = expand_nvfp4_to_bf16's:
// e2m1 x e4m3 block scale, exact), row-major [E, N, K] bf16; the global scales stay the image's first
// region (nvfp4_image_global_scales), which a kBf16 GEMM takes as b_expert_scale (the scaled SwiGLU) or
// the caller folds into its row weights. What the routed backend runs at prefill: bf16's 64- and
// 128-row tiles on the expansion instead of re-expanding the codes for every 32 rows.
inline const float* nvfp4_image_global_scales(const void* image) { return static_cast<const float*>(image); }
constexpr int64_t nvfp4_expanded_bytes(int64_t num_experts, int64_t n, int64_t k) { return num_experts * n * k * 2; }
// As launch_expand_mxfp4 (the same rules for the range, the skipped experts and max_ctas), for an
// Nvfp4GemmWeights image: n a multiple of 64, k of 128; `out` nvfp4_expanded_bytes(count, n, k).
cudaError_t launch_expand_nvfp4(const void* image, int32_t num_experts, int32_t n, int32_t k, int32_t first_expert,
                                int32_t count, const int32_t* expert_offsets, void* out, int max_ctas,
                                cudaStream_t stream);

}  // namespace megamoe::gemm
