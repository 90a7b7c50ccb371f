// Tests of prepare_weights() and QuantizedTensor (megamoe/weights.h): every source dtype (fp32,
// bf16, DeepSeek-V3 e4m3 + 128x128 scales, nvfp4, mxfp4) into every weight format, checked three ways:
// - layout: data, scales and global scales equal, byte for byte, the formats.h codec applied to
//   each expert's source values (catches expert order, row/column and scale-index mistakes);
// - values: dequantize() is within the format's error bound of the source;
// - a source prepared in its own format (e4m3 as fp8-block, nvfp4, mxfp4) keeps its bytes and
//   scales bit for bit.
// Bad sources must fail with messages that name the field, its value and the rule. At the end: the
// rules for device-resident sources (check_device_weights, create()'s refusals) and the per-expert
// regions expert_weight_views() gives.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "kernels/common/layer_buffers.h"
#include "kernels/gemm/gemm_weights.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/weights.h"

namespace megamoe {
namespace {

// EXPECT that `text` contains `part`, printing the whole text when it does not.
#define EXPECT_CONTAINS(text, part)                                                                 \
  do {                                                                                              \
    const std::string _text = (text);                                                               \
    EXPECT_NE(_text.find(part), std::string::npos) << "missing \"" << (part) << "\" in: " << _text; \
  } while (0)

// E = 6 over R = 2: this rank (1) holds 3 experts. 2I = 768 and H = 256 differ so a transposed
// scale index shows; I = 384 gives an odd number (3) of 128-blocks.
MoeGeometry test_geometry() {
  MoeGeometry g;
  g.hidden = 256;
  g.intermediate = 384;
  g.num_experts = 6;
  g.top_k = 2;
  g.ep_size = 2;
  g.ep_rank = 1;
  g.max_tokens_per_rank = 16;
  return g;
}

enum class Source { kFp32, kBf16, kFp8, kNvfp4, kMxfp4 };
const char* source_name(Source s) {
  switch (s) {
    case Source::kFp32: return "Fp32";
    case Source::kBf16: return "Bf16";
    case Source::kFp8: return "Fp8";
    case Source::kNvfp4: return "Nvfp4";
    case Source::kMxfp4: return "Mxfp4";
  }
  return "?";
}

// The format a source is kept in bit for bit, if any.
bool kept_as_is(Source s, WeightFormat f) {
  return (s == Source::kFp8 && f == WeightFormat::kFp8Block) || (s == Source::kNvfp4 && f == WeightFormat::kNvfp4) ||
         (s == Source::kMxfp4 && f == WeightFormat::kMxfp4);
}

// One stack [E, N, K] of a source, owning its storage, with its values as fp32.
struct SourceStack {
  int64_t experts = 0, rows = 0, cols = 0;
  std::vector<float> values;     // what the source means, fp32 [E, N, K]
  std::vector<float> f32;        // kFp32 storage
  std::vector<uint16_t> bf16;    // kBf16 storage
  std::vector<uint8_t> fp8;      // kFp8 storage
  std::vector<float> fp8_scale;  // kFp8 weight_scale_inv [E, N/128, K/128]
  std::vector<uint8_t> fp4, fp4_scale;  // kNvfp4 / kMxfp4: packed e2m1 [E, N, K/2], e4m3 [E, N, K/16] or e8m0 [E, N, K/32]
  std::vector<float> fp4_global;        // kNvfp4 [E]
  TensorView data, scale, global;
};

// Expert e is N(0, 1) * 2^(e - 1): the experts differ in magnitude (so per-expert scales differ).
SourceStack make_stack(Source src, int64_t experts, int64_t rows, int64_t cols, uint32_t seed) {
  SourceStack s;
  s.experts = experts;
  s.rows = rows;
  s.cols = cols;
  const int64_t per = rows * cols, n = experts * per;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> raw(n);
  for (int64_t i = 0; i < n; ++i) raw[i] = normal(rng) * std::ldexp(1.f, static_cast<int>(i / per) - 1);
  s.values.resize(n);
  switch (src) {
    case Source::kFp32:
      s.f32 = raw;
      s.values = raw;
      s.data = TensorView(s.f32.data(), DType::kFloat32, {experts, rows, cols});
      break;
    case Source::kBf16:
      s.bf16.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        s.bf16[i] = fmt::float_to_bf16(raw[i]);
        s.values[i] = fmt::bf16_to_float(s.bf16[i]);
      }
      s.data = TensorView(s.bf16.data(), DType::kBFloat16, {experts, rows, cols});
      break;
    case Source::kFp8: {
      const int64_t per_scale = rows / 128 * (cols / 128);
      s.fp8.resize(n);
      s.fp8_scale.resize(experts * per_scale);
      for (int64_t e = 0; e < experts; ++e) {
        fmt::quantize_fp8_128x128(&raw[e * per], rows, cols, &s.fp8[e * per], &s.fp8_scale[e * per_scale], false);
        fmt::dequantize_fp8_128x128(&s.fp8[e * per], &s.fp8_scale[e * per_scale], rows, cols, &s.values[e * per]);
      }
      s.data = TensorView(s.fp8.data(), DType::kFloat8E4M3, {experts, rows, cols});
      s.scale = TensorView(s.fp8_scale.data(), DType::kFloat32, {experts, rows / 128, cols / 128});
      break;
    }
    case Source::kNvfp4:
    case Source::kMxfp4: {
      const bool nv = src == Source::kNvfp4;
      const int64_t block = nv ? 16 : 32;
      s.fp4.resize(n / 2);
      s.fp4_scale.resize(n / block);
      for (int64_t e = 0; e < experts; ++e) {
        if (nv) {
          const float g = fmt::nvfp4_global_scale(fmt::amax_finite(&raw[e * per], per));
          s.fp4_global.push_back(g);
          fmt::quantize_nvfp4(&raw[e * per], per, g, &s.fp4[e * per / 2], &s.fp4_scale[e * per / block]);
          fmt::dequantize_nvfp4(&s.fp4[e * per / 2], &s.fp4_scale[e * per / block], g, per, &s.values[e * per]);
        } else {
          fmt::quantize_mxfp4(&raw[e * per], per, &s.fp4[e * per / 2], &s.fp4_scale[e * per / block]);
          fmt::dequantize_mxfp4(&s.fp4[e * per / 2], &s.fp4_scale[e * per / block], per, &s.values[e * per]);
        }
      }
      s.data = TensorView(s.fp4.data(), DType::kFloat4E2M1x2, {experts, rows, cols / 2});
      s.scale = TensorView(s.fp4_scale.data(), nv ? DType::kFloat8E4M3 : DType::kFloat8E8M0, {experts, rows, cols / block});
      if (nv) s.global = TensorView(s.fp4_global.data(), DType::kFloat32, {experts});
      break;
    }
  }
  return s;
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The expected QuantizedTensor, built expert by expert with the formats.h codecs.
QuantizedTensor expected_tensor(const SourceStack& s, WeightFormat format, bool pow2, bool fp8_source,
                                bool fp4_kept = false) {
  QuantizedTensor t;
  t.format = format;
  t.num_experts = s.experts;
  t.rows = s.rows;
  t.cols = s.cols;
  if (fp4_kept) {
    t.data = s.fp4;
    t.scales = s.fp4_scale;
    t.global_scales = s.fp4_global;
    return t;
  }
  const int64_t per = s.rows * s.cols, n = s.experts * per;
  switch (format) {
    case WeightFormat::kBf16: {
      std::vector<uint16_t> b(n);
      for (int64_t i = 0; i < n; ++i) b[i] = fmt::float_to_bf16(s.values[i]);
      t.data = as_bytes(b);
      break;
    }
    case WeightFormat::kFp8Block: {
      if (fp8_source) {
        t.data = s.fp8;
        t.scales = as_bytes(s.fp8_scale);
        break;
      }
      const int64_t per_scale = s.rows / 128 * (s.cols / 128);
      std::vector<float> sc(s.experts * per_scale);
      t.data.resize(n);
      for (int64_t e = 0; e < s.experts; ++e)
        fmt::quantize_fp8_128x128(&s.values[e * per], s.rows, s.cols, &t.data[e * per], &sc[e * per_scale], pow2);
      t.scales = as_bytes(sc);
      break;
    }
    case WeightFormat::kMxfp8:
      t.data.resize(n);
      t.scales.resize(n / 32);
      fmt::quantize_mxfp8(s.values.data(), n, t.data.data(), t.scales.data());
      break;
    case WeightFormat::kNvfp4:
      t.data.resize(n / 2);
      t.scales.resize(n / 16);
      for (int64_t e = 0; e < s.experts; ++e) {
        const float g = fmt::nvfp4_global_scale(fmt::amax_finite(&s.values[e * per], per));
        t.global_scales.push_back(g);
        fmt::quantize_nvfp4(&s.values[e * per], per, g, &t.data[e * per / 2], &t.scales[e * per / 16]);
      }
      break;
    case WeightFormat::kMxfp4:
      t.data.resize(n / 2);
      t.scales.resize(n / 32);
      fmt::quantize_mxfp4(s.values.data(), n, t.data.data(), t.scales.data());
      break;
  }
  return t;
}

// Bound on ||dequantize - source|| / ||source|| per format, from its per-element worst case:
//   bf16: RNE to 8 significant bits, relative error < 2^-9;
//   fp8-block: e4m3 normal range < 2^-4 relative, no saturation (amax / s <= 448); the subnormal
//     elements (|x| < 2^-6 s) err by <= 2^-10 s, negligible against the block amax's 448 s;
//   mxfp8: as e4m3, plus the OCP saturation of |x| / X in (448, 512): < 1/8 relative;
//   nvfp4: e2m1 normal range < 2^-2 relative; saturation where the e4m3 block scale rounded down
//     (< 2^-4 relative); N(0, 1) experts keep every block scale in e4m3's normal range;
//   mxfp4: e2m1 normal range < 2^-2 relative, plus the OCP saturation of |x| / X in (6, 8): < 1/4.
double format_bound(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBf16: return std::ldexp(1.0, -9);
    case WeightFormat::kFp8Block: return std::ldexp(1.0, -4);
    case WeightFormat::kMxfp8: return std::ldexp(1.0, -3);
    case WeightFormat::kNvfp4: return std::ldexp(1.0, -2);
    case WeightFormat::kMxfp4: return std::ldexp(1.0, -2);
  }
  return 0;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref, int64_t begin, int64_t end) {
  double err2 = 0, ref2 = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    err2 += d * d;
    ref2 += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(err2 / ref2);
}

struct Case {
  Source source;
  WeightFormat format;
  bool pow2;
};

class PrepareWeights : public ::testing::TestWithParam<Case> {};

void check_tensor(const char* name, const QuantizedTensor& got, const SourceStack& s, const Case& c) {
  const std::string what =
      std::string(name) + " " + source_name(c.source) + " -> " + to_string(c.format) + (c.pow2 ? " (pow2)" : "");
  EXPECT_EQ(got.format, c.format) << what;
  EXPECT_EQ(got.num_experts, s.experts) << what;
  EXPECT_EQ(got.rows, s.rows) << what;
  EXPECT_EQ(got.cols, s.cols) << what;
  const int64_t per = s.rows * s.cols;
  const bool fp4 = c.format == WeightFormat::kNvfp4 || c.format == WeightFormat::kMxfp4;
  const int64_t elem_bytes_x2 = c.format == WeightFormat::kBf16 ? 4 : (fp4 ? 1 : 2);
  EXPECT_EQ(got.data_bytes_per_expert(), per * elem_bytes_x2 / 2) << what;
  EXPECT_EQ(static_cast<int64_t>(got.data.size()), s.experts * got.data_bytes_per_expert()) << what;
  int64_t num_scales = 0;
  std::vector<int64_t> want_shape;
  switch (c.format) {
    case WeightFormat::kBf16: EXPECT_EQ(got.data_dtype(), DType::kBFloat16); break;
    case WeightFormat::kFp8Block:
      EXPECT_EQ(got.data_dtype(), DType::kFloat8E4M3);
      EXPECT_EQ(got.scale_dtype(), DType::kFloat32);
      want_shape = {s.experts, s.rows / 128, s.cols / 128};
      num_scales = s.experts * (s.rows / 128) * (s.cols / 128) * 4;
      break;
    case WeightFormat::kMxfp8:
      EXPECT_EQ(got.data_dtype(), DType::kFloat8E4M3);
      EXPECT_EQ(got.scale_dtype(), DType::kFloat8E8M0);
      want_shape = {s.experts, s.rows, s.cols / 32};
      num_scales = s.experts * s.rows * (s.cols / 32);
      break;
    case WeightFormat::kNvfp4:
      EXPECT_EQ(got.data_dtype(), DType::kFloat4E2M1x2);
      EXPECT_EQ(got.scale_dtype(), DType::kFloat8E4M3);
      want_shape = {s.experts, s.rows, s.cols / 16};
      num_scales = s.experts * s.rows * (s.cols / 16);
      break;
    case WeightFormat::kMxfp4:
      EXPECT_EQ(got.data_dtype(), DType::kFloat4E2M1x2);
      EXPECT_EQ(got.scale_dtype(), DType::kFloat8E8M0);
      want_shape = {s.experts, s.rows, s.cols / 32};
      num_scales = s.experts * s.rows * (s.cols / 32);
      break;
  }
  EXPECT_EQ(got.scale_shape(), want_shape) << what;
  EXPECT_EQ(static_cast<int64_t>(got.scales.size()), num_scales) << what;
  EXPECT_EQ(got.global_scales.size(), c.format == WeightFormat::kNvfp4 ? static_cast<size_t>(s.experts) : 0u) << what;

  const bool fp4_kept = kept_as_is(c.source, c.format) && c.source != Source::kFp8;
  const QuantizedTensor want = expected_tensor(s, c.format, c.pow2, c.source == Source::kFp8, fp4_kept);
  EXPECT_TRUE(got.data == want.data) << what << ": data differs from the formats.h codec";
  EXPECT_TRUE(got.scales == want.scales) << what << ": scales differ from the formats.h codec";
  EXPECT_EQ(got.global_scales, want.global_scales) << what;
  if (c.source == Source::kFp8 && c.format == WeightFormat::kFp8Block) {
    EXPECT_TRUE(got.data == s.fp8) << what << ": fp8 -> fp8-block must keep the codes bit for bit";
    EXPECT_TRUE(got.scales == as_bytes(s.fp8_scale)) << what << ": and the weight_scale_inv bits";
  }
  if (fp4_kept) {
    EXPECT_TRUE(got.data == s.fp4) << what << ": an fp4 source in its own format keeps its codes bit for bit";
    EXPECT_TRUE(got.scales == s.fp4_scale) << what << ": and its block scales";
    EXPECT_EQ(got.global_scales, s.fp4_global) << what << ": and its global scales";
  }
  if (c.format == WeightFormat::kFp8Block && c.pow2 && c.source != Source::kFp8) {
    std::vector<float> sc(got.scales.size() / 4);
    std::memcpy(sc.data(), got.scales.data(), got.scales.size());
    for (float v : sc) {
      int exp;
      ASSERT_EQ(std::frexp(v, &exp), 0.5f) << what << ": pow2 scale " << v;
    }
  }

  std::vector<float> deq(3, -1.f);
  got.dequantize(&deq);
  ASSERT_EQ(static_cast<int64_t>(deq.size()), s.experts * per) << what;
  const double bound = format_bound(c.format);
  for (int64_t e = 0; e < s.experts; ++e) {
    const double err = rel_l2(deq, s.values, e * per, (e + 1) * per);
    std::printf("%-38s expert %lld rel-L2 %.4e (bound %.4e)\n", what.c_str(), static_cast<long long>(e), err, bound);
    EXPECT_LE(err, bound) << what << " expert " << e;
    std::vector<float> one(per, -1.f);
    got.dequantize_expert(e, one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), &deq[e * per], per * sizeof(float))) << what << " expert " << e;
  }
}

