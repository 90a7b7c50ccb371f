// The cpu backend (reference semantics) against the plain fp64 reference, per format combination,
// plus the properties the GPU paths inherit: EP-size invariance, reproducibility, id checks.
//
// Error model for the rel-L2 bounds. The reference runs on the dequantised weights the layer used
// and on the bf16 x the layer got, so only the layer's own quantisation points (ep_protocol.h)
// contribute. Each is a relative RMS rounding error of random data (upper estimates: RNE error
// uniform in +-ulp/2 with ulp at its largest relative to the value):
//   bf16  eps_b  = 2^-8 / sqrt(3)   = 2.26e-3   (8-bit significand)
//   e4m3  eps_8  = 2^-4 / sqrt(3)   = 3.61e-2   (4-bit significand; fp8-block scales keep values normal)
//   mxfp8 eps_mx = 4.0e-2           (e4m3, plus the OCP rule's saturation of amax/X in (448, 512):
//                                    ~19% of blocks, one element of 32, up to 12.5% error)
//   nvfp4 eps_4  = 1.1e-1           (e2m1 on a Gaussian block of 16 scaled by amax/6: 0.094 with an
//                                    exact scale, plus the e4m3 rounding of the block scale)
// Errors compose in quadrature (independent): rel ~= sqrt((A*eps_x)^2 + eps_h^2 + eps_wire^2 + eps_y^2)
//   eps_x: dispatch quantisation of x (0 for bf16 dispatch of a bf16 x), amplified through SwiGLU by
//          A = sqrt(1 + E[silu'(g)^2] / E[silu(g)^2]) = 1.44 for g ~ N(0, 1) (taken as 1.5);
//   eps_h: the intermediate (e4m3 for the fp8-family weights, else bf16);
//   eps_wire: the combine wire; eps_y: the final bf16 rounding. With the in-kernel reduce the partial
//          is rounded to bf16 and each of the k adds rounds again: eps_wire^2 + eps_y^2 = (1 + k) eps_b^2.
//          With the owner reduce the wire rounds each owner's sum of partials once: the same eps_wire.
// Bound = 1.25 x the model (the epsilons are already upper estimates; measured/model ~ 0.7 expected).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "megamoe/formats.h"
#include "reference/cpu_backend.h"
#include "reference/group_runner.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe {
namespace {

using reference::MoeProblem;
using reference::Routing;

constexpr int64_t kH = 256, kI = 128, kE = 16, kK = 4;

constexpr double kEpsBf16 = 0.0039062500 / 1.7320508075688772;  // 2^-8 / sqrt(3)
constexpr double kEpsE4m3 = 0.0625 / 1.7320508075688772;        // 2^-4 / sqrt(3)
constexpr double kEpsMxfp8 = 0.040;
constexpr double kEpsNvfp4 = 0.110;
constexpr double kSwigluAmplification = 1.5;
constexpr double kBoundOverModel = 1.25;

MoeGeometry geometry(int64_t ep_size, int64_t max_tokens) {
  MoeGeometry g;
  g.hidden = kH, g.intermediate = kI, g.num_experts = kE, g.top_k = kK;
  g.ep_size = ep_size, g.max_tokens_per_rank = max_tokens;
  return g;
}

MoeConfig config(WeightFormat w, DispatchFormat d, CombineDtype c, bool pow2 = false, bool in_kernel = false) {
  MoeConfig cfg;
  cfg.backend = Backend::kCpu;
  cfg.weight_format = w;
  cfg.dispatch_format = d;
  cfg.combine_dtype = c;
  cfg.pow2_scales = pow2;
  cfg.in_kernel_fc2_reduce = in_kernel;
  cfg.owner_reduce = OwnerReduce::kOff;  // the per-slot combine (EP-invariant bits); with_owner_reduce() for the other
  return cfg;
}

MoeConfig with_owner_reduce(MoeConfig c) {
  c.owner_reduce = OwnerReduce::kOn;
  return c;
}

double model_rel_l2(const MoeConfig& c) {
  const double eps_x = c.dispatch_format == DispatchFormat::kFp8Block ? kEpsE4m3 : 0.0;
  const double eps_h = c.intermediate_format() == DispatchFormat::kFp8Block ? kEpsE4m3 : kEpsBf16;
  double tail2;  // wire + final rounding
  if (c.in_kernel_fc2_reduce) {
    tail2 = (1.0 + kK) * kEpsBf16 * kEpsBf16;
  } else {
    const double eps_wire = c.combine_dtype == CombineDtype::kMxfp8   ? kEpsMxfp8
                            : c.combine_dtype == CombineDtype::kNvfp4 ? kEpsNvfp4
                                                                      : kEpsBf16;
    tail2 = eps_wire * eps_wire + kEpsBf16 * kEpsBf16;
  }
  const double ax = kSwigluAmplification * eps_x;
  return std::sqrt(ax * ax + eps_h * eps_h + tail2);
}

bool has_nan(const std::vector<uint16_t>& y) {
  for (uint16_t v : y)
    if (std::isnan(fmt::bf16_to_float(v))) return true;
  return false;
}

// The measured error of every rank's output against reference_moe on the weights the layers used.
struct Measured {
  double rel_l2 = 0, max_abs = 0;
};
Measured measure(const MoeProblem& p, const reference::GroupRunner& runner, const std::vector<std::vector<uint16_t>>& y) {
  std::vector<float> w13, w2;
  for (int r = 0; r < runner.size(); ++r) {
    std::vector<float> a, b;
    runner.layer(r)->prepared_weights().w13.dequantize(&a);
    runner.layer(r)->prepared_weights().w2.dequantize(&b);
    w13.insert(w13.end(), a.begin(), a.end());
    w2.insert(w2.end(), b.begin(), b.end());
  }
  std::vector<float> got;
  std::vector<double> want;
  for (int r = 0; r < runner.size(); ++r) {
    const auto& in = p.ranks[r];
    std::vector<float> x(in.x_bf16.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = fmt::bf16_to_float(in.x_bf16[i]);
    std::vector<double> ref(in.num_tokens * kH);
    reference::reference_moe(p.geometry, in.num_tokens, x.data(), in.topk_ids.data(), in.topk_weights.data(),
                             w13.data(), w2.data(), ref.data());
    want.insert(want.end(), ref.begin(), ref.end());
    for (uint16_t v : y[r]) got.push_back(fmt::bf16_to_float(v));
  }
  return {reference::rel_l2(got.data(), want.data(), static_cast<int64_t>(got.size())),
          reference::max_abs_error(got.data(), want.data(), static_cast<int64_t>(got.size()))};
}

// ------------------------------------------------------------------------------------------------

struct FormatCase {
  const char* name;
  MoeConfig config;
};

class CpuVsReference : public testing::TestWithParam<FormatCase> {};

TEST_P(CpuVsReference, RelL2WithinTheModelBound_EP4) {
  const MoeConfig cfg = GetParam().config;
  const MoeProblem p = reference::make_random_problem(geometry(4, 64), 2024, {64, 0, 37, 11}, Routing::kWithDropped);
  std::unique_ptr<reference::GroupRunner> runner;
  Status st = reference::GroupRunner::create(p, cfg, &runner);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  std::vector<std::vector<uint16_t>> y;
  st = runner->forward_all(&y);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& v : y) ASSERT_FALSE(has_nan(v)) << "an output row was left poisoned";
  const Measured m = measure(p, *runner, y);
  const double model = model_rel_l2(cfg), bound = kBoundOverModel * model;
  std::printf("%-40s rel_l2 %.3e  max_abs %.3e  model %.3e  bound %.3e  (measured/model %.2f)\n", GetParam().name,
              m.rel_l2, m.max_abs, model, bound, m.rel_l2 / model);
  EXPECT_LT(m.rel_l2, bound);
  // A working quantised path never reproduces the fp64 result exactly.
  EXPECT_GT(m.rel_l2, 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CpuVsReference,
    testing::Values(
        FormatCase{"W_bf16_D_bf16_C_bf16", config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16)},
        FormatCase{"W_bf16_D_bf16_InKernelReduce",
                   config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16, false, true)},
        FormatCase{"W_bf16_D_fp8_C_bf16", config(WeightFormat::kBf16, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_bf16_C_bf16", config(WeightFormat::kFp8Block, DispatchFormat::kBf16, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_fp8_C_bf16",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_fp8_C_bf16_Pow2",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16, true)},
        FormatCase{"W_fp8_D_fp8_C_mxfp8",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kMxfp8)},
        FormatCase{"W_fp8_D_fp8_C_nvfp4",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kNvfp4)},
        FormatCase{"W_fp8_D_fp8_InKernelReduce",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16, false, true)},
        FormatCase{"W_mxfp8_D_fp8_C_bf16", config(WeightFormat::kMxfp8, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_nvfp4_D_fp8_C_bf16", config(WeightFormat::kNvfp4, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_mxfp4_D_fp8_C_bf16", config(WeightFormat::kMxfp4, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_nvfp4_D_fp8_C_nvfp4",
                   config(WeightFormat::kNvfp4, DispatchFormat::kFp8Block, CombineDtype::kNvfp4)},
        FormatCase{"W_bf16_D_bf16_C_bf16_OwnerReduce",
                   with_owner_reduce(config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16))},
        FormatCase{"W_fp8_D_fp8_C_bf16_OwnerReduce",
                   with_owner_reduce(config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16))},
        FormatCase{"W_fp8_D_fp8_C_mxfp8_OwnerReduce",
                   with_owner_reduce(config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kMxfp8))},
        FormatCase{"W_nvfp4_D_fp8_C_nvfp4_OwnerReduce",
                   with_owner_reduce(config(WeightFormat::kNvfp4, DispatchFormat::kFp8Block, CombineDtype::kNvfp4))}),
    [](const testing::TestParamInfo<FormatCase>& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------------------------------------

// The same tokens regrouped onto fewer ranks: rank n of the result holds ranks [n*f, (n+1)*f).
MoeProblem regroup(const MoeProblem& p, int64_t new_ep_size) {
  MoeProblem q;
  q.geometry = p.geometry;
  q.geometry.ep_size = new_ep_size;
  q.w13 = p.w13;
  q.w2 = p.w2;
  const int64_t f = p.geometry.ep_size / new_ep_size;
  int64_t t_max = 0;
  for (int64_t n = 0; n < new_ep_size; ++n) {
    reference::RankInputs merged;
    for (int64_t r = n * f; r < (n + 1) * f; ++r) {
      const auto& in = p.ranks[r];
      merged.num_tokens += in.num_tokens;
      merged.x_bf16.insert(merged.x_bf16.end(), in.x_bf16.begin(), in.x_bf16.end());
      merged.topk_ids.insert(merged.topk_ids.end(), in.topk_ids.begin(), in.topk_ids.end());
      merged.topk_weights.insert(merged.topk_weights.end(), in.topk_weights.begin(), in.topk_weights.end());
    }
    t_max = std::max(t_max, merged.num_tokens);
    q.ranks.push_back(std::move(merged));
  }
  q.geometry.max_tokens_per_rank = t_max;
  return q;
}

std::vector<uint16_t> flatten(const std::vector<std::vector<uint16_t>>& y) {
  std::vector<uint16_t> all;
  for (const auto& v : y) all.insert(all.end(), v.begin(), v.end());
  return all;
}

class EpInvariance : public testing::TestWithParam<FormatCase> {};

TEST_P(EpInvariance, EP1_EP2_EP4_BitwiseEqual) {
  const MoeConfig cfg = GetParam().config;
  const MoeProblem p4 = reference::make_random_problem(geometry(4, 16), 77, {16, 0, 13, 5}, Routing::kWithDropped);
  std::vector<uint16_t> outputs[3];
  int i = 0;
  for (int64_t ep : {4, 2, 1}) {
    const MoeProblem p = ep == 4 ? p4 : regroup(p4, ep);
    std::vector<std::vector<uint16_t>> y;
    Status st = reference::run_group(p, cfg, &y);
    ASSERT_TRUE(st.is_ok()) << "EP" << ep << ": " << st.to_string();
    outputs[i++] = flatten(y);
  }
  ASSERT_EQ(outputs[0].size(), static_cast<size_t>(34 * kH));
  ASSERT_FALSE(has_nan(outputs[0]));
  EXPECT_TRUE(outputs[0] == outputs[1]) << "EP4 vs EP2";
  EXPECT_TRUE(outputs[0] == outputs[2]) << "EP4 vs EP1";
}

INSTANTIATE_TEST_SUITE_P(
    Formats, EpInvariance,
    testing::Values(
        FormatCase{"W_fp8_D_fp8_C_bf16", config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_fp8_C_mxfp8_Pow2",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kMxfp8, true)},
        FormatCase{"W_nvfp4_D_fp8_C_nvfp4",
                   config(WeightFormat::kNvfp4, DispatchFormat::kFp8Block, CombineDtype::kNvfp4)},
        FormatCase{"W_bf16_D_bf16_C_bf16", config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16)}),
    [](const testing::TestParamInfo<FormatCase>& info) { return std::string(info.param.name); });

TEST(CpuBackend, RepeatedForwardsBitwiseEqual_ForwardBeforeWarmup_EP2) {
  const MoeProblem p = reference::make_random_problem(geometry(2, 32), 5, {32, 21});
  const MoeConfig cfg = config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kNvfp4);
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(p, cfg, &runner).is_ok());
  std::vector<std::vector<uint16_t>> first, again;
  // No warmup_all(): forward() warms up on every rank (CPU only).
  Status st = runner->forward_all(&first);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_FALSE(has_nan(flatten(first)));
  for (int i = 0; i < 3; ++i) {
    st = runner->forward_all(&again);  // y poisoned again before each run
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_TRUE(flatten(first) == flatten(again)) << "forward " << i + 2;
  }
  EXPECT_TRUE(runner->warmup_all().is_ok()) << "warmup() after the implicit one is a no-op";
  st = runner->forward_all(&again);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(flatten(first) == flatten(again));
}

