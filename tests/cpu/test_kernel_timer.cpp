// bench-gemm's kernel-time bookkeeping: device spans split into timed launches at each flush.
#include <gtest/gtest.h>

#include "../../tools/megamoe/kernel_timer.h"

namespace megamoe::tool {
namespace {

constexpr uint64_t kFlushBytes = 256u << 20;
DeviceSpan kernel(const char* name, uint64_t start, uint64_t end) { return DeviceSpan{false, name, start, end, 0}; }
DeviceSpan memset_span(uint64_t start, uint64_t end, uint64_t bytes = kFlushBytes) {
  return DeviceSpan{true, "", start, end, bytes};
}
bool is_flush(const DeviceSpan& s) { return s.memset ? s.bytes >= kFlushBytes : s.name == "read_kernel"; }

TEST(KernelTimer, EachLaunchSpansItsKernelsAfterItsFlush) {
  const std::vector<DeviceSpan> spans = {
      kernel("warm", 0, 900),                                  // before the first flush: not timed
      memset_span(1000, 2000), kernel("gemm", 3000, 13000),    // launch 1: 10 us
      memset_span(20000, 21000), kernel("a", 22000, 25000),    // launch 2: a kernel, a small memset
      memset_span(25500, 26000, 4096), kernel("b", 24000, 30000),  // of its own and a kernel, 22..30 us
      kernel("read_kernel", 40000, 41000), kernel("gemm", 41500, 42000),  // launch 3 after a read flush
  };
  const std::vector<double> us = launch_spans_us(spans, is_flush);
  ASSERT_EQ(us.size(), 3u);
  EXPECT_DOUBLE_EQ(us[0], 10.0);
  EXPECT_DOUBLE_EQ(us[1], 8.0);
  EXPECT_DOUBLE_EQ(us[2], 0.5);
}

TEST(KernelTimer, ALaunchWithoutKernelsGivesNoTimes) {
  const std::vector<DeviceSpan> spans = {memset_span(0, 10), memset_span(20, 30), kernel("gemm", 40, 50)};
  EXPECT_TRUE(launch_spans_us(spans, is_flush).empty());
  EXPECT_TRUE(launch_spans_us({memset_span(0, 10)}, is_flush).empty());
  EXPECT_TRUE(launch_spans_us({}, is_flush).empty());
}

}  // namespace
}  // namespace megamoe::tool
