// GPU tests of src/formats/formats_device: the device codecs equal the host codecs of
// megamoe/formats.h bit for bit, on every code and on random data (normal across binades,
// heavy-tailed, with zero blocks, inf and NaN); and the hardware conversions (cvt e4m3 satfinite,
// cvt bf16) agree with the codecs on every non-NaN input. Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu/formats_device.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t _err = (expr);                                           \
    ASSERT_EQ(_err, cudaSuccess) << #expr << ": " << cudaGetErrorString(_err); \
  } while (0)

#define REQUIRE_SM90() MEGAMOE_REQUIRE_SM90_GPUS(1)

// A device copy of a host vector (or an uninitialised one of n elements), freed on scope exit.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(&ptr, sizeof(T) * (n ? n : 1)) != cudaSuccess) ptr = nullptr;
    if (ptr) cudaMemset(ptr, 0xA5, sizeof(T) * (n ? n : 1));  // poison
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (ptr) cudaMemcpy(ptr, host.data(), sizeof(T) * n, cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    if (ptr) cudaMemcpy(h.data(), ptr, sizeof(T) * n, cudaMemcpyDeviceToHost);
    return h;
  }
};

uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
float float_of(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

template <typename T>
int64_t count_bit_differences(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -1;
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return d;
}

// Every decoded code of every format, every bf16 value, the format edges, and random bits.
std::vector<float> encoder_inputs() {
  std::vector<float> x;
  for (int c = 0; c < 256; ++c) x.push_back(fmt::e4m3_to_float(static_cast<uint8_t>(c)));
  for (int c = 0; c < 16; ++c) x.push_back(fmt::e2m1_to_float(static_cast<uint8_t>(c)));
  for (int c = 0; c < 65536; ++c) x.push_back(fmt::bf16_to_float(static_cast<uint16_t>(c)));
  // Midpoints between adjacent e4m3 / e2m1 values and their neighbours.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid =
        0.5f * (fmt::e4m3_to_float(static_cast<uint8_t>(c)) + fmt::e4m3_to_float(static_cast<uint8_t>(c + 1)));
    for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      x.push_back(v);
      x.push_back(-v);
    }
  }
  for (float v : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f, 449.f, 464.f, 465.f, 1e30f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {inf, -inf, float_of(0x7FC00000u), float_of(0xFFC00000u), float_of(0x7F800001u), float_of(1u),
                  float_of(0x807FFFFFu), -0.f, 0.f})
    x.push_back(v);
  std::mt19937 rng(31337u);
  for (int i = 0; i < 1 << 20; ++i) x.push_back(float_of(rng()));
  std::uniform_int_distribution<uint32_t> exp_dist(127 - 12, 127 + 10);
  for (int i = 0; i < 1 << 20; ++i) x.push_back(float_of((rng() & 0x807FFFFFu) | (exp_dist(rng) << 23)));
  while (x.size() % 128) x.push_back(0.f);
  return x;
}

