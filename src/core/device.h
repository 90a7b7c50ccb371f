// CUDA device queries used by capability gates and `megamoe info`. Never throws, never aborts:
// on a machine without a GPU (or driver) they report zero devices and the runtime's reason.
#pragma once

#include <string>
#include <vector>

namespace megamoe {

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;
  int major = 0, minor = 0;
  int num_sms = 0;
  long long total_memory = 0;
};

// Number of CUDA devices; 0 with `reason` set ("no CUDA device: <runtime message>") when none.
int cuda_device_count(std::string* reason = nullptr);
std::vector<CudaDeviceInfo> cuda_devices();
// Versions as "13.0"; empty when unavailable.
std::string cuda_runtime_version();
std::string cuda_driver_version();
// NCCL version of the loaded library ("2.28.9").
std::string nccl_version();
int nccl_version_code();

}  // namespace megamoe