// The expert FFN on 1, 2, 3 and 8 threads per rank: the same bits in y and in every rank's
// intermediate region (each pool row is computed by one thread in a fixed operation order). 64 and
// 50 tokens, top-4 with dropped slots, 8 local experts: ~19 rows per expert, so most experts span
// two work units (16 rows) and several row tiles (8 rows), with partial tiles.
class ExpertThreads : public testing::TestWithParam<FormatCase> {};

TEST_P(ExpertThreads, OneAndManyWorkersBitwiseEqual_EP2) {
  const MoeConfig cfg = GetParam().config;
  const MoeProblem p = reference::make_random_problem(geometry(2, 64), 404, {64, 50}, Routing::kWithDropped);
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(p, cfg, &runner).is_ok());
  std::vector<uint16_t> y_one_worker;
  std::vector<std::vector<uint8_t>> inter_one_worker(2);
  for (int workers : {1, 2, 3, 8}) {
    for (int r = 0; r < 2; ++r) dynamic_cast<CpuMoeLayer*>(runner->layer(r))->set_expert_workers_for_testing(workers);
    std::vector<std::vector<uint16_t>> y;
    Status st = runner->forward_all(&y);
    ASSERT_TRUE(st.is_ok()) << "workers=" << workers << ": " << st.to_string();
    ASSERT_FALSE(has_nan(flatten(y))) << "workers=" << workers;
    for (int r = 0; r < 2; ++r) {
      const auto* cpu = dynamic_cast<CpuMoeLayer*>(runner->layer(r));
      const WorkspaceLayout& l = cpu->layout();
      const uint8_t* inter = l.at<uint8_t>(cpu->workspace_base(), l.intermediate);
      std::vector<uint8_t> bytes(inter, inter + l.intermediate.bytes);
      if (workers == 1) {
        inter_one_worker[r] = std::move(bytes);
      } else {
        EXPECT_TRUE(bytes == inter_one_worker[r]) << "rank " << r << " intermediate, workers=" << workers << " vs 1";
      }
    }
    if (workers == 1) {
      y_one_worker = flatten(y);
    } else {
      EXPECT_TRUE(flatten(y) == y_one_worker) << "y, workers=" << workers << " vs 1";
    }
  }
  // The default again (fewer workers for a forward this small): still the same bits.
  for (int r = 0; r < 2; ++r) dynamic_cast<CpuMoeLayer*>(runner->layer(r))->set_expert_workers_for_testing(0);
  std::vector<std::vector<uint16_t>> y;
  ASSERT_TRUE(runner->forward_all(&y).is_ok());
  EXPECT_TRUE(flatten(y) == y_one_worker) << "y, default workers vs 1";
}

