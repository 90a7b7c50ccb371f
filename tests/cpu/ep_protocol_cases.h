// Shared by the CPU tests of the EP protocol (test_ep_protocol.cpp, test_ep_owner_reduce.cpp): the
// small geometry they simulate, the parameter struct of their cases and its test names, the token
// counts per rank, and a 256-byte aligned host buffer standing in for a rank's workspace.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "megamoe/workspace.h"
#include "reference/problem.h"

namespace megamoe {
namespace test {

constexpr int64_t kH = 256, kI = 128, kE = 16, kK = 4, kTMax = 24;

struct ProtocolCase {
  int ep_size;
  reference::Routing routing;
  int32_t dispatch_format;  // kWsBf16 | kWsFp8Block
  int32_t combine_format;   // kWsBf16 | kWsMxfp8 | kWsNvfp4
  int64_t block_m;
};

inline std::string case_name(const testing::TestParamInfo<ProtocolCase>& info) {
  using reference::Routing;
  const ProtocolCase& c = info.param;
  const char* wire = c.combine_format == kWsBf16 ? "Bf16Wire" : c.combine_format == kWsMxfp8 ? "Mxfp8Wire" : "Nvfp4Wire";
  std::string routing = c.routing == Routing::kUniform ? "Uniform" : c.routing == Routing::kSingleExpert ? "OneExpert" : "Dropped";
  return "EP" + std::to_string(c.ep_size) + "_" + routing + (c.dispatch_format == kWsBf16 ? "_Bf16Dispatch_" : "_Fp8Dispatch_") +
         wire + "_BM" + std::to_string(c.block_m);
}

// Token counts that cover T = T_max, T = 0 and small T.
inline std::vector<int64_t> token_pattern(int ep_size) {
  const int64_t pattern[4] = {kTMax, 0, 7, 1};
  std::vector<int64_t> t(ep_size);
  for (int r = 0; r < ep_size; ++r) t[r] = ep_size == 1 ? kTMax : pattern[r % 4];
  return t;
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(int64_t bytes) { p = std::aligned_alloc(256, (bytes + 255) / 256 * 256); }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace test
}  // namespace megamoe
