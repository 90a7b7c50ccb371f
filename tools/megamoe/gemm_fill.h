// gemm_fill.h — device fills for GEMM benchmarks: random but finite operands, generated on the GPU
// (a host generator would spend seconds on the multi-GB weight sets of the benchmark).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::gemm {

// e4m3 codes with |value| <= 2 (never NaN), from a counter-based hash of (seed, index).
cudaError_t fill_random_e4m3(void* dst, int64_t count, uint64_t seed, cudaStream_t stream);
// bf16 values uniform in [-1, 1).
cudaError_t fill_random_bf16(void* dst, int64_t count, uint64_t seed, cudaStream_t stream);
// fp32 values uniform in [lo, hi).
cudaError_t fill_random_f32(float* dst, int64_t count, float lo, float hi, uint64_t seed, cudaStream_t stream);

// A random mxfp4 weight image (gemm_weights.h's device_image for E x N x K): block scales in [0.5, 2),
// random codes, every shift byte a valid table offset (8 * [0, 20]).
cudaError_t fill_random_mxfp4_image(void* image, int64_t num_experts, int64_t n, int64_t k, uint64_t seed,
                                    cudaStream_t stream);

// A random nvfp4 weight image (gemm_weights.h's Nvfp4GemmWeights device_image for E x N x K): global
// scales in [0.5, 2), random codes, block scales in [2^-2, 2^2).
cudaError_t fill_random_nvfp4_image(void* image, int64_t num_experts, int64_t n, int64_t k, uint64_t seed,
                                    cudaStream_t stream);

// Reads `bytes` (a multiple of 16) of src, 16-byte aligned: an L2 flush that leaves L2 holding clean
// lines (a memset leaves them dirty, and the next kernel's loads pay for their write-back).
cudaError_t read_through(const void* src, int64_t bytes, uint32_t* sink, cudaStream_t stream);

}  // namespace megamoe::gemm