TEST_P(PrepareWeights, LayoutAndErrorBound) {
  const Case c = GetParam();
  const MoeGeometry g = test_geometry();
  MoeConfig config;
  config.weight_format = c.format;
  config.pow2_scales = c.pow2;
  const int64_t el = g.experts_per_rank();
  SourceStack w13 = make_stack(c.source, el, 2 * g.intermediate, g.hidden, 1000u + static_cast<uint32_t>(c.source));
  SourceStack w2 = make_stack(c.source, el, g.hidden, g.intermediate, 2000u + static_cast<uint32_t>(c.source));
  MoeWeights src;
  src.w13 = w13.data;
  src.w13_scale = w13.scale;
  src.w2 = w2.data;
  src.w2_scale = w2.scale;
  src.w13_global_scale = w13.global;
  src.w2_global_scale = w2.global;
  PreparedWeights out;
  const Status st = prepare_weights(g, config, src, &out);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(out.format, c.format);
  check_tensor("w13", out.w13, w13, c);
  check_tensor("w2", out.w2, w2, c);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Source s : {Source::kFp32, Source::kBf16, Source::kFp8, Source::kNvfp4, Source::kMxfp4}) {
    cases.push_back({s, WeightFormat::kBf16, false});
    cases.push_back({s, WeightFormat::kFp8Block, false});
    cases.push_back({s, WeightFormat::kFp8Block, true});
    cases.push_back({s, WeightFormat::kMxfp8, false});
    cases.push_back({s, WeightFormat::kNvfp4, false});
    cases.push_back({s, WeightFormat::kMxfp4, false});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sources, PrepareWeights, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           const Case& c = param_info.param;
                           std::string name = std::string(source_name(c.source)) + "_To_";
                           for (const char* p = to_string(c.format); *p; ++p)
                             if (std::isalnum(static_cast<unsigned char>(*p))) name += *p;
                           return name + (c.pow2 ? "_Pow2" : "");
                         });

