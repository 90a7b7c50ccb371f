// Device launchers of the megamoe/formats.h codecs: the same header functions, run by CUDA kernels.
//
// Contract:
// - Every result is bit for bit what the host codec of megamoe/formats.h returns for the same input
//   (tests/gpu/test_formats_device.cpp checks it on every code and on random data).
// - Pointers are device pointers; n counts elements and must be a multiple of the format's block
//   (128, 32, 16); n == 0 launches nothing. Bad arguments return cudaErrorInvalidValue without
//   launching; otherwise the launch's cudaGetLastError(). Work is stream-ordered; nothing syncs.
// - The encode_*_cvt launchers use the hardware conversions (cvt.rn.satfinite.e4m3x2.f32,
//   cvt.rn.bf16.f32) instead of the header codecs, so kernels and tests can check that the
//   instructions agree with the codecs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe {
namespace fmt {
namespace device {

// e4m3_values[256], e2m1_values[16], e8m0_values[256]: the decoded value of every code.
cudaError_t decode_all_codes(float* e4m3_values, float* e2m1_values, float* e8m0_values, cudaStream_t stream);

// values[512]: the hardware decode of e4m3 code pairs (c, 255 - c): values[c] from the low byte c,
// values[256 + c] from the high byte 255 - c.
cudaError_t decode_e4m3_cvt(float* values, cudaStream_t stream);

// Element-wise encoders of x[n] with the header codecs; any output may be null (not written).
cudaError_t encode_elements(const float* x, int64_t n, uint8_t* e4m3, uint8_t* e2m1, uint16_t* bf16,
                            cudaStream_t stream);
// The same with the hardware conversion instructions (e4m3 satfinite, bf16 round-to-nearest).
cudaError_t encode_elements_cvt(const float* x, int64_t n, uint8_t* e4m3, uint16_t* bf16, cudaStream_t stream);

// out[2 * pairs]: the kernels' e4m3 pair quantisers of (x[2i], x[2i + 1]) / s[i], each a uint16 of
// two codes (x[2i]'s in the low byte): [2i] quantize_e4m3_pair (the GEMM's SwiGLU epilogue: a
// multiply by RN(1 / s) bracketed by the codes 8 ulp either side, else a division), [2i + 1]
// quantize_e4m3_pair_div (the dispatch). Both must equal fmt::float_to_e4m3(fmt::div_rn(x, s)).
cudaError_t quantize_e4m3_pairs(const float* x, const float* s, int64_t pairs, uint16_t* out, cudaStream_t stream);

// out[2n]: __fmul_rn(a[i], b[i]) and __fadd_rn(a[i], b[i]) as the hardware gives them (no
// canonicalize_nan): kernels that skip mul_rn's canonicalisation rely on their NaN being 0x7FFFFFFF.
cudaError_t raw_mul_add(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream);

// fp8 1x128: q[n], scales[n / 128] fp32. One warp per block.
cudaError_t quantize_fp8_1x128(const float* x, int64_t n, uint8_t* q, float* scales, bool pow2, cudaStream_t stream);
cudaError_t dequantize_fp8_1x128(const uint8_t* q, const float* scales, int64_t n, float* out, cudaStream_t stream);

// mxfp8: q[n], scales[n / 32] e8m0. One warp per block.
cudaError_t quantize_mxfp8(const float* x, int64_t n, uint8_t* q, uint8_t* scales, cudaStream_t stream);
cudaError_t dequantize_mxfp8(const uint8_t* q, const uint8_t* scales, int64_t n, float* out, cudaStream_t stream);

// nvfp4: packed[n / 2] (element 2i in the low nibble), scales[n / 16] e4m3. One half-warp per block.
cudaError_t quantize_nvfp4(const float* x, int64_t n, float global_scale, uint8_t* packed, uint8_t* scales,
                           cudaStream_t stream);
cudaError_t dequantize_nvfp4(const uint8_t* packed, const uint8_t* scales, float global_scale, int64_t n, float* out,
                             cudaStream_t stream);

// mxfp4: packed[n / 2] (element 2i in the low nibble), scales[n / 32] e8m0. One warp per block.
cudaError_t quantize_mxfp4(const float* x, int64_t n, uint8_t* packed, uint8_t* scales, cudaStream_t stream);
cudaError_t dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out, cudaStream_t stream);

// The GEMM's mxfp4 expansion (fmt::fp4_word_to_e4m3) of words[n] (eight e2m1 codes each), word i
// under shifts[i] (clamped to [kMxfp4MinShift, 6] as the weight preparation stores them): out[2i],
// out[2i + 1] its elements 0..3 and 4..7 as e4m3. The table rows are built on the device.
cudaError_t expand_fp4_words(const uint32_t* words, const int32_t* shifts, int64_t n, uint32_t* out,
                             cudaStream_t stream);

}  // namespace device
}  // namespace fmt
}  // namespace megamoe
