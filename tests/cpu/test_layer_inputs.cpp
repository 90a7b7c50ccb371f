// What forward() takes beyond int32 ids and fp32 weights, on the cpu backend (the semantics the GPU
// backends are held to): int64 ids, bf16 weights, config.output_scale, and the per-local-expert
// receive counts of set_expert_counts().
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "megamoe/formats.h"
#include "core/backends.h"
#include "megamoe/layer.h"
#include "reference/problem.h"

namespace megamoe {
namespace {

using reference::MoeProblem;

MoeGeometry geometry(int64_t max_tokens) {
  MoeGeometry g;
  g.hidden = 256, g.intermediate = 128, g.num_experts = 16, g.top_k = 4;
  g.ep_size = 1, g.max_tokens_per_rank = max_tokens;
  return g;
}

MoeConfig cpu_config(float output_scale = 1.0f) {
  MoeConfig c;
  c.backend = Backend::kCpu;
  c.weight_format = WeightFormat::kFp8Block;
  c.dispatch_format = DispatchFormat::kFp8Block;
  c.output_scale = output_scale;
  return c;
}

struct OneRank {
  std::unique_ptr<MoeLayer> layer;
  const MoeProblem* p = nullptr;

  static OneRank make(const MoeProblem& p, const MoeConfig& c) {
    OneRank r;
    r.p = &p;
    Status st = MoeLayer::create(p.geometry.for_rank(0), c, reference::local_weights(p, 0), nullptr, &r.layer);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return r;
  }

  Status forward(const TensorView& ids, const TensorView& weights, std::vector<uint16_t>* y) {
    const auto& in = p->ranks[0];
    const int64_t T = in.num_tokens, H = p->geometry.hidden;
    y->assign(static_cast<size_t>(T * H), 0xFFFF);
    TensorView x(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, H});
    return layer->forward(x, ids, weights, TensorView(y->data(), DType::kBFloat16, {T, H}));
  }
};

TEST(LayerInputs, Int64IdsAndBf16WeightsEqualInt32Fp32Bitwise_EP1) {
  MoeProblem p = reference::make_random_problem(geometry(32), 21, {29}, reference::Routing::kWithDropped);
  auto& in = p.ranks[0];
  const int64_t T = in.num_tokens, k = p.geometry.top_k;
  // fp32 weights that bf16 holds exactly, so both runs compute with the same values.
  std::vector<uint16_t> w_bf16(in.topk_weights.size());
  for (size_t i = 0; i < w_bf16.size(); ++i) {
    w_bf16[i] = fmt::float_to_bf16(in.topk_weights[i]);
    in.topk_weights[i] = fmt::bf16_to_float(w_bf16[i]);
  }
  std::vector<int64_t> ids64(in.topk_ids.begin(), in.topk_ids.end());
  OneRank run = OneRank::make(p, cpu_config());
  std::vector<uint16_t> want, got;
  const TensorView ids32(in.topk_ids.data(), DType::kInt32, {T, k}), w32(in.topk_weights.data(), DType::kFloat32, {T, k});
  ASSERT_TRUE(run.forward(ids32, w32, &want).is_ok());
  Status st = run.forward(TensorView(ids64.data(), DType::kInt64, {T, k}), w32, &got);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(got == want) << "int64 ids";
  st = run.forward(ids32, TensorView(w_bf16.data(), DType::kBFloat16, {T, k}), &got);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(got == want) << "bf16 weights";
  st = run.forward(TensorView(ids64.data(), DType::kInt64, {T, k}), TensorView(w_bf16.data(), DType::kBFloat16, {T, k}),
                   &got);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(got == want) << "both";
}

TEST(LayerInputs, Int64IdOutsideInt32IsRefusedAsABadId_EP1) {
  MoeProblem p = reference::make_random_problem(geometry(8), 22, {8});
  auto& in = p.ranks[0];
  std::vector<int64_t> ids64(in.topk_ids.begin(), in.topk_ids.end());
  ids64[6] = (int64_t{1} << 32) + 3;  // would alias expert 3 if truncated
  OneRank run = OneRank::make(p, cpu_config());
  std::vector<uint16_t> y;
  Status st = run.forward(TensorView(ids64.data(), DType::kInt64, {8, 4}),
                          TensorView(in.topk_weights.data(), DType::kFloat32, {8, 4}), &y);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("topk_ids[1, 2]=2147483647"), std::string::npos) << st.message();
}