// ---------------------------------------------------------------------------------------------
// Bad sources.

struct BadSourceFixture : ::testing::Test {
  MoeGeometry g = test_geometry();
  MoeConfig config;
  SourceStack w13 = make_stack(Source::kFp8, 3, 768, 256, 1u);
  SourceStack w2 = make_stack(Source::kFp8, 3, 256, 384, 2u);
  MoeWeights src;
  PreparedWeights out;
  void SetUp() override {
    src.w13 = w13.data;
    src.w13_scale = w13.scale;
    src.w2 = w2.data;
    src.w2_scale = w2.scale;
    ASSERT_TRUE(prepare_weights(g, config, src, &out).is_ok());
  }
  std::string fail() {
    const Status st = prepare_weights(g, config, src, &out);
    EXPECT_FALSE(st.is_ok());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    return st.message();
  }
};

TEST_F(BadSourceFixture, AbsentW13) {
  src.w13 = TensorView();
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w13=absent");
  EXPECT_CONTAINS(m, "[3, 768, 256]");
}

TEST_F(BadSourceFixture, W13ShapeNamesFieldValueAndRule) {
  src.w13.shape[1] = 384;  // I rows instead of 2I
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w13.shape=[3, 384, 256]");
  EXPECT_CONTAINS(m, "[E_local, 2I, H] = [3, 768, 256]");
}

