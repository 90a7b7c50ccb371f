// Device launchers of the megamoe/formats.h codecs (see formats_device.h for the contract).
//
// The kernels call the header's scalar functions (amax over finite values, scale rules, element
// encoders, mul_rn / div_rn) exactly as the host loops do; only the amax reduction is spread over
// lanes, and max over non-NaN values is exact in any order, so results match the host bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "gpu/formats_device.h"
#include "kernels/common/sm90_quant.cuh"
#include "megamoe/formats.h"

namespace megamoe {
namespace fmt {
namespace device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerCta = kThreads / 32;
constexpr int64_t kMaxCtas = 4096;  // grid-stride loops beyond this
constexpr unsigned kFullMask = 0xFFFFFFFFu;

int64_t ctas_for(int64_t work_items, int64_t items_per_cta) {
  const int64_t ctas = (work_items + items_per_cta - 1) / items_per_cta;
  return ctas < kMaxCtas ? ctas : kMaxCtas;
}

// Max over the lanes of each group of `width` lanes (width a power of two <= 32).
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__global__ void decode_all_codes_kernel(float* e4m3_values, float* e2m1_values, float* e8m0_values) {
  const int code = threadIdx.x;  // 256 threads: one per code
  e4m3_values[code] = e4m3_to_float(static_cast<uint8_t>(code));
  e8m0_values[code] = e8m0_to_float(static_cast<uint8_t>(code));
  if (code < 16) e2m1_values[code] = e2m1_to_float(static_cast<uint8_t>(code));
}

// Code pairs (c, 255 - c) through the hardware conversion the kernels use (e4m3x2_to_float2).
__global__ void decode_e4m3_cvt_kernel(float* values) {
  const int c = threadIdx.x;  // 256 threads
  const float2 v = kernels::e4m3x2_to_float2(static_cast<uint16_t>(c | (255 - c) << 8));
  values[c] = v.x;
  values[256 + c] = v.y;
}

__global__ void encode_elements_kernel(const float* x, int64_t n, uint8_t* e4m3, uint8_t* e2m1, uint16_t* bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    if (e4m3) e4m3[i] = float_to_e4m3(v);
    if (e2m1) e2m1[i] = float_to_e2m1(v);
    if (bf16) bf16[i] = float_to_bf16(v);
  }
}

__global__ void encode_elements_cvt_kernel(const float* x, int64_t n, uint8_t* e4m3, uint16_t* bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    if (e4m3) e4m3[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    if (bf16) bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// The raw IEEE multiply and add (no canonicalize_nan): out[2i] = a[i] * b[i], out[2i + 1] = a[i] + b[i].
__global__ void raw_mul_add_kernel(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[2 * i] = __fmul_rn(a[i], b[i]);
    out[2 * i + 1] = __fadd_rn(a[i], b[i]);
  }
}

// The kernels' e4m3 pair quantisers (kernels/common/sm90_quant.cuh) on pairs (x[2i], x[2i + 1]) with
// scale s[i]: out[2i] the GEMM epilogue's (multiply, bracketing, division), out[2i + 1] the
// dispatch's (division).
__global__ void quantize_e4m3_pairs_kernel(const float* x, const float* s, int64_t pairs, uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
    const float v0 = x[2 * i], v1 = x[2 * i + 1], sc = s[i];
    out[2 * i] = static_cast<uint16_t>(kernels::quantize_e4m3_pair(v0, v1, sc, __frcp_rn(sc)));
    out[2 * i + 1] = static_cast<uint16_t>(kernels::quantize_e4m3_pair_div(v0, v1, sc));
  }
}

// fp8 1x128. Warp task = one block of 128; lane l holds elements l, l+32, l+64, l+96 (coalesced).
// The loop over tasks is warp-uniform, so every shuffle has all 32 lanes.
__global__ void quantize_fp8_1x128_kernel(const float* x, int64_t num_blocks, uint8_t* q, float* scales, bool pow2) {
  const int lane = threadIdx.x % 32;
  const int64_t first = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
  for (int64_t blk = first; blk < num_blocks; blk += int64_t(gridDim.x) * kWarpsPerCta) {
    const float* xb = x + blk * kFp8BlockSize;
    float v[4];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = xb[lane + 32 * j];
      amax = fmaxf(amax, finite_abs(v[j]));
    }
    amax = group_max<32>(amax);
    const float s = fp8_block_scale(amax, pow2);
    if (lane == 0) scales[blk] = s;
#pragma unroll
    for (int j = 0; j < 4; ++j) q[blk * kFp8BlockSize + lane + 32 * j] = float_to_e4m3(div_rn(v[j], s));
  }
}

// mxfp8. Warp task = one block of 32; lane l holds element l.
__global__ void quantize_mxfp8_kernel(const float* x, int64_t num_blocks, uint8_t* q, uint8_t* scales) {
  const int lane = threadIdx.x % 32;
  const int64_t first = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
  for (int64_t blk = first; blk < num_blocks; blk += int64_t(gridDim.x) * kWarpsPerCta) {
    const float v = x[blk * kMxfp8BlockSize + lane];
    const uint8_t code = mxfp8_scale_code(group_max<32>(finite_abs(v)));
    if (lane == 0) scales[blk] = code;
    q[blk * kMxfp8BlockSize + lane] = float_to_e4m3(div_rn(v, e8m0_to_float(code)));
  }
}