INSTANTIATE_TEST_SUITE_P(
    Formats, ExpertThreads,
    testing::Values(
        FormatCase{"W_fp8_D_fp8_C_bf16", config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_fp8_C_bf16_Pow2",
                   config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16, true)},
        FormatCase{"W_bf16_D_bf16_C_bf16", config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16)},
        FormatCase{"W_fp8_D_fp8_C_mxfp8_OwnerReduce",
                   with_owner_reduce(config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kMxfp8))}),
    [](const testing::TestParamInfo<FormatCase>& info) { return std::string(info.param.name); });

TEST(CpuBackend, DefaultExpertWorkersSplitTheCoresAmongRanks) {
  const int64_t hw = std::thread::hardware_concurrency();
  for (int64_t ep : {1, 2, 8, 64}) {
    const int want = static_cast<int>(std::clamp<int64_t>(hw / ep, 1, kMaxExpertWorkers));
    EXPECT_EQ(default_expert_workers(ep), want) << "ep_size=" << ep << ", hardware_concurrency=" << hw;
  }
  EXPECT_EQ(default_expert_workers(int64_t{1} << 20), 1) << "at least one worker";
  const MoeProblem p = reference::make_random_problem(geometry(2, 8), 3, {8, 8});
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(p, config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16),
                                             &runner).is_ok());
  auto* cpu = dynamic_cast<CpuMoeLayer*>(runner->layer(1));
  EXPECT_EQ(cpu->expert_workers(), default_expert_workers(2));
  cpu->set_expert_workers_for_testing(5);
  EXPECT_EQ(cpu->expert_workers(), 5);
  cpu->set_expert_workers_for_testing(0);
  EXPECT_EQ(cpu->expert_workers(), default_expert_workers(2));
}

