// One configuration of the MegaMoE kernel (nvfp4 weights as bf16, BLOCK_M 64), in a file of its own to compile in parallel.
#include "kernels/mega/sm90_mega_launch.cuh"

namespace megamoe::mega {
MEGAMOE_MEGA_INSTANTIATE_NVFP4(64)
}  // namespace megamoe::mega