// nvfp4. Warp task = two blocks of 16 (one per half-warp); lane l holds element l % 16 of block
// 2 * task + l / 16. A missing second block (odd block count) reads nothing and writes nothing but
// still takes part in the shuffles.
__global__ void quantize_nvfp4_kernel(const float* x, int64_t num_blocks, float global_scale, uint8_t* packed,
                                      uint8_t* scales) {
  const int lane = threadIdx.x % 32;
  const int64_t num_tasks = (num_blocks + 1) / 2;
  const int64_t first = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
  for (int64_t task = first; task < num_tasks; task += int64_t(gridDim.x) * kWarpsPerCta) {
    const int64_t blk = 2 * task + lane / 16;
    const bool active = blk < num_blocks;
    const int64_t idx = blk * kNvfp4BlockSize + lane % 16;
    const float v = active ? x[idx] : 0.f;
    const float amax = group_max<16>(finite_abs(v));
    const uint8_t scale_code = nvfp4_block_scale_code(amax, global_scale);
    const uint8_t code = nvfp4_encode_element(v, nvfp4_block_divisor(scale_code, global_scale));
    const uint8_t next = static_cast<uint8_t>(__shfl_down_sync(kFullMask, static_cast<unsigned>(code), 1));
    if (active && lane % 16 == 0) scales[blk] = scale_code;
    if (active && lane % 2 == 0) packed[idx / 2] = static_cast<uint8_t>(code | (next << 4));
  }
}

// mxfp4. Warp task = one block of 32; lane l holds element l.
__global__ void quantize_mxfp4_kernel(const float* x, int64_t num_blocks, uint8_t* packed, uint8_t* scales) {
  const int lane = threadIdx.x % 32;
  const int64_t first = blockIdx.x * int64_t(kWarpsPerCta) + threadIdx.x / 32;
  for (int64_t blk = first; blk < num_blocks; blk += int64_t(gridDim.x) * kWarpsPerCta) {
    const int64_t idx = blk * kMxfp4BlockSize + lane;
    const float v = x[idx];
    const uint8_t scale_code = mxfp4_scale_code(group_max<32>(finite_abs(v)));
    const uint8_t code = float_to_e2m1(div_rn(v, e8m0_to_float(scale_code)));
    const uint8_t next = static_cast<uint8_t>(__shfl_down_sync(kFullMask, static_cast<unsigned>(code), 1));
    if (lane == 0) scales[blk] = scale_code;
    if (lane % 2 == 0) packed[idx / 2] = static_cast<uint8_t>(code | (next << 4));
  }
}

__global__ void dequantize_mxfp4_kernel(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
    out[i] = mul_rn(e2m1_to_float(code), e8m0_to_float(scales[i / kMxfp4BlockSize]));
  }
}

__global__ void expand_fp4_words_kernel(const uint32_t* words, const int32_t* shifts, int64_t n, uint32_t* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int32_t shift = shifts[i];
    shift = shift < kMxfp4MinShift ? kMxfp4MinShift : (shift > 6 ? 6 : shift);
    uint32_t row_lo, row_hi, lo, hi;
    mxfp4_shift_table_row(shift, &row_lo, &row_hi);
    fp4_word_to_e4m3(words[i], row_lo, row_hi, &lo, &hi);
    out[2 * i] = lo;
    out[2 * i + 1] = hi;
  }
}

__global__ void dequantize_fp8_1x128_kernel(const uint8_t* q, const float* scales, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = mul_rn(e4m3_to_float(q[i]), scales[i / kFp8BlockSize]);
}

__global__ void dequantize_mxfp8_kernel(const uint8_t* q, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = mul_rn(e4m3_to_float(q[i]), e8m0_to_float(scales[i / kMxfp8BlockSize]));
}

__global__ void dequantize_nvfp4_kernel(const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n,
                                        float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t code = static_cast<uint8_t>((packed[i / 2] >> ((i & 1) * 4)) & 0xFu);
    out[i] = mul_rn(e2m1_to_float(code), nvfp4_block_divisor(scales[i / kNvfp4BlockSize], global_scale));
  }
}

bool bad_size(int64_t n, int64_t block) { return n < 0 || n % block != 0; }

}  // namespace

cudaError_t decode_all_codes(float* e4m3_values, float* e2m1_values, float* e8m0_values, cudaStream_t stream) {
  if (!e4m3_values || !e2m1_values || !e8m0_values) return cudaErrorInvalidValue;
  decode_all_codes_kernel<<<1, 256, 0, stream>>>(e4m3_values, e2m1_values, e8m0_values);
  return cudaGetLastError();
}

cudaError_t decode_e4m3_cvt(float* values, cudaStream_t stream) {
  if (!values) return cudaErrorInvalidValue;
  decode_e4m3_cvt_kernel<<<1, 256, 0, stream>>>(values);
  return cudaGetLastError();
}