TEST(CpuBackend, OutOfRangeIdNamesTokenSlotValue_PeersFailFast_EP2) {
  MoeProblem p = reference::make_random_problem(geometry(2, 16), 11, {16, 9});
  p.ranks[1].topk_ids[3 * kK + 2] = static_cast<int32_t>(kE);
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(p, config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16),
                                             &runner).is_ok());
  ASSERT_TRUE(runner->warmup_all().is_ok());
  runner->group()->set_wait_timeout_ms(60000);
  std::vector<std::vector<uint16_t>> y;
  std::vector<Status> st;
  const auto t0 = std::chrono::steady_clock::now();
  runner->forward_all(&y, &st);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(elapsed, 5.0) << "peers must not wait for the timeout";
  EXPECT_EQ(st[1].code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st[1].message().find("topk_ids[3, 2]=16"), std::string::npos) << st[1].message();
  EXPECT_NE(st[1].message().find("[-1, num_experts=16)"), std::string::npos) << st[1].message();
  EXPECT_FALSE(st[0].is_ok());
  EXPECT_NE(st[0].message().find("rank 1"), std::string::npos) << st[0].message();
  EXPECT_NE(st[0].message().find("topk_ids[3, 2]=16"), std::string::npos) << st[0].message();
  std::printf("bad rank: %s\npeer: %s\n", st[1].message().c_str(), st[0].message().c_str());
}