TEST_F(BadSourceFixture, W2ShapeWithGlobalExpertCount) {
  src.w2.shape[0] = 6;  // all experts instead of this rank's
  src.w2_scale.shape[0] = 6;
  EXPECT_CONTAINS(fail(), "w2.shape=[6, 256, 384], must be [E_local, H, I] = [3, 256, 384]");
}

TEST_F(BadSourceFixture, W2DType) {
  src.w2.dtype = DType::kInt32;
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w2.dtype=int32");
  EXPECT_CONTAINS(m, "float32, bfloat16, float8_e4m3");
}

TEST_F(BadSourceFixture, Fp8WithoutScale) {
  src.w13_scale = TensorView();
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w13_scale=absent");
  EXPECT_CONTAINS(m, "[E_local, 2I/128, H/128] = [3, 6, 2]");
}

TEST_F(BadSourceFixture, ScaleDType) {
  src.w2_scale.dtype = DType::kBFloat16;
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w2_scale.dtype=bfloat16");
  EXPECT_CONTAINS(m, "must be float32");
}

TEST_F(BadSourceFixture, ScaleShape) {
  src.w13_scale = TensorView(w13.fp8_scale.data(), DType::kFloat32, {3, 2, 6});  // transposed blocks
  EXPECT_CONTAINS(fail(), "w13_scale.shape=[3, 2, 6], must be [E_local, 2I/128, H/128] = [3, 6, 2]");
}

TEST_F(BadSourceFixture, ScaleForNonFp8Source) {
  std::vector<float> f(3 * 768 * 256, 0.5f);
  src.w13 = TensorView(f.data(), DType::kFloat32, {3, 768, 256});
  const std::string m = fail();
  EXPECT_CONTAINS(m, "invalid weights: w13_scale=float32[3, 6, 2] on cpu");
  EXPECT_CONTAINS(m, "leave it absent for float32");
}

