// The fp8 configurations of the grouped GEMM (one translation unit, so CI compiles them in parallel
// with the bf16 ones). The list lives in sm90_fp8_grouped_gemm.cuh.
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::gemm {
MEGAMOE_GROUPED_GEMM_CONFIGS_FP8(MEGAMOE_GROUPED_GEMM_INSTANTIATE)
}  // namespace megamoe::gemm
