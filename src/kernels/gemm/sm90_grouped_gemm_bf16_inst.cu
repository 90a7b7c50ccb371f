// The bf16 configurations of the grouped GEMM. The list lives in sm90_fp8_grouped_gemm.cuh.
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::gemm {
MEGAMOE_GROUPED_GEMM_CONFIGS_BF16(MEGAMOE_GROUPED_GEMM_INSTANTIATE)
}  // namespace megamoe::gemm