// Random block data: N(0, 1) with a magnitude 2^U[-12, 12] per run of 128, every 7th block of 128
// heavy-tailed (Student-t 1.5), every 13th all zero, and a few inf / NaN.
std::vector<float> block_inputs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::student_t_distribution<float> heavy(1.5f);
  std::uniform_int_distribution<int> binade(-12, 12);
  std::vector<float> x(n);
  for (int64_t b = 0; b < n / 128; ++b) {
    const float magnitude = std::ldexp(1.f, binade(rng));
    for (int64_t i = b * 128; i < (b + 1) * 128; ++i) {
      if (b % 13 == 5)
        x[i] = 0.f;
      else if (b % 7 == 3)
        x[i] = heavy(rng);
      else
        x[i] = normal(rng) * magnitude;
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  x[n / 3] = inf;
  x[n / 3 + 40] = -inf;
  x[n / 2] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

TEST(FormatsDevice, DecodeAllCodesBitExact) {
  REQUIRE_SM90();
  DeviceBuffer<float> e4m3(256), e2m1(16), e8m0(256);
  CUDA_OK(fmt::device::decode_all_codes(e4m3.ptr, e2m1.ptr, e8m0.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> h4(256), h2(16), h8(256);
  for (int c = 0; c < 256; ++c) {
    h4[c] = fmt::e4m3_to_float(static_cast<uint8_t>(c));
    h8[c] = fmt::e8m0_to_float(static_cast<uint8_t>(c));
    if (c < 16) h2[c] = fmt::e2m1_to_float(static_cast<uint8_t>(c));
  }
  EXPECT_EQ(count_bit_differences(e4m3.to_host(), h4), 0);
  EXPECT_EQ(count_bit_differences(e2m1.to_host(), h2), 0);
  EXPECT_EQ(count_bit_differences(e8m0.to_host(), h8), 0);
}

// The hardware e4m3 -> fp32 decode the combine's mxfp8 reduce uses: the codec's value for every
// non-NaN code (and the byte order of a pair), a NaN for the two NaN codes.
TEST(FormatsDevice, HardwareE4m3DecodeAgreesWithCodec) {
  REQUIRE_SM90();
  DeviceBuffer<float> v(512);
  CUDA_OK(fmt::device::decode_e4m3_cvt(v.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> g = v.to_host();
  for (int c = 0; c < 256; ++c) {
    const uint8_t lo = static_cast<uint8_t>(c), hi = static_cast<uint8_t>(255 - c);
    for (const auto& [code, got] : {std::pair<uint8_t, float>{lo, g[c]}, std::pair<uint8_t, float>{hi, g[256 + c]}}) {
      const float want = fmt::e4m3_to_float(code);
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(got)) << "code " << int(code);
      else EXPECT_EQ(bits_of(got), bits_of(want)) << "code " << int(code);
    }
  }
}

// The hardware multiply and add return the canonical NaN 0x7FFFFFFF for every NaN result (NaN
// operands of either sign and any payload, inf * 0, inf - inf), as formats.h states: so a device
// mul_rn / add needs no canonicalize_nan (the combine's mxfp8 loops rely on it).
TEST(FormatsDevice, HardwareNaNResultsAreCanonical) {
  REQUIRE_SM90();
  const float inf = std::numeric_limits<float>::infinity();
  const float others[] = {0.f, -0.f, 1.f, -3.5f, 1e-40f, 3e38f, inf, -inf};
  std::vector<float> a, b;
  std::mt19937 rng(7);
  for (int i = 0; i < 4096; ++i) {
    const uint32_t payload = 1u + (rng() & 0x3FFFFFu);  // non-zero: a NaN, quiet or signalling
    const float nan = float_of((rng() & 0x80000000u) | 0x7F800000u | payload);
    const float other = i % 3 == 0 ? float_of((rng() & 0x80000000u) | 0x7F800000u | (1u + (rng() & 0x3FFFFFu)))
                                   : others[i % 8];
    a.push_back(i % 2 ? nan : other);
    b.push_back(i % 2 ? other : nan);
  }
  a.push_back(inf), b.push_back(0.f);   // inf * 0
  a.push_back(inf), b.push_back(-inf);  // inf - inf (the add), inf * -inf = -inf (not NaN)
  const int64_t n = static_cast<int64_t>(a.size());
  DeviceBuffer<float> da(a), db(b), out(2 * n);
  CUDA_OK(fmt::device::raw_mul_add(da.ptr, db.ptr, n, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> g = out.to_host();
  int64_t nan_results = 0, bad = 0;
  for (int64_t i = 0; i < 2 * n; ++i) {
    if (!std::isnan(g[i])) continue;
    ++nan_results;
    if (bits_of(g[i]) != 0x7FFFFFFFu && ++bad <= 5)
      ADD_FAILURE() << (i % 2 ? "add" : "mul") << " of " << std::hex << bits_of(a[i / 2]) << ", " << bits_of(b[i / 2])
                    << " gave " << bits_of(g[i]);
  }
  EXPECT_GE(nan_results, 2 * 4096);
  EXPECT_EQ(bad, 0);
}

TEST(FormatsDevice, EncodersBitExact) {
  REQUIRE_SM90();
  const std::vector<float> x = encoder_inputs();
  const int64_t n = static_cast<int64_t>(x.size());
  DeviceBuffer<float> dx(x);
  DeviceBuffer<uint8_t> e4m3(n), e2m1(n);
  DeviceBuffer<uint16_t> bf16(n);
  CUDA_OK(fmt::device::encode_elements(dx.ptr, n, e4m3.ptr, e2m1.ptr, bf16.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> h4(n), h2(n);
  std::vector<uint16_t> hb(n);
  for (int64_t i = 0; i < n; ++i) {
    h4[i] = fmt::float_to_e4m3(x[i]);
    h2[i] = fmt::float_to_e2m1(x[i]);
    hb[i] = fmt::float_to_bf16(x[i]);
  }
  std::printf("encoders: %lld inputs\n", static_cast<long long>(n));
  EXPECT_EQ(count_bit_differences(e4m3.to_host(), h4), 0);
  EXPECT_EQ(count_bit_differences(e2m1.to_host(), h2), 0);
  EXPECT_EQ(count_bit_differences(bf16.to_host(), hb), 0);
}

// Kernels may use the conversion instructions directly: they must agree with the codecs. NaN is the
// one documented difference for bf16 (the instruction gives the canonical 0x7FFF; the codec keeps the
// sign and payload); for e4m3 both give a NaN code.
TEST(FormatsDevice, HardwareCvtAgreesWithCodecs) {
  REQUIRE_SM90();
  const std::vector<float> x = encoder_inputs();
  const int64_t n = static_cast<int64_t>(x.size());
  DeviceBuffer<float> dx(x);
  DeviceBuffer<uint8_t> e4m3(n);
  DeviceBuffer<uint16_t> bf16(n);
  CUDA_OK(fmt::device::encode_elements_cvt(dx.ptr, n, e4m3.ptr, bf16.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> g4 = e4m3.to_host();
  const std::vector<uint16_t> gb = bf16.to_host();
  int64_t e4m3_diff = 0, bf16_diff = 0, nan_inputs = 0, e4m3_nan_exact = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) {
      ++nan_inputs;
      EXPECT_EQ(g4[i] & 0x7F, 0x7F) << "cvt e4m3 of NaN " << std::hex << bits_of(x[i]);
      // A positive NaN (mul_rn's canonical 0x7FFFFFFF is one) gives the codec's 0x7F exactly: the
      // combine's mxfp8 encoder converts mul_rn products with the instruction and relies on it.
      if (!std::signbit(x[i])) {
        EXPECT_EQ(g4[i], 0x7F) << "cvt e4m3 of +NaN " << std::hex << bits_of(x[i]);
      }
      e4m3_nan_exact += g4[i] == fmt::float_to_e4m3(x[i]);
      EXPECT_TRUE(std::isnan(fmt::bf16_to_float(gb[i])));
      continue;
    }
    e4m3_diff += g4[i] != fmt::float_to_e4m3(x[i]);
    bf16_diff += gb[i] != fmt::float_to_bf16(x[i]);
  }
  std::printf(
      "cvt vs codec: %lld non-NaN inputs, e4m3 differ %lld, bf16 differ %lld; NaN inputs %lld, "
      "e4m3 NaN code equal to the codec's 0x7F for %lld\n",
      static_cast<long long>(n - nan_inputs), static_cast<long long>(e4m3_diff), static_cast<long long>(bf16_diff),
      static_cast<long long>(nan_inputs), static_cast<long long>(e4m3_nan_exact));
  EXPECT_EQ(e4m3_diff, 0);
  EXPECT_EQ(bf16_diff, 0);
}

// The kernels' e4m3 pair quantisers (a multiply by RN(1 / s) bracketed by the codes 8 ulp either
// side, else a division; the division alone) against the codec's e4m3(div_rn(x, s)): on quotients placed on
// and within 12 ulp of every tie between adjacent codes (where the multiply alone would round to the
// wrong side), on 1x128 blocks of random data with their own block scales, on every encoder input
// with assorted scales, and on zeros, subnormals, infinities and NaN.
TEST(FormatsDevice, PairQuantisersEqualDivision) {
  REQUIRE_SM90();
  std::vector<float> x, s;
  auto add_pair = [&](float a, float b, float sc) {
    x.push_back(a);
    x.push_back(b);
    s.push_back(sc);
  };
  std::mt19937 rng(4242u);
  const float scales[] = {1.f, 0.37f, 3.3e-3f, 0.03125f, 1.7e4f, 2.9e-29f, 7.1e30f, 448.f / 3.f, 1.f / 448.f, 5.9e-39f};
  for (int c = 0; c < 0x7E; ++c) {
    const float tie =
        0.5f * (fmt::e4m3_to_float(static_cast<uint8_t>(c)) + fmt::e4m3_to_float(static_cast<uint8_t>(c + 1)));
    for (float sc : scales) {
      const uint32_t center = bits_of(tie * sc);
      for (int d = -12; d <= 12; ++d) {
        const float v = float_of(center + static_cast<uint32_t>(d));
        add_pair(v, -v, sc);
      }
    }
  }
  {
    const int64_t n = 128 * 8191;
    const std::vector<float> blocks = block_inputs(n, 77u);
    for (int64_t b = 0; b < n / 128; ++b) {
      float amax = 0.f;
      for (int64_t i = b * 128; i < (b + 1) * 128; ++i) amax = std::max(amax, fmt::finite_abs(blocks[i]));
      const float sc = fmt::fp8_block_scale(amax, b % 2 == 1);
      for (int64_t i = b * 128; i < (b + 1) * 128; i += 2) add_pair(blocks[i], blocks[i + 1], sc);
    }
  }
  {
    const std::vector<float> enc = encoder_inputs();
    std::uniform_real_distribution<float> log_scale(-30.f, 30.f);
    for (size_t i = 0; i + 1 < enc.size(); i += 2) {
      add_pair(enc[i], enc[i + 1], 1.f);
      add_pair(enc[i], enc[i + 1], std::exp2(log_scale(rng)));
    }
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (float sc : scales)
    for (float v : {0.f, -0.f, float_of(1u), float_of(0x807FFFFFu), inf, -inf, nan, 1e-40f, 2.f * sc, 500.f * sc})
      add_pair(v, -v, sc);
  const int64_t pairs = static_cast<int64_t>(s.size());
  DeviceBuffer<float> dx(x), ds(s);
  DeviceBuffer<uint16_t> out(2 * pairs);
  CUDA_OK(fmt::device::quantize_e4m3_pairs(dx.ptr, ds.ptr, pairs, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = out.to_host();
  const char* names[2] = {"quantize_e4m3_pair", "quantize_e4m3_pair_div"};
  int64_t bad[2] = {0, 0};
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t want = static_cast<uint16_t>(fmt::float_to_e4m3(fmt::div_rn(x[2 * i], s[i])) |
                                                (fmt::float_to_e4m3(fmt::div_rn(x[2 * i + 1], s[i])) << 8));
    for (int f = 0; f < 2; ++f) {
      if (got[2 * i + f] == want) continue;
      if (++bad[f] <= 5)
        ADD_FAILURE() << names[f] << " of (" << std::hex << bits_of(x[2 * i]) << ", " << bits_of(x[2 * i + 1])
                      << ") / " << bits_of(s[i]) << " gave " << got[2 * i + f] << ", the codec " << want;
    }
  }
  std::printf("pair quantisers: %lld pairs, differ %lld / %lld\n", static_cast<long long>(pairs),
              static_cast<long long>(bad[0]), static_cast<long long>(bad[1]));
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

TEST(FormatsDevice, Fp8_1x128_BitExact) {
  REQUIRE_SM90();
  const int64_t n = 128 * 4099;  // not a multiple of the CTA's 8 blocks
  const std::vector<float> x = block_inputs(n, 5u);
  DeviceBuffer<float> dx(x);
  for (bool pow2 : {false, true}) {
    DeviceBuffer<uint8_t> q(n);
    DeviceBuffer<float> scales(n / 128), out(n);
    CUDA_OK(fmt::device::quantize_fp8_1x128(dx.ptr, n, q.ptr, scales.ptr, pow2, nullptr));
    CUDA_OK(fmt::device::dequantize_fp8_1x128(q.ptr, scales.ptr, n, out.ptr, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> hq(n);
    std::vector<float> hs(n / 128), ho(n);
    fmt::quantize_fp8_1x128(x.data(), n, hq.data(), hs.data(), pow2);
    fmt::dequantize_fp8_1x128(hq.data(), hs.data(), n, ho.data());
    EXPECT_EQ(count_bit_differences(q.to_host(), hq), 0) << "pow2=" << pow2;
    EXPECT_EQ(count_bit_differences(scales.to_host(), hs), 0) << "pow2=" << pow2;
    EXPECT_EQ(count_bit_differences(out.to_host(), ho), 0) << "pow2=" << pow2;
  }
}

TEST(FormatsDevice, Mxfp8_BitExact) {
  REQUIRE_SM90();
  const int64_t n = 32 * 16387;
  const std::vector<float> x = block_inputs(n + 96, 6u);  // block_inputs works in runs of 128
  DeviceBuffer<float> dx(std::vector<float>(x.begin(), x.begin() + n));
  DeviceBuffer<uint8_t> q(n), scales(n / 32);
  DeviceBuffer<float> out(n);
  CUDA_OK(fmt::device::quantize_mxfp8(dx.ptr, n, q.ptr, scales.ptr, nullptr));
  CUDA_OK(fmt::device::dequantize_mxfp8(q.ptr, scales.ptr, n, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> hq(n), hs(n / 32);
  std::vector<float> ho(n);
  fmt::quantize_mxfp8(x.data(), n, hq.data(), hs.data());
  fmt::dequantize_mxfp8(hq.data(), hs.data(), n, ho.data());
  EXPECT_EQ(count_bit_differences(q.to_host(), hq), 0);
  EXPECT_EQ(count_bit_differences(scales.to_host(), hs), 0);
  EXPECT_EQ(count_bit_differences(out.to_host(), ho), 0);
}

TEST(FormatsDevice, Nvfp4_BitExact) {
  REQUIRE_SM90();
  const int64_t n = 16 * 32771;  // an odd number of blocks: the last warp has one
  const std::vector<float> x = block_inputs(n + 112, 7u);
  // Per-binade blocks put many block scales in e4m3's subnormal range (and some at 0): exercised too.
  const float global = fmt::nvfp4_global_scale(fmt::amax_finite(x.data(), n));
  DeviceBuffer<float> dx(std::vector<float>(x.begin(), x.begin() + n));
  DeviceBuffer<uint8_t> packed(n / 2), scales(n / 16);
  DeviceBuffer<float> out(n);
  CUDA_OK(fmt::device::quantize_nvfp4(dx.ptr, n, global, packed.ptr, scales.ptr, nullptr));
  CUDA_OK(fmt::device::dequantize_nvfp4(packed.ptr, scales.ptr, global, n, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> hp(n / 2), hs(n / 16);
  std::vector<float> ho(n);
  fmt::quantize_nvfp4(x.data(), n, global, hp.data(), hs.data());
  fmt::dequantize_nvfp4(hp.data(), hs.data(), global, n, ho.data());
  EXPECT_EQ(count_bit_differences(packed.to_host(), hp), 0);
  EXPECT_EQ(count_bit_differences(scales.to_host(), hs), 0);
  EXPECT_EQ(count_bit_differences(out.to_host(), ho), 0);
}

TEST(FormatsDevice, Mxfp4_BitExact) {
  REQUIRE_SM90();
  const int64_t n = 32 * 16387;
  const std::vector<float> x = block_inputs(n + 96, 8u);
  DeviceBuffer<float> dx(std::vector<float>(x.begin(), x.begin() + n));
  DeviceBuffer<uint8_t> packed(n / 2), scales(n / 32);
  DeviceBuffer<float> out(n);
  CUDA_OK(fmt::device::quantize_mxfp4(dx.ptr, n, packed.ptr, scales.ptr, nullptr));
  CUDA_OK(fmt::device::dequantize_mxfp4(packed.ptr, scales.ptr, n, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> hp(n / 2), hs(n / 32);
  std::vector<float> ho(n);
  fmt::quantize_mxfp4(x.data(), n, hp.data(), hs.data());
  fmt::dequantize_mxfp4(hp.data(), hs.data(), n, ho.data());
  EXPECT_EQ(count_bit_differences(packed.to_host(), hp), 0);
  EXPECT_EQ(count_bit_differences(scales.to_host(), hs), 0);
  EXPECT_EQ(count_bit_differences(out.to_host(), ho), 0);
}

TEST(FormatsDevice, Fp4WordExpansion_BitExact) {
  REQUIRE_SM90();
  const int64_t n = 1 << 18;
  std::mt19937 rng(9u);
  std::vector<uint32_t> words(n);
  std::vector<int32_t> shifts(n);
  for (int64_t i = 0; i < n; ++i) {
    words[i] = static_cast<uint32_t>(rng());
    shifts[i] = static_cast<int32_t>(rng() % 24) - 17;  // [-17, 6]: below kMxfp4MinShift clamps
  }
  DeviceBuffer<uint32_t> dw(words), out(2 * n);
  DeviceBuffer<int32_t> ds(shifts);
  CUDA_OK(fmt::device::expand_fp4_words(dw.ptr, ds.ptr, n, out.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint32_t> want(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = std::max(fmt::kMxfp4MinShift, std::min(6, shifts[i]));
    uint32_t lo, hi;
    fmt::mxfp4_shift_table_row(s, &lo, &hi);
    fmt::fp4_word_to_e4m3(words[i], lo, hi, &want[2 * i], &want[2 * i + 1]);
  }
  EXPECT_EQ(count_bit_differences(out.to_host(), want), 0);
}

TEST(FormatsDevice, LaunchersRejectBadSizes) {
  REQUIRE_SM90();
  DeviceBuffer<float> x(256), s(8);
  DeviceBuffer<uint8_t> q(256);
  EXPECT_EQ(fmt::device::quantize_fp8_1x128(x.ptr, 100, q.ptr, s.ptr, false, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(fmt::device::quantize_mxfp8(x.ptr, 48, q.ptr, q.ptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(fmt::device::quantize_nvfp4(x.ptr, 8, 1.f, q.ptr, q.ptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(fmt::device::quantize_nvfp4(nullptr, 16, 1.f, q.ptr, q.ptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(fmt::device::quantize_mxfp8(x.ptr, 0, nullptr, nullptr, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace megamoe
