// sm90_nvfp4_expand.cu — launch_expand_nvfp4 (mxfp4_expand.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/mxfp4_expand.h"
#include "kernels/gemm/sm90_gemm_ptx.cuh"
#include "megamoe/formats.h"

namespace megamoe::gemm {
namespace {

constexpr int kThreads = 128;  // one thread per fragment owner of a 64-row slab (gemm_weights.h)
// Staging row of the 64 x 128 bf16 tile: 256 bytes + 16, so a warp's 4-byte stores of 8 rows (same
// columns) fall on different bank quads.
constexpr int kStageRow = 272;
constexpr int kCtasPerSm = 8;  // ~4.5 KiB of loads in flight each

// One CTA per piece (expert e, K block kb, 64-row slab) at a time, grid-stride: each thread loads its
// two 16-byte code runs and its two rows' 8 scale bytes, expands its 8 words exactly as the GEMM's math
// warps do (fmt::fp4_word_to_bf16x2_pow120, one bf16 multiply by fmt::nvfp4_scale_bf16x2), stages the
// tile in shared memory and writes it out as whole 256-byte rows.
__global__ void __launch_bounds__(kThreads) expand_nvfp4_kernel(const uint8_t* __restrict__ image, int32_t num_experts,
                                                              int32_t n, int32_t k, int32_t first_expert, int32_t count,
                                                              const int32_t* __restrict__ expert_offsets,
                                                              uint8_t* __restrict__ out) {
  __shared__ __align__(16) uint8_t stage[64 * kStageRow];
  const int t = static_cast<int>(threadIdx.x);
  const uint8_t* pieces = image + nvfp4_pieces_offset(num_experts);
  const int64_t kbs = k / kNvfp4BlockK, slabs = n / 64, total = static_cast<int64_t>(count) * kbs * slabs;
  const int warp = t / 32, lane = t % 32, q = lane % 4, m0 = 16 * warp + lane / 4;
  for (int64_t p = blockIdx.x; p < total; p += gridDim.x) {  // CTA-uniform
    const int64_t i = p / (kbs * slabs), kb = (p / slabs) % kbs, slab = p % slabs;  // i: expert of `out`
    const int64_t e = first_expert + i;                                              // the image's
    if (expert_offsets != nullptr && expert_offsets[e + 1] <= expert_offsets[e]) continue;
    const uint8_t* piece = pieces + (first_expert * kbs * slabs + p) * kNvfp4SlabBytes;
    const uint4 f[2] = {*reinterpret_cast<const uint4*>(piece + 16 * t),
                        *reinterpret_cast<const uint4*>(piece + 2048 + 16 * t)};
    const uint2 sc[2] = {*reinterpret_cast<const uint2*>(piece + kNvfp4SlabCodeBytes + 8 * m0),
                         *reinterpret_cast<const uint2*>(piece + kNvfp4SlabCodeBytes + 8 * (m0 + 8))};
    for (int half = 0; half < 2; ++half) {
      const uint32_t w4[4] = {f[half].x, f[half].y, f[half].z, f[half].w};  // steps 4h + {0,1} rows m0, m0+8; + {2,3}
      for (int w = 0; w < 4; ++w) {
        const int which = w % 2, row = m0 + 8 * which, s0 = 4 * half + 2 * (w / 2);
        const uint32_t sw = half == 0 ? sc[which].x : sc[which].y;
        uint32_t r[4];
        fmt::fp4_word_to_bf16x2_pow120(w4[w], r);
        for (int tt = 0; tt < 2; ++tt) {  // step s0 + tt: pairs 2tt (columns 2q, 2q+1) and 2tt + 1 (+ 8)
          const int step = s0 + tt;
          const uint32_t s2 = fmt::nvfp4_scale_bf16x2(sw, step % 4);
          uint8_t* dst = stage + row * kStageRow + 2 * (16 * step + 2 * q);
          *reinterpret_cast<uint32_t*>(dst) = ptx::mul_bf16x2(r[2 * tt], s2);
          *reinterpret_cast<uint32_t*>(dst + 16) = ptx::mul_bf16x2(r[2 * tt + 1], s2);
        }
      }
    }
    __syncthreads();
    uint8_t* tile = out + ((i * n + slab * 64) * static_cast<int64_t>(k) + kb * kNvfp4BlockK) * 2;
    for (int c = t; c < 64 * 16; c += kThreads) {
      const int row = c / 16, col = 16 * (c % 16);
      *reinterpret_cast<uint4*>(tile + row * static_cast<int64_t>(k) * 2 + col) =
          *reinterpret_cast<const uint4*>(stage + row * kStageRow + col);
    }
    __syncthreads();  // the stage is rewritten by the next piece
  }
}

}  // namespace

cudaError_t launch_expand_nvfp4(const void* image, int32_t num_experts, int32_t n, int32_t k, int32_t first_expert,
                                int32_t count, const int32_t* expert_offsets, void* out, int max_ctas,
                                cudaStream_t stream) {
  if (n <= 0 || k <= 0 || n % 64 != 0 || k % kNvfp4BlockK != 0 || first_expert < 0 || count < 0 ||
      static_cast<int64_t>(first_expert) + count > num_experts)
    return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); err != cudaSuccess)
    return err;
  const int64_t pieces = static_cast<int64_t>(count) * (k / kNvfp4BlockK) * (n / 64);
  int64_t grid = std::min<int64_t>(pieces, static_cast<int64_t>(sms) * kCtasPerSm);
  if (max_ctas > 0) grid = std::min<int64_t>(grid, max_ctas);
  expand_nvfp4_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(image), num_experts, n, k, first_expert, count, expert_offsets,
      static_cast<uint8_t*>(out));
  return cudaGetLastError();
}

}  // namespace megamoe::gemm