// R = 1 (null communicator): a single layer, driven directly.
struct SingleLayer {
  MoeProblem problem;
  std::unique_ptr<MoeLayer> layer;
  SingleLayer(const MoeConfig& cfg, int64_t tokens, Routing routing = Routing::kUniform) {
    problem = reference::make_random_problem(geometry(1, 32), 31, {tokens}, routing);
    Status st = MoeLayer::create(problem.geometry, cfg, reference::local_weights(problem, 0), nullptr, &layer);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  Status forward(const TensorView& x, std::vector<uint16_t>* y, const TensorView& x_scale = TensorView()) {
    auto& in = problem.ranks[0];
    const int64_t T = in.num_tokens;
    y->assign(T * kH, 0xFFFF);
    return layer->forward(x, TensorView(in.topk_ids.data(), DType::kInt32, {T, kK}),
                          TensorView(in.topk_weights.data(), DType::kFloat32, {T, kK}),
                          TensorView(y->data(), DType::kBFloat16, {T, kH}), nullptr, x_scale);
  }
  TensorView x_bf16() { return TensorView(problem.ranks[0].x_bf16.data(), DType::kBFloat16, {problem.ranks[0].num_tokens, kH}); }
};

TEST(CpuBackend, BadIdsAreRefusedByName_EP1) {
  SingleLayer s(config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16), 8);
  std::vector<uint16_t> y;
  s.problem.ranks[0].topk_ids[0 * kK + 1] = -2;
  Status st = s.forward(s.x_bf16(), &y);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("topk_ids[0, 1]=-2"), std::string::npos) << st.message();
  // Repeated expert within one token (would overflow the pool bound).
  s.problem.ranks[0].topk_ids[0 * kK + 1] = s.problem.ranks[0].topk_ids[0 * kK + 0];
  st = s.forward(s.x_bf16(), &y);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("repeats expert"), std::string::npos) << st.message();
  // Valid again: the layer still works (no group to abort at EP1).
  s.problem.ranks[0].topk_ids[0 * kK + 1] = -1;
  st = s.forward(s.x_bf16(), &y);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_FALSE(has_nan(y));
}

