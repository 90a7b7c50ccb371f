// Table-driven validation: every bad configuration or call is refused with a message that names the
// field, the value and the rule.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/layer.h"

namespace megamoe {
namespace {

MoeGeometry good_geometry() {
  MoeGeometry g;
  g.hidden = 256;
  g.intermediate = 128;
  g.num_experts = 8;
  g.top_k = 2;
  g.ep_size = 2;
  g.ep_rank = 1;
  g.max_tokens_per_rank = 16;
  return g;
}

struct BadConfigCase {
  const char* name;
  std::function<void(MoeGeometry&, MoeConfig&)> mutate;
  std::vector<std::string> expected;  // substrings the message must contain
};

class BadConfig : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfig, RefusedWithNamedFieldValueAndRule) {
  MoeGeometry g = good_geometry();
  MoeConfig c;
  ASSERT_TRUE(c.validate(g).is_ok()) << c.validate(g).to_string();
  GetParam().mutate(g, c);
  Status st = c.validate(g);
  ASSERT_FALSE(st.is_ok()) << GetParam().name;
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  for (const auto& s : GetParam().expected) EXPECT_NE(st.message().find(s), std::string::npos)
      << "message '" << st.message() << "' lacks '" << s << "'";
}

const BadConfigCase kBadConfigs[] = {
    {"hidden_zero", [](MoeGeometry& g, MoeConfig&) { g.hidden = 0; }, {"hidden=0", "positive"}},
    {"hidden_negative", [](MoeGeometry& g, MoeConfig&) { g.hidden = -128; }, {"hidden=-128", "positive"}},
    {"hidden_not_128", [](MoeGeometry& g, MoeConfig&) { g.hidden = 2880; }, {"hidden=2880", "multiple of 128", "2944"}},
    {"hidden_too_big", [](MoeGeometry& g, MoeConfig&) { g.hidden = 1 << 20; }, {"hidden=1048576", "at most"}},
    {"intermediate_zero", [](MoeGeometry& g, MoeConfig&) { g.intermediate = 0; }, {"intermediate=0", "positive"}},
    {"intermediate_not_128", [](MoeGeometry& g, MoeConfig&) { g.intermediate = 200; },
     {"intermediate=200", "multiple of 128", "256"}},
    {"experts_zero", [](MoeGeometry& g, MoeConfig&) { g.num_experts = 0; }, {"num_experts=0", "[1,"}},
    {"experts_not_divisible", [](MoeGeometry& g, MoeConfig&) { g.num_experts = 9; g.ep_rank = 0; g.ep_size = 2; },
     {"num_experts=9", "divisible by ep_size=2"}},
    {"top_k_zero", [](MoeGeometry& g, MoeConfig&) { g.top_k = 0; }, {"top_k=0", "[1, num_experts=8]"}},
    {"top_k_above_experts", [](MoeGeometry& g, MoeConfig&) { g.top_k = 9; }, {"top_k=9", "[1, num_experts=8]"}},
    {"top_k_above_limit", [](MoeGeometry& g, MoeConfig&) { g.num_experts = 64; g.top_k = 33; }, {"top_k=33", "at most 32"}},
    {"ep_size_zero", [](MoeGeometry& g, MoeConfig&) { g.ep_size = 0; }, {"ep_size=0", "at least 1"}},
    {"ep_rank_negative", [](MoeGeometry& g, MoeConfig&) { g.ep_rank = -1; }, {"ep_rank=-1", "[0, ep_size=2)"}},
    {"ep_rank_too_big", [](MoeGeometry& g, MoeConfig&) { g.ep_rank = 2; }, {"ep_rank=2", "[0, ep_size=2)"}},
    {"max_tokens_negative", [](MoeGeometry& g, MoeConfig&) { g.max_tokens_per_rank = -5; },
     {"max_tokens_per_rank=-5", ">= 0"}},
    {"max_tokens_dp_multiplied", [](MoeGeometry& g, MoeConfig&) { g.max_tokens_per_rank = 8192 * 256; },
     {"max_tokens_per_rank=2097152", "never multiply it by dp or ep size"}},
    {"in_kernel_reduce_mxfp8",
     [](MoeGeometry&, MoeConfig& c) { c.in_kernel_fc2_reduce = true; c.combine_dtype = CombineDtype::kMxfp8; },
     {"combine_dtype=mxfp8", "in_kernel_fc2_reduce", "bf16"}},
    {"in_kernel_reduce_nvfp4",
     [](MoeGeometry&, MoeConfig& c) { c.in_kernel_fc2_reduce = true; c.combine_dtype = CombineDtype::kNvfp4; },
     {"combine_dtype=nvfp4", "in_kernel_fc2_reduce"}},
    {"owner_reduce_with_in_kernel_reduce",
     [](MoeGeometry&, MoeConfig& c) { c.owner_reduce = OwnerReduce::kOn; c.in_kernel_fc2_reduce = true; },
     {"owner_reduce=on", "in_kernel_fc2_reduce=true", "pick one"}},
    {"owner_reduce_out_of_range", [](MoeGeometry&, MoeConfig& c) { c.owner_reduce = static_cast<OwnerReduce>(7); },
     {"owner_reduce=7", "auto, off or on"}},
    {"pow2_without_fp8_block",
     [](MoeGeometry&, MoeConfig& c) {
       c.pow2_scales = true;
       c.weight_format = WeightFormat::kMxfp8;
       c.dispatch_format = DispatchFormat::kBf16;
     },
     {"pow2_scales=true", "fp8-block"}},
    {"mega_threshold_negative", [](MoeGeometry&, MoeConfig& c) { c.mega_max_tokens_per_rank = -1; },
     {"mega_max_tokens_per_rank=-1", ">= 0"}},
    {"block_m_odd", [](MoeGeometry&, MoeConfig& c) { c.knobs.block_m = 96; }, {"block_m=96", "64 or 128"}},
    {"block_n_odd", [](MoeGeometry&, MoeConfig& c) { c.knobs.block_n = 100; }, {"block_n=100", "64, 128 or 256"}},
    {"num_sms_negative", [](MoeGeometry&, MoeConfig& c) { c.knobs.num_sms = -2; }, {"num_sms=-2", "[0, 1024]"}},
    {"combine_groups_too_many", [](MoeGeometry&, MoeConfig& c) { c.knobs.combine_groups = 9; },
     {"combine_groups=9", "[0, 8]"}},
    {"backend_out_of_range", [](MoeGeometry&, MoeConfig& c) { c.backend = static_cast<Backend>(7); },
     {"backend=7", "auto, mega, routed or cpu"}},
    {"weight_format_out_of_range", [](MoeGeometry&, MoeConfig& c) { c.weight_format = static_cast<WeightFormat>(9); },
     {"weight_format=9"}},
    {"combine_out_of_range", [](MoeGeometry&, MoeConfig& c) { c.combine_dtype = static_cast<CombineDtype>(-1); },
     {"combine_dtype=-1"}},
    {"dispatch_out_of_range", [](MoeGeometry&, MoeConfig& c) { c.dispatch_format = static_cast<DispatchFormat>(5); },
     {"dispatch_format=5"}},
};

INSTANTIATE_TEST_SUITE_P(Validation, BadConfig, ::testing::ValuesIn(kBadConfigs),
                         [](const ::testing::TestParamInfo<BadConfigCase>& info) { return std::string(info.param.name); });

TEST(Validation, GoodConfigsPass) {
  MoeGeometry g = good_geometry();
  MoeConfig c;
  EXPECT_TRUE(c.validate(g).is_ok());
  g.max_tokens_per_rank = 0;  // a layer may be built for zero tokens (it still takes part)
  EXPECT_TRUE(g.validate().is_ok());
  c.in_kernel_fc2_reduce = true;  // bf16 wire: allowed
  EXPECT_TRUE(c.validate(g).is_ok());
}

TEST(Validation, OwnerReduceAlone_AcceptedWithEveryCombineDtype) {
  const MoeGeometry g = good_geometry();
  for (CombineDtype d : {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {
    MoeConfig c;
    c.owner_reduce = OwnerReduce::kOn;
    c.combine_dtype = d;
    const Status st = c.validate(g);
    EXPECT_TRUE(st.is_ok()) << to_string(d) << ": " << st.to_string();
    EXPECT_NE(c.to_string().find("owner_reduce=on"), std::string::npos) << c.to_string();
  }
}

// auto: on with a quantised combine wire (the combine sends after FC2 anyway), off with bf16 (the
// routed FC2 writes the per-slot rows itself) and with the in-kernel reduce; on / off as set.
TEST(Validation, OwnerReduceResolves) {
  MoeConfig c;
  EXPECT_EQ(c.owner_reduce, OwnerReduce::kAuto);
  const struct {
    OwnerReduce mode;
    CombineDtype wire;
    bool in_kernel;
    bool uses;
  } table[] = {{OwnerReduce::kAuto, CombineDtype::kBf16, false, false},
               {OwnerReduce::kAuto, CombineDtype::kMxfp8, false, true},
               {OwnerReduce::kAuto, CombineDtype::kNvfp4, false, true},
               {OwnerReduce::kAuto, CombineDtype::kBf16, true, false},
               {OwnerReduce::kOn, CombineDtype::kBf16, false, true},
               {OwnerReduce::kOff, CombineDtype::kMxfp8, false, false},
               {OwnerReduce::kOff, CombineDtype::kBf16, true, false}};
  for (const auto& row : table) {
    c.owner_reduce = row.mode;
    c.combine_dtype = row.wire;
    c.in_kernel_fc2_reduce = row.in_kernel;
    EXPECT_EQ(c.uses_owner_reduce(), row.uses) << c.to_string();
    EXPECT_TRUE(c.validate(good_geometry()).is_ok()) << c.to_string();
  }
  OwnerReduce parsed;
  EXPECT_TRUE(parse_owner_reduce("on", &parsed).is_ok());
  EXPECT_EQ(parsed, OwnerReduce::kOn);
  const Status st = parse_owner_reduce("yes", &parsed);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("yes"), std::string::npos) << st.message();
}

TEST(Validation, PaddedGeometryIsValid) {
  MoeGeometry g = good_geometry();
  g.hidden = 2880;
  g.intermediate = 2880;
  EXPECT_FALSE(g.validate().is_ok());
  MoeGeometry p = g.padded();
  EXPECT_EQ(p.hidden, 2944);
  EXPECT_EQ(p.intermediate, 2944);
  EXPECT_TRUE(p.validate().is_ok());
}

TEST(Validation, PrintersNameEveryField) {
  MoeGeometry g = good_geometry();
  EXPECT_EQ(g.to_string(),
            "MoeGeometry(hidden=256, intermediate=128, num_experts=8, top_k=2, ep_size=2, ep_rank=1, "
            "max_tokens_per_rank=16)");
  MoeConfig c;
  EXPECT_NE(c.to_string().find("combine_dtype=bf16"), std::string::npos);
  EXPECT_NE(c.to_string().find("weight_format=fp8-block"), std::string::npos);
  EXPECT_NE(c.to_string().find("owner_reduce=auto"), std::string::npos);
}

TEST(Validation, ParsersNameAcceptedValues) {
  Backend b;
  Status st = parse_backend("fast", &b);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("backend='fast'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("auto, mega, routed, cpu"), std::string::npos) << st.message();
  WeightFormat w;
  EXPECT_TRUE(parse_weight_format("nvfp4", &w).is_ok());
  EXPECT_EQ(w, WeightFormat::kNvfp4);
  EXPECT_TRUE(parse_weight_format("mxfp4", &w).is_ok());
  EXPECT_EQ(w, WeightFormat::kMxfp4);
  st = parse_weight_format("fp4", &w);
  EXPECT_NE(st.message().find("bf16, fp8-block, mxfp8, nvfp4, mxfp4"), std::string::npos) << st.message();
  CombineDtype d;
  EXPECT_FALSE(parse_combine_dtype("fp8", &d).is_ok());
}

// ---- forward() arguments ----

struct ForwardArgs {
  std::vector<uint16_t> x;
  std::vector<float> x_scale;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint16_t> y;
  TensorView vx, vscale, vids, vweights, vy;
  ForwardArgs(const MoeGeometry& g, int64_t t)
      : x(t * g.hidden, 0x3f80), ids(t * g.top_k, 1), weights(t * g.top_k, 0.5f), y(t * g.hidden) {
    vx = TensorView(x.data(), DType::kBFloat16, {t, g.hidden});
    vids = TensorView(ids.data(), DType::kInt32, {t, g.top_k});
    vweights = TensorView(weights.data(), DType::kFloat32, {t, g.top_k});
    vy = TensorView(y.data(), DType::kBFloat16, {t, g.hidden});
  }
};

struct BadForwardCase {
  const char* name;
  std::function<void(ForwardArgs&)> mutate;
  std::vector<std::string> expected;
};

class BadForward : public ::testing::TestWithParam<BadForwardCase> {};

TEST_P(BadForward, RefusedWithNamedArgument) {
  MoeGeometry g = good_geometry();
  MoeConfig c;
  ForwardArgs a(g, 4);
  ASSERT_TRUE(validate_forward_args(g, c, Device::cpu(), a.vx, a.vscale, a.vids, a.vweights, a.vy).is_ok());
  GetParam().mutate(a);
  Status st = validate_forward_args(g, c, Device::cpu(), a.vx, a.vscale, a.vids, a.vweights, a.vy);
  ASSERT_FALSE(st.is_ok()) << GetParam().name;
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  for (const auto& s : GetParam().expected) EXPECT_NE(st.message().find(s), std::string::npos)
      << "message '" << st.message() << "' lacks '" << s << "'";
}

const BadForwardCase kBadForwards[] = {
    {"tokens_above_bound",
     [](ForwardArgs& a) {
       a.x.resize(17 * 256);
       a.vx = TensorView(a.x.data(), DType::kBFloat16, {17, 256});
     },
     {"x.shape[0]=17", "max_tokens_per_rank=16"}},
    {"x_wrong_hidden", [](ForwardArgs& a) { a.vx.shape[1] = 128; a.vx.strides[0] = 128; }, {"x.shape[1]=128", "hidden=256"}},
    {"x_wrong_dtype", [](ForwardArgs& a) { a.vx.dtype = DType::kFloat32; }, {"x.dtype=float32", "bfloat16 or float8_e4m3"}},
    {"x_1d", [](ForwardArgs& a) { a.vx.ndim = 1; }, {"x.ndim=1", "must be 2"}},
    {"fp8_x_without_scale", [](ForwardArgs& a) { a.vx.dtype = DType::kFloat8E4M3; }, {"x_scale=absent", "hidden/128"}},
    {"bf16_x_with_scale",
     [](ForwardArgs& a) {
       a.x_scale.assign(8, 1.f);
       a.vscale = TensorView(a.x_scale.data(), DType::kFloat32, {4, 2});
     },
     {"x_scale=", "must be absent for a bfloat16 x"}},
    {"fp8_scale_wrong_shape",
     [](ForwardArgs& a) {
       a.vx.dtype = DType::kFloat8E4M3;
       a.x_scale.assign(4, 1.f);
       a.vscale = TensorView(a.x_scale.data(), DType::kFloat32, {4, 1});
     },
     {"x_scale.shape[1]=1", "hidden/128=2"}},
    {"ids_wrong_dtype", [](ForwardArgs& a) { a.vids.dtype = DType::kFloat32; },
     {"topk_ids.dtype=float32", "must be int32 or int64"}},
    {"ids_wrong_k", [](ForwardArgs& a) { a.vids.shape[1] = 3; a.vids.strides[0] = 3; }, {"topk_ids.shape[1]=3", "top_k=2"}},
    {"ids_wrong_rows", [](ForwardArgs& a) { a.vids.shape[0] = 3; }, {"topk_ids.shape[0]=3", "T=4"}},
    {"weights_wrong_dtype", [](ForwardArgs& a) { a.vweights.dtype = DType::kFloat16; },
     {"topk_weights.dtype=float16", "must be float32 or bfloat16"}},
    {"y_wrong_dtype", [](ForwardArgs& a) { a.vy.dtype = DType::kFloat32; }, {"y.dtype=float32", "bfloat16"}},
    {"y_wrong_rows", [](ForwardArgs& a) { a.vy.shape[0] = 2; }, {"y.shape[0]=2", "T=4"}},
    {"y_on_gpu", [](ForwardArgs& a) { a.vy.device = Device::cuda(0); }, {"y.device=cuda:0", "must be cpu"}},
    {"x_null", [](ForwardArgs& a) { a.vx.data = nullptr; }, {"x.data=null", "T > 0"}},
    {"y_non_contiguous", [](ForwardArgs& a) { a.vy.strides[0] = 512; }, {"y.strides=non-contiguous"}},
};

INSTANTIATE_TEST_SUITE_P(Validation, BadForward, ::testing::ValuesIn(kBadForwards),
                         [](const ::testing::TestParamInfo<BadForwardCase>& info) { return std::string(info.param.name); });

// A GPU backend's x and y must be 16-byte aligned (its kernels move 16 bytes at a time); the cpu
// backend takes any address. The views are never dereferenced here.
TEST(Validation, GpuBackendsNeedSixteenByteAlignedXAndY) {
  MoeGeometry g = good_geometry();
  ForwardArgs a(g, 4);
  alignas(16) static uint16_t device_like[2 * 4 * 256 + 8];
  const Device d = Device::cuda(0);
  auto on = [&](uint16_t* px, uint16_t* py) {
    TensorView x(px, DType::kBFloat16, {4, g.hidden}, d), y(py, DType::kBFloat16, {4, g.hidden}, d);
    TensorView ids(a.ids.data(), DType::kInt32, {4, g.top_k}, d), w(a.weights.data(), DType::kFloat32, {4, g.top_k}, d);
    return validate_forward_args(g, MoeConfig(), d, x, TensorView(), ids, w, y);
  };
  EXPECT_TRUE(on(device_like, device_like + 4 * 256).is_ok());
  for (const auto& [px, py, field] : {std::make_tuple(device_like + 1, device_like + 4 * 256, "x.data"),
                                      std::make_tuple(device_like, device_like + 4 * 256 + 4, "y.data")}) {
    const Status st = on(px, py);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("16-byte aligned"), std::string::npos) << st.message();
  }
  std::vector<uint16_t> host(4 * 256 + 1, 0x3f80);  // host: any address
  const TensorView hx(host.data() + 1, DType::kBFloat16, {4, g.hidden});
  EXPECT_TRUE(validate_forward_args(g, MoeConfig(), Device::cpu(), hx, a.vscale, a.vids, a.vweights, a.vy).is_ok());
}

TEST(Validation, ZeroTokensAreValid) {
  MoeGeometry g = good_geometry();
  MoeConfig c;
  ForwardArgs a(g, 0);
  EXPECT_TRUE(validate_forward_args(g, c, Device::cpu(), a.vx, a.vscale, a.vids, a.vweights, a.vy).is_ok());
}

// numpy and torch give empty arrays strides like (0, 0); a view with no element is contiguous.
TEST(Validation, EmptyViewsAreContiguousWhateverTheirStrides) {
  TensorView v(nullptr, DType::kBFloat16, {0, 256});
  v.strides = {0, 0};
  EXPECT_TRUE(v.is_contiguous());
  TensorView w(nullptr, DType::kBFloat16, {4, 256});
  w.strides = {0, 0};
  EXPECT_FALSE(w.is_contiguous());
  MoeGeometry g = good_geometry();
  ForwardArgs a(g, 0);
  a.vx.strides = {0, 0};
  a.vy.strides = {0, 0};
  EXPECT_TRUE(validate_forward_args(g, MoeConfig(), Device::cpu(), a.vx, a.vscale, a.vids, a.vweights, a.vy).is_ok());
}

}  // namespace
}  // namespace megamoe
