// The GPU test binary loads its kernels eagerly and asks CUDA for its most hardware work queues: its
// shared-GPU groups need both (create_shared_gpu_group refuses lazy loading, under which a rank's
// first launch of a kernel can wait for a peer's running kernel, and fewer queues than ranks, under
// which a rank's kernel can queue behind its peer's waiting one; more queues make that rarer). Set
// before main(), so before the process's first CUDA call; an explicit setting wins.
#include <cstdlib>

namespace {
const bool kEagerLoading = [] { return setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0) == 0; }();
const bool kQueues = [] { return setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0) == 0; }();
}  // namespace