// The cpu backend reports every failure from forward() itself: error_pending() is false before and
// after a failed forward; after release() it and forward() are refused, naming the call.
TEST(CpuBackend, ErrorPendingIsFalse_RefusedAfterRelease_EP1) {
  SingleLayer s(config(WeightFormat::kBf16, DispatchFormat::kBf16, CombineDtype::kBf16), 8);
  bool pending = true;
  ASSERT_TRUE(s.layer->error_pending(&pending).is_ok());
  EXPECT_FALSE(pending) << "before warmup";
  std::vector<uint16_t> y;
  s.problem.ranks[0].topk_ids[0 * kK + 1] = -2;
  EXPECT_EQ(s.forward(s.x_bf16(), &y).code(), StatusCode::kInvalidArgument);
  pending = true;
  ASSERT_TRUE(s.layer->error_pending(&pending).is_ok());
  EXPECT_FALSE(pending) << "forward() reported the bad id itself";
  EXPECT_TRUE(s.layer->check_error(nullptr).is_ok());
  ASSERT_TRUE(s.layer->release().is_ok());
  pending = true;
  Status st = s.layer->error_pending(&pending);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("error_pending() after release()"), std::string::npos) << st.message();
  EXPECT_FALSE(pending);
  s.problem.ranks[0].topk_ids[0 * kK + 1] = -1;
  st = s.forward(s.x_bf16(), &y);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("forward() after release()"), std::string::npos) << st.message();
}

