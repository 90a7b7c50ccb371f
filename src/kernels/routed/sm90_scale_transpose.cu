#include "kernels/routed/sm90_scale_transpose.h"

#include <algorithm>

namespace megamoe::kernels {
namespace {

constexpr int kTile = 32;
constexpr int kMaxRowTiles = 256;  // CTAs along the rows; each strides over the used row tiles

// 32x32 tiles through shared memory: coalesced reads of src rows, coalesced writes of dst rows.
// Small (the scales are 1/128 of the activations), but keeps both sides coalesced. The grid is
// sized by the capacity (capped); the rows used are read here, written by the pool build.
__global__ void scale_transpose_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows_used,
                                       int64_t rows, int64_t kb, float* __restrict__ dst, int64_t ld) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t used = min(rows, static_cast<int64_t>(max(*rows_used, 0)));
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile; row0 < used;
       row0 += static_cast<int64_t>(gridDim.x) * kTile) {  // CTA-uniform
    for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
      const int64_t r = row0 + i, c = col0 + threadIdx.x;
      if (r < used && c < kb) tile[i][threadIdx.x] = src[r * kb + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
      const int64_t c = col0 + i, r = row0 + threadIdx.x;
      if (r < used && c < kb) dst[c * ld + r] = tile[threadIdx.x][i];
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t launch_scale_transpose(const float* src, const int32_t* rows_used, int64_t rows, int64_t kb, float* dst,
                                   int64_t ld, cudaStream_t stream) {
  if (rows <= 0 || kb <= 0) return cudaSuccess;
  const int64_t row_tiles = std::min<int64_t>((rows + kTile - 1) / kTile, kMaxRowTiles);
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>((kb + kTile - 1) / kTile));
  scale_transpose_kernel<<<grid, dim3(kTile, 8), 0, stream>>>(src, rows_used, rows, kb, dst, ld);
  return cudaGetLastError();
}

}  // namespace megamoe::kernels
