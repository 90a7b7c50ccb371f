// exact_div.h — floor(n / d) for a divisor fixed for a whole launch, as one 64-bit multiply and a
// shift instead of an integer division (~20 dependent instructions, expanded at every use): the
// transport's expert -> owner rank mapping, id / experts_per_rank.
//
// m = floor((2^32 - 1) / d) + 1 = ceil(2^32 / d) (d not a power of two; 2^32 / d otherwise), and
// floor(n / d) = (n * m) >> 32 for n, d < 2^16: n * m / 2^32 = n / d + n * (m - 2^32 / d) / 2^32,
// the error term is below n / 2^32 < 1 / d, and frac(n / d) <= 1 - 1 / d, so the floor is unchanged.
// (tests/cpu/test_exact_div.cpp checks every n < 2^16 for d up to 4096 and a spread of larger d.)
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_EXACT_DIV_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_EXACT_DIV_HD inline
#endif

namespace megamoe {
namespace kernels {

struct ExactDiv16 {
  uint64_t m = uint64_t(1) << 32;  // d = 1

  // invariant: 1 <= d < 2^16 (the transport checks experts_per_rank * ep_size <= 65535)
  static ExactDiv16 make(uint32_t d) {
    ExactDiv16 x;
    x.m = uint64_t(0xFFFFFFFFu / d) + 1;
    return x;
  }
  // invariant: n < 2^16
  MEGAMOE_EXACT_DIV_HD uint32_t div(uint32_t n) const { return static_cast<uint32_t>((uint64_t(n) * m) >> 32); }
};

}  // namespace kernels
}  // namespace megamoe