TEST(CpuBackend, Fp8InputPassesThroughAndBf16DispatchDequantises) {
  for (bool pow2 : {false, true}) {
    SingleLayer s(config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16, pow2), 32);
    const int64_t T = 32;
    std::vector<float> xf(T * kH), deq(T * kH);
    std::vector<uint8_t> q(T * kH);
    std::vector<float> scales(T * kH / 128);
    for (int64_t i = 0; i < T * kH; ++i) xf[i] = fmt::bf16_to_float(s.problem.ranks[0].x_bf16[i]);
    for (int64_t t = 0; t < T; ++t)
      fmt::quantize_fp8_1x128(xf.data() + t * kH, kH, q.data() + t * kH, scales.data() + t * (kH / 128), pow2);
    const TensorView xq(q.data(), DType::kFloat8E4M3, {T, kH});
    const TensorView xs(scales.data(), DType::kFloat32, {T, kH / 128});
    std::vector<uint16_t> y_bf16_in, y_fp8_in;
    ASSERT_TRUE(s.forward(s.x_bf16(), &y_bf16_in).is_ok());
    ASSERT_TRUE(s.forward(xq, &y_fp8_in, xs).is_ok());
    EXPECT_TRUE(y_bf16_in == y_fp8_in) << "pow2=" << pow2 << ": an e4m3 x quantised as the layer would must give the same bits";

    // bf16 dispatch of an e4m3 x: dequantise, round to bf16.
    SingleLayer b(config(WeightFormat::kFp8Block, DispatchFormat::kBf16, CombineDtype::kBf16), 32);
    std::vector<uint16_t> x_rounded(T * kH);
    for (int64_t t = 0; t < T; ++t) fmt::dequantize_fp8_1x128(q.data() + t * kH, scales.data() + t * (kH / 128), kH, deq.data() + t * kH);
    for (int64_t i = 0; i < T * kH; ++i) x_rounded[i] = fmt::float_to_bf16(deq[i]);
    std::vector<uint16_t> y_a, y_b;
    ASSERT_TRUE(b.forward(xq, &y_a, xs).is_ok());
    ASSERT_TRUE(b.forward(TensorView(x_rounded.data(), DType::kBFloat16, {T, kH}), &y_b).is_ok());
    EXPECT_TRUE(y_a == y_b);
    EXPECT_FALSE(has_nan(y_a));
  }
}

TEST(CpuBackend, ZeroTokensAndAllTokensToOneExpert_EP4) {
  const MoeProblem p = reference::make_random_problem(geometry(4, 32), 8, {0, 32, 0, 17}, Routing::kSingleExpert);
  const MoeConfig cfg = config(WeightFormat::kFp8Block, DispatchFormat::kFp8Block, CombineDtype::kBf16);
  std::unique_ptr<reference::GroupRunner> runner;
  ASSERT_TRUE(reference::GroupRunner::create(p, cfg, &runner).is_ok());
  std::vector<std::vector<uint16_t>> y;
  Status st = runner->forward_all(&y);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(y[0].empty() && y[2].empty());
  const Measured m = measure(p, *runner, y);
  std::printf("single expert, EP4: rel_l2 %.3e (bound %.3e)\n", m.rel_l2, kBoundOverModel * model_rel_l2(cfg));
  EXPECT_LT(m.rel_l2, kBoundOverModel * model_rel_l2(cfg));
  // Every token went to the last rank's last expert: its pool holds the 49 rows, unpadded.
  auto* last = dynamic_cast<CpuMoeLayer*>(runner->layer(3));
  ASSERT_NE(last, nullptr);
  const int32_t* offsets = last->layout().at<int32_t>(last->workspace_base(), last->layout().expert_offsets);
  EXPECT_EQ(offsets[kE / 4 - 1], 0);
  EXPECT_EQ(offsets[kE / 4], 49);
}

}  // namespace
}  // namespace megamoe
