// sm90_weight_quant.h — device-resident weight preparation's one conversion: bf16 experts quantised
// into fp8-block (e4m3 + fp32 128x128 scales) on the device, with the bits of the host preparation
// (core/weights.cpp: bf16 -> fp32, then fmt::quantize_fp8_128x128 per 128x128 block), written in the
// grouped GEMM's row order (gemm_weights.h) when asked. Stream-ordered.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::kernels {

// src: bf16 [E, rows, cols] (contiguous, any alignment); rows and cols multiples of 128.
// dst: e4m3 [E, rows, cols], dst_scales: fp32 [E, rows/128, cols/128]. swiglu_intermediate = I > 0:
// src is a w13 (rows = 2I) and block row b of each expert lands where prepare_w13_for_swiglu puts it
// (gate block j -> 2j, up block I/128 + j -> 2j + 1), codes and scale alike; 0: rows kept in place.
// pow2: the scales are powers of two (fmt::fp8_block_scale).
cudaError_t launch_quantize_bf16_fp8_block(const uint16_t* src, int64_t num_experts, int64_t rows, int64_t cols,
                                           int64_t swiglu_intermediate, bool pow2, uint8_t* dst, float* dst_scales,
                                           cudaStream_t stream);

}  // namespace megamoe::kernels
