#include "comm/gpu_comm.h"

namespace megamoe {

GpuRankComm* gpu_rank_of(const Communicator* comm) {
  if (!comm || (comm->kind() != CommKind::kNccl && comm->kind() != CommKind::kSharedGpu)) return nullptr;
  return const_cast<GpuRankComm*>(dynamic_cast<const GpuRankComm*>(comm));
}

}  // namespace megamoe
