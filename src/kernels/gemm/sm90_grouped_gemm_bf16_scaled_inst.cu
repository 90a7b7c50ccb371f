// The bf16 configurations with the per-expert scaled SwiGLU epilogue (nvfp4 weights expanded to
// bf16). The list lives in sm90_fp8_grouped_gemm.cuh.
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::gemm {
MEGAMOE_GROUPED_GEMM_CONFIGS_BF16_SCALED(MEGAMOE_GROUPED_GEMM_INSTANTIATE)
}  // namespace megamoe::gemm