TEST_F(BadSourceFixture, NonFiniteScale) {
  w2.fp8_scale[1 * 6 + 1 * 3 + 0] = std::nanf("");  // [expert 1, block row 1, block col 0] of [3, 2, 3]
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w2_scale[1, 1, 0]=nan");
  EXPECT_CONTAINS(m, "finite and >= 0");
}

TEST_F(BadSourceFixture, DeviceMemory) {
  src.w13.device = Device::cuda(0);
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w13.device=cuda:0");
  EXPECT_CONTAINS(m, "must be cpu");
}

TEST_F(BadSourceFixture, NonContiguous) {
  src.w2.strides = {256 * 384, 1, 256};  // a transposed view
  const std::string m = fail();
  EXPECT_CONTAINS(m, "w2.strides=[98304, 1, 256]");
  EXPECT_CONTAINS(m, "contiguous");
}

TEST_F(BadSourceFixture, NullData) {
  src.w2.data = nullptr;
  EXPECT_CONTAINS(fail(), "w2.data=null");
}

TEST_F(BadSourceFixture, InvalidGeometryAndNullOut) {
  g.hidden = 200;
  EXPECT_CONTAINS(fail(), "hidden=200");
  g = test_geometry();
  const Status st = prepare_weights(g, config, src, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(st.message(), "out=null");
}

}  // namespace
}  // namespace megamoe

namespace megamoe {
namespace {

// A layer's prepared weights handed back as a source prepare to the same bytes (bench reuses them).
TEST(PreparedWeightsAsSource, EveryReusableFormatPreparesToTheSameBytes) {
  const MoeGeometry g = test_geometry();
  SourceStack w13 = make_stack(Source::kFp32, 3, 768, 256, 5u), w2 = make_stack(Source::kFp32, 3, 256, 384, 6u);
  MoeWeights src;
  src.w13 = w13.data;
  src.w2 = w2.data;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8Block, WeightFormat::kNvfp4, WeightFormat::kMxfp4,
                         WeightFormat::kMxfp8}) {
    MoeConfig c;
    c.weight_format = f;
    PreparedWeights first, again;
    ASSERT_TRUE(prepare_weights(g, c, src, &first).is_ok());
    const MoeWeights views = first.as_source();
    if (f == WeightFormat::kMxfp8) {
      EXPECT_FALSE(views.w13.present()) << "mxfp8 is no source format";
      continue;
    }
    const Status st = prepare_weights(g, c, views, &again);
    ASSERT_TRUE(st.is_ok()) << to_string(f) << ": " << st.to_string();
    EXPECT_TRUE(again.w13.data == first.w13.data && again.w2.data == first.w2.data) << to_string(f);
    EXPECT_TRUE(again.w13.scales == first.w13.scales && again.w2.scales == first.w2.scales) << to_string(f);
    EXPECT_EQ(again.w13.global_scales, first.w13.global_scales) << to_string(f);
  }
}

// Bad fp4 sources: scales and global scales checked like the fp8 ones.
struct BadFp4SourceFixture : ::testing::Test {
  MoeGeometry g = test_geometry();
  MoeConfig config;
  SourceStack w13 = make_stack(Source::kNvfp4, 3, 768, 256, 1u);
  SourceStack w2 = make_stack(Source::kMxfp4, 3, 256, 384, 2u);
  MoeWeights src;
  PreparedWeights out;
  void SetUp() override {
    config.weight_format = WeightFormat::kNvfp4;
    src.w13 = w13.data;
    src.w13_scale = w13.scale;
    src.w13_global_scale = w13.global;
    src.w2 = w2.data;
    src.w2_scale = w2.scale;
    const Status st = prepare_weights(g, config, src, &out);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  std::string fail() {
    const Status st = prepare_weights(g, config, src, &out);
    EXPECT_FALSE(st.is_ok());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    return st.message();
  }
};

TEST_F(BadFp4SourceFixture, PackedShapeNamesHalfK) {
  src.w2 = TensorView(w2.fp4.data(), DType::kFloat4E2M1x2, {3, 256, 384});  // elements, not packed bytes
  EXPECT_CONTAINS(fail(), "w2.shape=[3, 256, 384], must be [E_local, H, I/2] (packed bytes) = [3, 256, 192]");
}

TEST_F(BadFp4SourceFixture, MissingOrWrongScales) {
  src.w13_scale = TensorView();
  EXPECT_CONTAINS(fail(), "w13_scale=absent, a float4_e2m1x2 w13 needs its block scales");
  src.w13_scale = w13.scale;
  src.w13_scale.dtype = DType::kFloat32;
  EXPECT_CONTAINS(fail(), "w13_scale.dtype=float32");
  src.w13_scale = w13.scale;
  src.w13_scale.dtype = DType::kFloat8E8M0;  // mxfp4 scales of the wrong shape
  EXPECT_CONTAINS(fail(), "w13_scale.shape=[3, 768, 16], must be [E_local, 2I, H/32] = [3, 768, 8]");
}

TEST_F(BadFp4SourceFixture, GlobalScaleRules) {
  src.w13_global_scale = TensorView();
  EXPECT_CONTAINS(fail(), "w13_global_scale=absent, an nvfp4 w13 needs its fp32 global scale");
  src.w13_global_scale = w13.global;
  w13.fp4_global[2] = 0.f;
  EXPECT_CONTAINS(fail(), "w13_global_scale[2]=0, an nvfp4 global scale must be finite and > 0");
  w13.fp4_global[2] = 1.f;
  src.w2_global_scale = w13.global;  // mxfp4 has none
  EXPECT_CONTAINS(fail(), "only an nvfp4 source has a global scale");
}

TEST_F(BadFp4SourceFixture, NanScaleCodes) {
  w13.fp4_scale[1 * 768 * 16 + 5 * 16 + 3] = 0xFF;  // e4m3 -NaN at [1, 5, 3]
  EXPECT_CONTAINS(fail(), "w13_scale[1, 5, 3]=0xFF, an e4m3 block scale must be finite and >= 0");
  w13.fp4_scale[1 * 768 * 16 + 5 * 16 + 3] = 0xB8;  // -1.0
  EXPECT_CONTAINS(fail(), "w13_scale[1, 5, 3]=0xB8");
  w13.fp4_scale[1 * 768 * 16 + 5 * 16 + 3] = 0x38;
  w2.fp4_scale[7] = 0xFF;
  EXPECT_CONTAINS(fail(), "w2_scale[0, 0, 7]=0xFF, an e8m0 scale code must not be 0xFF (NaN)");
}

TEST_F(BadFp4SourceFixture, GlobalScaleOnAnFp8Source) {
  SourceStack f = make_stack(Source::kFp8, 3, 768, 256, 3u);
  src.w13 = f.data;
  src.w13_scale = f.scale;
  EXPECT_CONTAINS(fail(), "w13_global_scale=float32[3] on cpu, only an nvfp4 (float4_e2m1x2) w13 has a global scale");
}

}  // namespace
}  // namespace megamoe