// y with output_scale s is the forward with the weights fp32(s * w), bit for bit.
TEST(LayerInputs, OutputScaleEqualsPrescaledWeightsBitwise_EP1) {
  const float s = 2.5f;
  MoeProblem p = reference::make_random_problem(geometry(32), 23, {32});
  auto& in = p.ranks[0];
  const int64_t T = in.num_tokens, k = p.geometry.top_k;
  std::vector<float> prescaled(in.topk_weights.size());
  for (size_t i = 0; i < prescaled.size(); ++i) prescaled[i] = s * in.topk_weights[i];
  const TensorView ids(in.topk_ids.data(), DType::kInt32, {T, k});
  std::vector<uint16_t> scaled, want, unscaled;
  OneRank with_scale = OneRank::make(p, cpu_config(s));
  ASSERT_TRUE(with_scale.forward(ids, TensorView(in.topk_weights.data(), DType::kFloat32, {T, k}), &scaled).is_ok());
  OneRank plain = OneRank::make(p, cpu_config());
  ASSERT_TRUE(plain.forward(ids, TensorView(prescaled.data(), DType::kFloat32, {T, k}), &want).is_ok());
  EXPECT_TRUE(scaled == want);
  ASSERT_TRUE(plain.forward(ids, TensorView(in.topk_weights.data(), DType::kFloat32, {T, k}), &unscaled).is_ok());
  double num = 0, den = 0;  // and it is s times the unscaled output, to the roundings
  for (size_t i = 0; i < want.size(); ++i) {
    const double a = fmt::bf16_to_float(scaled[i]), b = s * fmt::bf16_to_float(unscaled[i]);
    num += (a - b) * (a - b);
    den += b * b;
  }
  EXPECT_LT(std::sqrt(num / den), 0.05);
  EXPECT_GT(den, 0);
}

TEST(LayerInputs, OutputScaleMustBeFinite) {
  MoeConfig c = cpu_config(std::numeric_limits<float>::quiet_NaN());
  Status st = c.validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("output_scale=nan, must be finite"), std::string::npos) << st.message();
  c.output_scale = 0.5f;
  EXPECT_TRUE(c.validate().is_ok());
  EXPECT_NE(c.to_string().find("output_scale=0.5"), std::string::npos) << c.to_string();
}

// The fused kernel applies the output scale itself (fp32(s * w) at placement, routed's product).
TEST(LayerInputs, MegaGateTakesAnOutputScale) {
  MoeConfig c = cpu_config(2.0f);
  EXPECT_TRUE(mega_format_gate(geometry(32), c).is_ok()) << mega_format_gate(geometry(32), c).to_string();
}

TEST(LayerInputs, ExpertCountsAccumulateReceivedRows_EP1) {
  MoeProblem p = reference::make_random_problem(geometry(32), 24, {31}, reference::Routing::kWithDropped);
  auto& in = p.ranks[0];
  const int64_t T = in.num_tokens, k = p.geometry.top_k, E = p.geometry.num_experts;
  std::vector<int64_t> truth(E, 0);
  for (int32_t e : in.topk_ids)
    if (e >= 0) ++truth[e];
  OneRank run = OneRank::make(p, cpu_config());
  std::vector<int64_t> counts64(E, 7);  // the layer adds to what is there
  std::vector<int32_t> counts32(E, 0);
  ASSERT_TRUE(run.layer->set_expert_counts(TensorView(counts64.data(), DType::kInt64, {E})).is_ok());
  const TensorView ids(in.topk_ids.data(), DType::kInt32, {T, k}), w(in.topk_weights.data(), DType::kFloat32, {T, k});
  std::vector<uint16_t> y;
  ASSERT_TRUE(run.forward(ids, w, &y).is_ok());
  ASSERT_TRUE(run.forward(ids, w, &y).is_ok());
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(counts64[e], 7 + 2 * truth[e]) << "expert " << e;
  ASSERT_TRUE(run.layer->set_expert_counts(TensorView(counts32.data(), DType::kInt32, {E})).is_ok());
  ASSERT_TRUE(run.forward(ids, w, &y).is_ok());
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(counts32[e], truth[e]) << "expert " << e;
  ASSERT_TRUE(run.layer->set_expert_counts(TensorView()).is_ok());  // stops counting
  ASSERT_TRUE(run.forward(ids, w, &y).is_ok());
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(counts32[e], truth[e]) << "expert " << e;

  Status st = run.layer->set_expert_counts(TensorView(counts64.data(), DType::kInt64, {E - 1}));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("must be [experts_per_rank=16]"), std::string::npos) << st.message();
  st = run.layer->set_expert_counts(TensorView(counts64.data(), DType::kFloat32, {E}));
  EXPECT_NE(st.message().find("counts.dtype=float32, must be int64 or int32"), std::string::npos) << st.message();
  st = run.layer->set_expert_counts(TensorView(counts64.data(), DType::kInt64, {E}, Device::cuda(0)));
  EXPECT_NE(st.message().find("counts.device=cuda:0, must be cpu"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe
