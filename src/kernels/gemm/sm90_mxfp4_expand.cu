// sm90_mxfp4_expand.cu — see mxfp4_expand.h.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/mxfp4_expand.h"
#include "megamoe/formats.h"

namespace megamoe::gemm {
namespace {

constexpr int kThreads = 128;  // one thread per fragment owner of a 64-row slab (gemm_weights.h)
constexpr int kTableRows = 6 - fmt::kMxfp4MinShift + 1;
// Staging row of the 64 x 128 e4m3 tile: 128 bytes + 16, so the 4-byte stores of a warp's 8 rows
// (same columns) fall on 8 different bank quads.
constexpr int kStageRow = 144;
constexpr int kCtasPerSm = 12;  // ~4.3 KiB of loads in flight each: enough to keep HBM busy

// One CTA per piece (expert e, K block kb, 64-row slab) at a time, grid-stride: each thread loads its
// two 16-byte fragment runs and its two rows' shift bytes (the warp's loads are 512 contiguous bytes),
// expands its 8 words exactly as the GEMM's math warps do (fmt::fp4_word_to_e4m3 with the shift's
// table row), stages the tile in shared memory and writes it out as whole 128-byte rows.
__global__ void __launch_bounds__(kThreads) expand_mxfp4_kernel(const uint8_t* __restrict__ image, int32_t num_experts,
                                                              int32_t n, int32_t k, int32_t first_expert, int32_t count,
                                                              const int32_t* __restrict__ expert_offsets,
                                                              uint8_t* __restrict__ out) {
  __shared__ uint2 table[kTableRows];
  __shared__ __align__(16) uint8_t stage[kFp4SlabRows * kStageRow];
  const int t = static_cast<int>(threadIdx.x);
  if (t < kTableRows) {
    uint32_t lo, hi;
    fmt::mxfp4_shift_table_row(t + fmt::kMxfp4MinShift, &lo, &hi);
    table[t] = make_uint2(lo, hi);
  }
  __syncthreads();
  const uint8_t* pieces = image + mxfp4_pieces_offset(num_experts, n, k);
  const int64_t kbs = k / 128, slabs = n / kFp4SlabRows, total = static_cast<int64_t>(count) * kbs * slabs;
  const int warp = t / 32, lane = t % 32, q = lane % 4, m0 = 16 * warp + lane / 4;
  for (int64_t p = blockIdx.x; p < total; p += gridDim.x) {  // CTA-uniform
    const int64_t i = p / (kbs * slabs), kb = (p / slabs) % kbs, slab = p % slabs;  // i: expert of `out`
    const int64_t e = first_expert + i;                                              // the image's
    if (expert_offsets != nullptr && expert_offsets[e + 1] <= expert_offsets[e]) continue;
    const uint8_t* piece = pieces + (first_expert * kbs * slabs + p) * kFp4SlabBytes;
    uint4 words[2];
    for (int j = 0; j < 2; ++j) words[j] = *reinterpret_cast<const uint4*>(piece + j * 2048 + 16 * t);
    // shift bytes [row][4 steps]: one word per row
    const uint32_t sh[2] = {*reinterpret_cast<const uint32_t*>(piece + kFp4SlabCodeBytes + 4 * m0),
                            *reinterpret_cast<const uint32_t*>(piece + kFp4SlabCodeBytes + 4 * (m0 + 8))};
    for (int j = 0; j < 2; ++j) {
      // words[j] = {step 2j row m0, step 2j row m0 + 8, step 2j+1 row m0, step 2j+1 row m0 + 8}
      const uint32_t w4[4] = {words[j].x, words[j].y, words[j].z, words[j].w};
      for (int i = 0; i < 4; ++i) {
        const int step = 2 * j + i / 2, which = i % 2, row = m0 + 8 * which;
        const uint2 tr = table[((sh[which] >> (8 * step)) & 0xFFu) / 8];
        uint32_t lo, hi;
        fmt::fp4_word_to_e4m3(w4[i], tr.x, tr.y, &lo, &hi);
        uint8_t* dst = stage + row * kStageRow + 32 * step + 4 * q;
        *reinterpret_cast<uint32_t*>(dst) = lo;       // columns 32 step + 4q .. + 3
        *reinterpret_cast<uint32_t*>(dst + 16) = hi;  // columns 32 step + 16 + 4q .. + 3
      }
    }
    __syncthreads();
    uint8_t* tile = out + (i * n + slab * kFp4SlabRows) * static_cast<int64_t>(k) + kb * 128;
    for (int c = t; c < kFp4SlabRows * 8; c += kThreads) {
      const int row = c / 8, col = 16 * (c % 8);
      *reinterpret_cast<uint4*>(tile + row * static_cast<int64_t>(k) + col) =
          *reinterpret_cast<const uint4*>(stage + row * kStageRow + col);
    }
    __syncthreads();  // the stage is rewritten by the next piece
  }
}

}  // namespace

cudaError_t launch_expand_mxfp4(const void* image, int32_t num_experts, int32_t n, int32_t k, int32_t first_expert,
                                int32_t count, const int32_t* expert_offsets, void* out, int max_ctas,
                                cudaStream_t stream) {
  if (n <= 0 || k <= 0 || n % kFp4SlabRows != 0 || k % 128 != 0 || first_expert < 0 || count < 0 ||
      static_cast<int64_t>(first_expert) + count > num_experts)
    return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); err != cudaSuccess)
    return err;
  const int64_t pieces = static_cast<int64_t>(count) * (k / 128) * (n / kFp4SlabRows);
  int64_t grid = std::min<int64_t>(pieces, static_cast<int64_t>(sms) * kCtasPerSm);
  if (max_ctas > 0) grid = std::min<int64_t>(grid, max_ctas);
  expand_mxfp4_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(image), num_experts, n, k, first_expert, count, expert_offsets,
      static_cast<uint8_t*>(out));
  return cudaGetLastError();
}

}  // namespace megamoe::gemm
