// The transport's multiply-shift division (src/kernels/common/exact_div.h) equals integer division
// over its whole domain of use: every n < 2^16 for each divisor up to 4096 (the layer's expert
// bound) and a spread of divisors up to 65535.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/common/exact_div.h"

namespace megamoe::kernels {
namespace {

void expect_exact(uint32_t d) {
  const ExactDiv16 x = ExactDiv16::make(d);
  for (uint32_t n = 0; n < (1u << 16); ++n)
    if (x.div(n) != n / d) {
      ADD_FAILURE() << "d=" << d << " n=" << n << ": " << x.div(n) << " != " << n / d;
      return;
    }
}

TEST(ExactDiv16, EqualsDivisionUpTo4096) {
  for (uint32_t d = 1; d <= 4096; ++d) expect_exact(d);
}

TEST(ExactDiv16, EqualsDivisionForLargeDivisors) {
  for (uint32_t d = 4097; d < (1u << 16); d += 997) expect_exact(d);
  expect_exact(65535);
  expect_exact(32768);
}

}  // namespace
}  // namespace megamoe::kernels
