// One configuration of the MegaMoE kernel (mxfp4 weights, BLOCK_M 16), in a file of its own to compile in parallel.
#include "kernels/mega/sm90_mega_launch.cuh"

namespace megamoe::mega {
MEGAMOE_MEGA_INSTANTIATE_MXFP4(16)
}  // namespace megamoe::mega
