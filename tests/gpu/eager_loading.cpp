// The GPU test binary loads its kernels eagerly: its shared-GPU groups need it (create_shared_gpu_group
// refuses lazy loading, under which a rank's first launch of a kernel can wait for a peer's running
// kernel). Set before main(), so before the process's first CUDA call; an explicit setting wins.
#include <cstdlib>

namespace {
const bool kEagerLoading = [] { return setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0) == 0; }();
}  // namespace
