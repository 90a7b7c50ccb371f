// One configuration of the MegaMoE kernel (fp8, BLOCK_M 128), in a file of its own to compile in parallel.
#include "kernels/mega/sm90_mega_launch.cuh"

namespace megamoe::mega {
MEGAMOE_MEGA_INSTANTIATE(128, true)
}  // namespace megamoe::mega
