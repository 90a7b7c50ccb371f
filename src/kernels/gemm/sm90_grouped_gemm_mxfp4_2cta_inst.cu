// The mxfp4-weight configurations of the grouped GEMM at two CTAs per SM (16-row tiles, two math
// warpgroups; their own translation unit; the list lives in sm90_fp8_grouped_gemm.cuh).
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::gemm {
MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_2CTA(MEGAMOE_GROUPED_GEMM_INSTANTIATE_FP4)
}  // namespace megamoe::gemm