// ---------------------------------------------------------------------------------------------
// Device-resident sources: the checks MoeLayer::create() runs before any device access
// (check_device_weights reads no data, so these views point at host memory marked cuda:0).

namespace megamoe {
namespace {

struct DeviceSourceFixture : ::testing::Test {
  MoeGeometry g = test_geometry();
  MoeConfig config;  // fp8-block
  SourceStack w13 = make_stack(Source::kFp8, 3, 768, 256, 1u);
  SourceStack w2 = make_stack(Source::kFp8, 3, 256, 384, 2u);
  SourceStack b13 = make_stack(Source::kBf16, 3, 768, 256, 3u);
  SourceStack b2 = make_stack(Source::kBf16, 3, 256, 384, 4u);
  MoeWeights src;
  void SetUp() override {
    src.w13 = w13.data;
    src.w13_scale = w13.scale;
    src.w2 = w2.data;
    src.w2_scale = w2.scale;
    for (TensorView* v : {&src.w13, &src.w13_scale, &src.w2, &src.w2_scale}) v->device = Device::cuda(0);
    ASSERT_TRUE(on_device(src));
    const Status st = check_device_weights(g, config, src);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  void use_bf16() {
    config.weight_format = WeightFormat::kBf16;
    config.dispatch_format = DispatchFormat::kBf16;
    src = MoeWeights();
    src.w13 = b13.data;
    src.w2 = b2.data;
    src.w13.device = src.w2.device = Device::cuda(0);
  }
  std::string fail() {
    const Status st = check_device_weights(g, config, src);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    return st.message();
  }
};

TEST_F(DeviceSourceFixture, Bf16TakenAsBf16) {
  use_bf16();
  const Status st = check_device_weights(g, config, src);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// bf16 into fp8-block is the one conversion the device path makes (sm90_weight_quant.h); a mixed
// source (bf16 w13, e4m3 w2) is two stacks, each taken on its own.
TEST_F(DeviceSourceFixture, Bf16QuantisedIntoFp8BlockOnTheDevice) {
  src.w13 = b13.data;
  src.w13_scale = TensorView();
  src.w13.device = Device::cuda(0);
  Status st = check_device_weights(g, config, src);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  src.w2 = b2.data;
  src.w2_scale = TensorView();
  src.w2.device = Device::cuda(0);
  st = check_device_weights(g, config, src);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  src.w2_scale = w2.scale;  // a bf16 stack has no scales
  src.w2_scale.device = Device::cuda(0);
  EXPECT_CONTAINS(fail(), "w2_scale=float32[3, 2, 3] on cuda:0, only a float8_e4m3 w2 has scales");
}

TEST_F(DeviceSourceFixture, OtherConversionsAreRefusedNamingTheRule) {
  src.w13.dtype = DType::kFloat32;  // fp32 into fp8-block: a host conversion
  std::string m = fail();
  EXPECT_CONTAINS(m, "w13.dtype=float32");
  EXPECT_CONTAINS(m, "weight_format fp8-block must be float8_e4m3 with float32 128x128 scales (kept as they are) "
                     "or bfloat16 (quantised on the device)");
  EXPECT_CONTAINS(m, "copy the weights to the host first");
  use_bf16();
  src.w2 = w2.data;  // e4m3 into bf16
  src.w2.device = Device::cuda(0);
  m = fail();
  EXPECT_CONTAINS(m, "w2.dtype=float8_e4m3");
  EXPECT_CONTAINS(m, "must be bfloat16 without scales");
  EXPECT_CONTAINS(m, "copy the weights to the host first");
  for (WeightFormat f : {WeightFormat::kMxfp8, WeightFormat::kMxfp4, WeightFormat::kNvfp4}) {
    config.weight_format = f;
    m = fail();
    EXPECT_CONTAINS(m, std::string("config.weight_format=") + to_string(f) +
                           ", device-resident weights are prepared on the device for fp8-block or bf16 only");
    EXPECT_CONTAINS(m, "copy the weights to the host first");
  }
}

TEST_F(DeviceSourceFixture, EveryViewOnW13sDevice) {
  src.w2.device = Device::cpu();
  EXPECT_CONTAINS(fail(), "w2.device=cpu, must be cuda:0 like w13");
  src.w2.device = Device::cuda(0);
  src.w13_scale.device = Device::cuda(1);
  EXPECT_CONTAINS(fail(), "w13_scale.device=cuda:1, must be cuda:0 like w13");
}

TEST_F(DeviceSourceFixture, ShapesStridesAndScales) {
  src.w13.shape[1] = 384;
  EXPECT_CONTAINS(fail(), "w13.shape=[3, 384, 256], must be [E_local, 2I, H] = [3, 768, 256]");
  src.w13.shape[1] = 768;
  src.w2.strides = {256 * 384, 1, 256};
  EXPECT_CONTAINS(fail(), "w2.strides=[98304, 1, 256], must be contiguous");
  src.w2.strides = src.w13.strides;  // restored below by the contiguous view
  src.w2 = w2.data;
  src.w2.device = Device::cuda(0);
  src.w2_scale = TensorView();
  EXPECT_CONTAINS(fail(), "w2_scale=absent, a float8_e4m3 w2 needs its fp32 128x128 weight_scale_inv");
  src.w2_scale = w2.scale;
  src.w2_scale.device = Device::cuda(0);
  src.w2_scale.dtype = DType::kBFloat16;
  EXPECT_CONTAINS(fail(), "w2_scale.dtype=bfloat16, must be float32");
  src.w2_scale.dtype = DType::kFloat32;
  src.w13.data = nullptr;
  EXPECT_CONTAINS(fail(), "w13.data=null");
}

// create() runs those checks first, whatever the backend, before any device access. The cpu backend
// then refuses device weights (it computes from host memory), with the phrase megamoe.torch falls back
// on; the GPU backends prepare them (tests/gpu/test_device_weights.cpp). Without a CUDA device (CI)
// `auto` resolves to cpu and refuses them the same way, and routed and mega are unavailable.
TEST_F(DeviceSourceFixture, CreateChecksThenTheCpuBackendRefusesDeviceWeights) {
  g.ep_size = 1;
  g.ep_rank = 0;
  g.num_experts = 3;
  std::unique_ptr<MoeLayer> layer;
  src.w13.dtype = DType::kFloat32;
  for (Backend b : {Backend::kCpu, Backend::kRouted, Backend::kMega, Backend::kAuto}) {
    config.backend = b;
    const Status st = MoeLayer::create(g, config, src, nullptr, &layer);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << to_string(b);
    EXPECT_CONTAINS(st.message(), "w13.dtype=float32");
    EXPECT_EQ(layer, nullptr);
  }
  src.w13.dtype = DType::kFloat8E4M3;
  config.backend = Backend::kCpu;
  Status st = MoeLayer::create(g, config, src, nullptr, &layer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(st.message(), "w13.device=cuda:0, the cpu backend computes from host memory (backend=cpu requested)");
  EXPECT_CONTAINS(st.message(), "copy the weights to the host first");
  EXPECT_EQ(layer, nullptr);
  if (cuda_device_count() > 0) return;  // the fixture's views are host memory labelled cuda:0
  config.backend = Backend::kAuto;
  st = MoeLayer::create(g, config, src, nullptr, &layer);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(st.message(), "w13.device=cuda:0, the cpu backend computes from host memory");
  EXPECT_CONTAINS(st.message(), "copy the weights to the host first");
  EXPECT_EQ(layer, nullptr);
  for (Backend b : {Backend::kRouted, Backend::kMega}) {
    config.backend = b;
    st = MoeLayer::create(g, config, src, nullptr, &layer);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << to_string(b);
    EXPECT_CONTAINS(st.message(), std::string("backend=") + to_string(b) + " is unavailable");
    EXPECT_EQ(layer, nullptr);
  }
}

}  // namespace
}  // namespace megamoe

// ---------------------------------------------------------------------------------------------
// expert_weight_views(): each local expert's regions of the GPU backends' weight buffers (pointer
// arithmetic only, checked here on made-up addresses; tests/gpu/test_device_weights.cpp reads them).


namespace megamoe {
namespace {

// Buffers at made-up addresses, released (never freed) before they go.
struct FakeBuffers {
  ExpertWeightBuffers b;
  FakeBuffers(bool scales) {
    auto make = [](uintptr_t at) {
      auto d = std::make_shared<DeviceBuffer>();
      d->ptr = reinterpret_cast<void*>(at);
      return d;
    };
    b.w13 = make(0x10000000);
    b.w2 = make(0x20000000);
    if (scales) {
      b.w13_scales = make(0x30000000);
      b.w2_scales = make(0x40000000);
    }
  }
  ~FakeBuffers() {
    for (auto* p : {&b.w13, &b.w2, &b.w13_scales, &b.w2_scales})
      if (*p) (*p)->ptr = nullptr;
  }
};

intptr_t at(const void* p) { return static_cast<intptr_t>(reinterpret_cast<uintptr_t>(p)); }

TEST(ExpertWeightViews, Fp8BlockAndBf16RegionsPerExpert) {
  MoeGeometry g = test_geometry();  // H 256, I 384, E_local 3
  const int64_t El = g.experts_per_rank(), H = g.hidden, I = g.intermediate;
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kBf16}) {
    const bool fp8 = f == WeightFormat::kFp8Block;
    const int64_t elem = fp8 ? 1 : 2;
    FakeBuffers fake(fp8);
    std::vector<ExpertWeightView> v;
    ASSERT_TRUE(expert_weight_views_of(g, f, fake.b, &v).is_ok());
    ASSERT_EQ(static_cast<int64_t>(v.size()), El);
    for (int64_t e = 0; e < El; ++e) {
      const ExpertWeightView& x = v[static_cast<size_t>(e)];
      EXPECT_EQ(x.w13_bytes, 2 * I * H * elem);
      EXPECT_EQ(at(x.w13), 0x10000000 + e * 2 * I * H * elem);
      EXPECT_EQ(x.w2_bytes, H * I * elem);
      EXPECT_EQ(at(x.w2), 0x20000000 + e * H * I * elem);
      if (!fp8) {
        EXPECT_EQ(x.w13_scale, nullptr);
        EXPECT_EQ(x.w2_scale, nullptr);
        EXPECT_EQ(x.w13_scale_bytes + x.w2_scale_bytes, 0);
        continue;
      }
      EXPECT_EQ(x.w13_scale_bytes, (2 * I / 128) * (H / 128) * 4);
      EXPECT_EQ(at(x.w13_scale), 0x30000000 + e * x.w13_scale_bytes);
      EXPECT_EQ(x.w2_scale_bytes, (H / 128) * (I / 128) * 4);
      EXPECT_EQ(at(x.w2_scale), 0x40000000 + e * x.w2_scale_bytes);
    }
  }
}

// mxfp4: each stack one image, [E] block scales, padding to 128 bytes, then [E] pieces
// (gemm_weights.h): an expert's scales and pieces are contiguous, and the experts tile the image.
TEST(ExpertWeightViews, Mxfp4RegionsInsideTheImages) {
  MoeGeometry g = test_geometry();
  const int64_t El = g.experts_per_rank(), H = g.hidden, I = g.intermediate;
  FakeBuffers fake(false);
  std::vector<ExpertWeightView> v;
  ASSERT_TRUE(expert_weight_views_of(g, WeightFormat::kMxfp4, fake.b, &v).is_ok());
  ASSERT_EQ(static_cast<int64_t>(v.size()), El);
  const int64_t pieces13 = gemm::mxfp4_pieces_offset(El, 2 * I, H), pieces2 = gemm::mxfp4_pieces_offset(El, H, I);
  const int64_t code13 = (H / 128) * (2 * I / gemm::kFp4SlabRows) * gemm::kFp4SlabBytes;
  const int64_t code2 = (I / 128) * (H / gemm::kFp4SlabRows) * gemm::kFp4SlabBytes;
  for (int64_t e = 0; e < El; ++e) {
    const ExpertWeightView& x = v[static_cast<size_t>(e)];
    EXPECT_EQ(x.w13_scale_bytes, (2 * I / 128) * (H / 128) * 4);
    EXPECT_EQ(at(x.w13_scale), 0x10000000 + e * x.w13_scale_bytes);
    EXPECT_EQ(x.w13_bytes, code13);
    EXPECT_EQ(at(x.w13), 0x10000000 + pieces13 + e * code13);
    EXPECT_EQ(x.w2_scale_bytes, (H / 128) * (I / 128) * 4);
    EXPECT_EQ(at(x.w2_scale), 0x20000000 + e * x.w2_scale_bytes);
    EXPECT_EQ(x.w2_bytes, code2);
    EXPECT_EQ(at(x.w2), 0x20000000 + pieces2 + e * code2);
  }
  // The last expert's pieces end where the image does.
  gemm::Mxfp4GemmWeights w13;
  w13.num_experts = El, w13.n = 2 * I, w13.k = H;
  w13.slabs.assign(static_cast<size_t>(El * code13), 0);
  w13.block_scales.assign(static_cast<size_t>(El * (2 * I / 128) * (H / 128)), 0.f);
  EXPECT_EQ(static_cast<int64_t>(gemm::device_image(w13).size()), pieces13 + El * code13);
}

TEST(ExpertWeightViews, RefusedWithoutBuffersAndOnTheCpuBackend) {
  MoeGeometry g = test_geometry();
  ExpertWeightBuffers none;
  std::vector<ExpertWeightView> v;
  EXPECT_EQ(expert_weight_views_of(g, WeightFormat::kFp8Block, none, &v).code(), StatusCode::kFailedPrecondition);
  g.ep_size = 1;
  g.ep_rank = 0;
  g.num_experts = 3;
  SourceStack w13 = make_stack(Source::kFp8, 3, 768, 256, 1u), w2 = make_stack(Source::kFp8, 3, 256, 384, 2u);
  MoeWeights src;
  src.w13 = w13.data;
  src.w13_scale = w13.scale;
  src.w2 = w2.data;
  src.w2_scale = w2.scale;
  MoeConfig c;
  c.backend = Backend::kCpu;
  std::unique_ptr<MoeLayer> layer;
  ASSERT_TRUE(MoeLayer::create(g, c, src, nullptr, &layer).is_ok());
  EXPECT_EQ(layer->expert_weight_views(&v).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace megamoe
