// The nvfp4-weight configurations of the grouped GEMM (their own translation unit; the list lives in
// sm90_fp8_grouped_gemm.cuh).
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::gemm {
MEGAMOE_GROUPED_GEMM_CONFIGS_NVFP4(MEGAMOE_GROUPED_GEMM_INSTANTIATE_FP4)
}  // namespace megamoe::gemm
