// gemm_fill.cu — see gemm_fill.h.
#include "gemm_fill.h"

#include <cuda_runtime.h>

#include "kernels/gemm/gemm_weights.h"
#include "megamoe/formats.h"

namespace megamoe::gemm {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

__device__ __forceinline__ float unit(uint64_t h) { return float(h >> 40) * (1.f / 16777216.f); }  // [0, 1)

template <int kKind>  // 0 e4m3, 1 bf16
__global__ void fill_kernel(uint8_t* dst, int64_t count, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const float v = unit(mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i))) * 2.f - 1.f;
    if constexpr (kKind == 0) {
      dst[i] = fmt::float_to_e4m3(v * 2.f);
    } else {
      reinterpret_cast<uint16_t*>(dst)[i] = fmt::float_to_bf16(v);
    }
  }
}

__global__ void fill_f32_kernel(float* dst, int64_t count, float lo, float hi, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride)
    dst[i] = lo + (hi - lo) * unit(mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i)));
}

// The pieces of an mxfp4 image: random code bytes, shift bytes 8 * [0, 20].
__global__ void fill_mxfp4_pieces_kernel(uint8_t* pieces, int64_t count, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const bool shift = i % kFp4SlabBytes >= kFp4SlabCodeBytes;
    pieces[i] = shift ? uint8_t(8 * (h % 21)) : uint8_t(h);
  }
}

// The pieces of an nvfp4 image: random code bytes, block scale bytes e4m3 in [2^-2, 2^2) (0x28 .. 0x47).
__global__ void fill_nvfp4_pieces_kernel(uint8_t* pieces, int64_t count, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const bool scale = i % kNvfp4SlabBytes >= kNvfp4SlabCodeBytes;
    pieces[i] = scale ? uint8_t(0x28 + h % 32) : uint8_t(h);
  }
}

// Reads every 16-byte word of src; writes *sink only when the xor of all of them equals a value no
// buffer of the benchmark holds in practice (so the loads cannot be optimised away).
__global__ void read_kernel(const uint4* src, int64_t count, uint32_t* sink) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const uint4 v = src[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;
}

int blocks_for(int64_t count) {
  const int64_t b = (count + 255) / 256;
  return int(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

cudaError_t fill_random_e4m3(void* dst, int64_t count, uint64_t seed, cudaStream_t stream) {
  fill_kernel<0><<<blocks_for(count), 256, 0, stream>>>(static_cast<uint8_t*>(dst), count, seed);
  return cudaGetLastError();
}

cudaError_t fill_random_bf16(void* dst, int64_t count, uint64_t seed, cudaStream_t stream) {
  fill_kernel<1><<<blocks_for(count), 256, 0, stream>>>(static_cast<uint8_t*>(dst), count, seed);
  return cudaGetLastError();
}

cudaError_t fill_random_f32(float* dst, int64_t count, float lo, float hi, uint64_t seed, cudaStream_t stream) {
  fill_f32_kernel<<<blocks_for(count), 256, 0, stream>>>(dst, count, lo, hi, seed);
  return cudaGetLastError();
}

cudaError_t fill_random_mxfp4_image(void* image, int64_t num_experts, int64_t n, int64_t k, uint64_t seed,
                                    cudaStream_t stream) {
  const int64_t off = mxfp4_pieces_offset(num_experts, n, k);
  const int64_t scales = num_experts * (n / 128) * (k / 128);
  const int64_t pieces = num_experts * (k / 128) * (n / kFp4SlabRows) * kFp4SlabBytes;
  cudaError_t e = fill_random_f32(static_cast<float*>(image), scales, 0.5f, 2.f, seed, stream);
  if (e != cudaSuccess) return e;
  fill_mxfp4_pieces_kernel<<<blocks_for(pieces), 256, 0, stream>>>(static_cast<uint8_t*>(image) + off, pieces, seed + 1);
  return cudaGetLastError();
}

cudaError_t fill_random_nvfp4_image(void* image, int64_t num_experts, int64_t n, int64_t k, uint64_t seed,
                                    cudaStream_t stream) {
  const int64_t off = nvfp4_pieces_offset(num_experts);
  const int64_t pieces = num_experts * (k / kNvfp4BlockK) * (n / 64) * kNvfp4SlabBytes;
  cudaError_t e = fill_random_f32(static_cast<float*>(image), num_experts, 0.5f, 2.f, seed, stream);
  if (e != cudaSuccess) return e;
  fill_nvfp4_pieces_kernel<<<blocks_for(pieces), 256, 0, stream>>>(static_cast<uint8_t*>(image) + off, pieces, seed + 1);
  return cudaGetLastError();
}

cudaError_t read_through(const void* src, int64_t bytes, uint32_t* sink, cudaStream_t stream) {
  read_kernel<<<blocks_for(bytes / 16), 256, 0, stream>>>(static_cast<const uint4*>(src), bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace megamoe::gemm
