// sm90_clock.cuh — the device's global nanosecond clock, for bounded waits (sm90_signals.cuh) and the
// grouped GEMM's bench timeline.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

// %globaltimer in ns: comparable across SMs of one GPU.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace megamoe::kernels
