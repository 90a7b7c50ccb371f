// rank_stream.h — the stream a GPU test drives one EP rank on: a shared-GPU rank's group stream (each
// logical rank on its own hardware work queue, create_shared_gpu_group), else a new non-blocking one.
#pragma once

#include <cuda_runtime.h>

#include "megamoe/comm.h"

namespace megamoe::gpu_test {

// The rank's stream on the current device; give it back with drop_rank_stream(comm, s).
inline cudaStream_t make_rank_stream(const Communicator* comm) {
  void* shared = nullptr;
  if (comm != nullptr && comm->kind() == CommKind::kSharedGpu && shared_gpu_stream(*comm, &shared).is_ok())
    return static_cast<cudaStream_t>(shared);
  cudaStream_t s = nullptr;
  return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess ? s : nullptr;
}

// Destroys a stream make_rank_stream created (a group's stream stays with its group).
inline void drop_rank_stream(const Communicator* comm, cudaStream_t s) {
  void* shared = nullptr;
  if (comm != nullptr && comm->kind() == CommKind::kSharedGpu && shared_gpu_stream(*comm, &shared).is_ok() &&
      shared == s)
    return;
  if (s != nullptr) cudaStreamDestroy(s);
}

}  // namespace megamoe::gpu_test
