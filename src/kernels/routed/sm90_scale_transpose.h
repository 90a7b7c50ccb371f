// Transposes the pool's fp32 1x128 activation scales from row-major [rows, kb] (as dispatch writes
// them) to the M-major [kb, ld] layout the grouped GEMM reads (a_scales[kb * ld + row]).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::kernels {

// Only the first min(rows, *rows_used) rows (rows_used: a device count, the pool's expert_offsets[E_l]),
// so a decode step in a layer sized for thousands of tokens does not transpose its whole capacity.
cudaError_t launch_scale_transpose(const float* src, const int32_t* rows_used, int64_t rows, int64_t kb, float* dst,
                                   int64_t ld, cudaStream_t stream);

}  // namespace megamoe::kernels
