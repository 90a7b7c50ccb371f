#include "core/device.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>

namespace megamoe {

int cuda_device_count(std::string* reason) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    if (reason) {
      *reason = std::string("no CUDA device (") +
                (err != cudaSuccess ? cudaGetErrorString(err) : "the runtime reports 0 devices") + ")";
    }
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> out;
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo d;
    d.ordinal = i;
    d.name = prop.name;
    d.major = prop.major;
    d.minor = prop.minor;
    d.num_sms = prop.multiProcessorCount;
    d.total_memory = static_cast<long long>(prop.totalGlobalMem);
    out.push_back(d);
  }
  return out;
}

static std::string version_string(int v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%d.%d", v / 1000, (v % 1000) / 10);
  return buf;
}

std::string cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return "";
  return version_string(v);
}

std::string cuda_driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) return "";
  return version_string(v);
}

int nccl_version_code() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return 0;
  return v;
}

std::string nccl_version() {
  int v = nccl_version_code();
  if (v == 0) return "";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%d.%d.%d", v / 10000, (v % 10000) / 100, v % 100);
  return buf;
}

}  // namespace megamoe
