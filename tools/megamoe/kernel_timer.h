// Kernel durations from the GPU's own timestamps (CUPTI activity records: each kernel's and memset's
// start and end on the device), the measure PyTorch's profiler (kineto) reports and DeepGEMM's
// harness times with. CUDA events around a launch add the launch and its teardown (~3 us); a kernel
// record does not. libcupti is opened at run time (MEGAMOE_CUPTI_LIB, else libcupti.so.13 /
// libcupti.so on the library path), so the tool runs without it and says why the column is empty.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megamoe::tool {

struct DeviceSpan {
  bool memset = false;  // a memset, else a kernel
  std::string name;     // kernel name (mangled), empty for a memset
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t bytes = 0;   // a memset's size
};

class KernelTimer {
 public:
  // The process's timer, or null when CUPTI cannot be used (why_unavailable() says why).
  static KernelTimer* get();
  static const std::string& why_unavailable();

  // Records every kernel and memset from start() to stop() (the caller synchronises before stop()).
  bool start();
  // The records since start(), in start order; empty on failure.
  std::vector<DeviceSpan> stop();

 private:
  KernelTimer() = default;
};

// Splits spans into launches: each launch begins at a span `is_marker` accepts (the L2 flush before
// every timed launch) and holds the spans after it up to the next marker. Returns, per launch, the
// last end minus the first start of its non-marker spans in us; empty when a launch holds none.
template <class IsMarker>
std::vector<double> launch_spans_us(const std::vector<DeviceSpan>& spans, IsMarker&& is_marker) {
  std::vector<double> us;
  bool open = false, any = false;
  uint64_t first = 0, last = 0;
  auto close = [&]() -> bool {
    if (!open) return true;
    if (!any) return false;
    us.push_back(double(last - first) * 1e-3);
    return true;
  };
  for (const DeviceSpan& s : spans) {
    if (is_marker(s)) {
      if (!close()) return {};
      open = true;
      any = false;
      continue;
    }
    if (!open) continue;  // before the first marker: not a timed launch
    if (!any || s.start_ns < first) first = s.start_ns;
    if (!any || s.end_ns > last) last = s.end_ns;
    any = true;
  }
  if (!close()) return {};
  return us;
}

}  // namespace megamoe::tool
