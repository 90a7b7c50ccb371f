// When a GPU test has to skip, and why: the kernels are built for sm_90a only, and the EP tests need
// several GPUs of one host.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

namespace megamoe::gpu_test {

// Number of CUDA devices (0 when there is no driver or device; clears the runtime's error).
inline int cuda_device_count_or_zero() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// "" when at least `n` devices are present and device 0 is sm_90; else the reason to skip.
inline std::string gpu_skip_reason(int n) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return std::string("no CUDA device (") + (err != cudaSuccess ? cudaGetErrorString(err) : "count 0") + ")";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read device 0's properties";
  if (prop.major != 9 || prop.minor != 0)
    return std::string("the kernels are built for sm_90a; device 0 is ") + prop.name + " (sm_" +
           std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  if (count < n) return "needs " + std::to_string(n) + " GPUs; this machine has " + std::to_string(count);
  return "";
}

}  // namespace megamoe::gpu_test

// Skips the calling test unless `n` sm_90 GPUs are present, saying why.
#define MEGAMOE_REQUIRE_SM90_GPUS(n)                                              \
  do {                                                                            \
    const std::string _megamoe_skip = ::megamoe::gpu_test::gpu_skip_reason(n);     \
    if (!_megamoe_skip.empty()) GTEST_SKIP() << _megamoe_skip;                    \
  } while (0)
