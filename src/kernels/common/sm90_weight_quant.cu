// sm90_weight_quant.cu — see sm90_weight_quant.h.
//
// One CTA per 128x128 block (grid: column blocks, row blocks, experts), 256 threads. Thread t holds
// column t % 128 of rows t / 128 + 2 i (i < 64) as fp32 (a warp reads 32 consecutive bf16 per row);
// the block's amax over the finite elements (max is exact in any order, so it equals the host's
// sequential one), then fmt::fp8_block_scale and fmt::float_to_e4m3(fmt::div_rn(x, s)): the
// functions the host quantiser runs, which return the same bits on the device (formats.h).
#include "kernels/common/sm90_weight_quant.h"

#include "megamoe/formats.h"

namespace megamoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBlock = fmt::kFp8BlockSize;  // 128
constexpr int kRowsPerPass = kThreads / kBlock;  // 2
constexpr int kPerThread = kBlock / kRowsPerPass;  // 64

__global__ void __launch_bounds__(kThreads) quantize_bf16_fp8_block_kernel(const uint16_t* __restrict__ src,
                                                                           int64_t rows, int64_t cols,
                                                                           int64_t swiglu_intermediate, bool pow2,
                                                                           uint8_t* __restrict__ dst,
                                                                           float* __restrict__ dst_scales) {
  const int64_t bc = blockIdx.x, br = blockIdx.y, e = blockIdx.z;
  const int64_t row_blocks = rows / kBlock, col_blocks = cols / kBlock;
  // invariant: the prepared block row of source block row br (gemm_weights.h's SwiGLU order for w13).
  int64_t pbr = br;
  if (swiglu_intermediate > 0) {
    const int64_t half = swiglu_intermediate / kBlock;
    pbr = br < half ? 2 * br : 2 * (br - half) + 1;
  }
  const int col = threadIdx.x % kBlock, row0 = threadIdx.x / kBlock;
  const uint16_t* in = src + (e * rows + br * kBlock) * cols + bc * kBlock + col;
  float x[kPerThread];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    x[i] = fmt::bf16_to_float(in[(row0 + kRowsPerPass * i) * cols]);
    const float a = fmt::finite_abs(x[i]);
    if (a > amax) amax = a;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, amax, offset);
    if (other > amax) amax = other;
  }
  __shared__ float warp_amax[kThreads / 32];
  __shared__ float block_scale;
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    for (int w = 0; w < kThreads / 32; ++w)
      if (warp_amax[w] > m) m = warp_amax[w];
    block_scale = fmt::fp8_block_scale(m, pow2);
    dst_scales[(e * row_blocks + pbr) * col_blocks + bc] = block_scale;
  }
  __syncthreads();
  const float s = block_scale;
  uint8_t* out = dst + (e * rows + pbr * kBlock) * cols + bc * kBlock + col;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) out[(row0 + kRowsPerPass * i) * cols] = fmt::float_to_e4m3(fmt::div_rn(x[i], s));
}

}  // namespace

cudaError_t launch_quantize_bf16_fp8_block(const uint16_t* src, int64_t num_experts, int64_t rows, int64_t cols,
                                           int64_t swiglu_intermediate, bool pow2, uint8_t* dst, float* dst_scales,
                                           cudaStream_t stream) {
  if (num_experts <= 0 || rows <= 0 || cols <= 0) return cudaSuccess;
  if (!src || !dst || !dst_scales || rows % kBlock != 0 || cols % kBlock != 0 || num_experts > 65535 ||
      rows / kBlock > 65535 || (swiglu_intermediate > 0 && (rows != 2 * swiglu_intermediate ||
                                                           swiglu_intermediate % kBlock != 0)))
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(cols / kBlock), static_cast<unsigned>(rows / kBlock),
                  static_cast<unsigned>(num_experts));
  quantize_bf16_fp8_block_kernel<<<grid, kThreads, 0, stream>>>(src, rows, cols, swiglu_intermediate, pow2, dst,
                                                                dst_scales);
  return cudaGetLastError();
}

}  // namespace megamoe::kernels