cudaError_t encode_elements(const float* x, int64_t n, uint8_t* e4m3, uint8_t* e2m1, uint16_t* bf16,
                            cudaStream_t stream) {
  if (n < 0 || (n > 0 && !x)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  encode_elements_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(x, n, e4m3, e2m1, bf16);
  return cudaGetLastError();
}

cudaError_t encode_elements_cvt(const float* x, int64_t n, uint8_t* e4m3, uint16_t* bf16, cudaStream_t stream) {
  if (n < 0 || (n > 0 && !x)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  encode_elements_cvt_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(x, n, e4m3, bf16);
  return cudaGetLastError();
}

cudaError_t quantize_e4m3_pairs(const float* x, const float* s, int64_t pairs, uint16_t* out, cudaStream_t stream) {
  if (pairs < 0 || (pairs > 0 && (!x || !s || !out))) return cudaErrorInvalidValue;
  if (pairs == 0) return cudaSuccess;
  quantize_e4m3_pairs_kernel<<<ctas_for(pairs, kThreads), kThreads, 0, stream>>>(x, s, pairs, out);
  return cudaGetLastError();
}

cudaError_t raw_mul_add(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (!a || !b || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  raw_mul_add_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(a, b, n, out);
  return cudaGetLastError();
}

cudaError_t quantize_fp8_1x128(const float* x, int64_t n, uint8_t* q, float* scales, bool pow2, cudaStream_t stream) {
  if (bad_size(n, kFp8BlockSize) || (n > 0 && (!x || !q || !scales))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t num_blocks = n / kFp8BlockSize;
  quantize_fp8_1x128_kernel<<<ctas_for(num_blocks, kWarpsPerCta), kThreads, 0, stream>>>(x, num_blocks, q, scales,
                                                                                         pow2);
  return cudaGetLastError();
}

cudaError_t dequantize_fp8_1x128(const uint8_t* q, const float* scales, int64_t n, float* out, cudaStream_t stream) {
  if (bad_size(n, kFp8BlockSize) || (n > 0 && (!q || !scales || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  dequantize_fp8_1x128_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(q, scales, n, out);
  return cudaGetLastError();
}

cudaError_t quantize_mxfp8(const float* x, int64_t n, uint8_t* q, uint8_t* scales, cudaStream_t stream) {
  if (bad_size(n, kMxfp8BlockSize) || (n > 0 && (!x || !q || !scales))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t num_blocks = n / kMxfp8BlockSize;
  quantize_mxfp8_kernel<<<ctas_for(num_blocks, kWarpsPerCta), kThreads, 0, stream>>>(x, num_blocks, q, scales);
  return cudaGetLastError();
}

cudaError_t dequantize_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t n, float* out, cudaStream_t stream) {
  if (bad_size(n, kMxfp8BlockSize) || (n > 0 && (!q || !scales || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  dequantize_mxfp8_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(q, scales, n, out);
  return cudaGetLastError();
}

cudaError_t quantize_nvfp4(const float* x, int64_t n, float global_scale, uint8_t* packed, uint8_t* scales,
                           cudaStream_t stream) {
  if (bad_size(n, kNvfp4BlockSize) || (n > 0 && (!x || !packed || !scales))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t num_blocks = n / kNvfp4BlockSize;
  const int64_t num_tasks = (num_blocks + 1) / 2;
  quantize_nvfp4_kernel<<<ctas_for(num_tasks, kWarpsPerCta), kThreads, 0, stream>>>(x, num_blocks, global_scale, packed,
                                                                                    scales);
  return cudaGetLastError();
}

cudaError_t dequantize_nvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n, float* out,
                             cudaStream_t stream) {
  if (bad_size(n, kNvfp4BlockSize) || (n > 0 && (!packed || !scales || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  dequantize_nvfp4_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(packed, scales, global_scale, n, out);
  return cudaGetLastError();
}

cudaError_t quantize_mxfp4(const float* x, int64_t n, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  if (bad_size(n, kMxfp4BlockSize) || (n > 0 && (!x || !packed || !scales))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t num_blocks = n / kMxfp4BlockSize;
  quantize_mxfp4_kernel<<<ctas_for(num_blocks, kWarpsPerCta), kThreads, 0, stream>>>(x, num_blocks, packed, scales);
  return cudaGetLastError();
}

cudaError_t dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out, cudaStream_t stream) {
  if (bad_size(n, kMxfp4BlockSize) || (n > 0 && (!packed || !scales || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  dequantize_mxfp4_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(packed, scales, n, out);
  return cudaGetLastError();
}

cudaError_t expand_fp4_words(const uint32_t* words, const int32_t* shifts, int64_t n, uint32_t* out,
                             cudaStream_t stream) {
  if (n < 0 || (n > 0 && (!words || !shifts || !out))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  expand_fp4_words_kernel<<<ctas_for(n, kThreads), kThreads, 0, stream>>>(words, shifts, n, out);
  return cudaGetLastError();
}

}  // namespace device
}  // namespace fmt
}  // namespace megamoe
