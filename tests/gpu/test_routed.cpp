// Routed backend on H200s: against the cpu backend on the same inputs (same quantisation points),
// EP1 on one GPU, EP > 1 on one GPU per rank (NCCL, one process, one thread per rank) and on logical
// ranks sharing one GPU (create_shared_gpu_group). Skips without enough GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"
#include "gpu/layer_harness.h"

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/workspace.h"
#include "reference/error_model.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe {
namespace {

using reference::MoeProblem;
using reference::RankInputs;
using reference::Routing;

using gpu_test::cuda_device_count_or_zero;
using gpu_test::GroupKind;
using gpu_test::group_suffix;
using gpu_test::Harness;
using gpu_test::L2Sums;
using gpu_test::rel_l2_bf16;

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

MoeGeometry geometry(int64_t H, int64_t I, int64_t E, int64_t k, int64_t R, int64_t T) {
  MoeGeometry g;
  g.hidden = H;
  g.intermediate = I;
  g.num_experts = E;
  g.top_k = k;
  g.ep_size = R;
  g.max_tokens_per_rank = T;
  return g;
}

void expect_close(const std::vector<std::vector<uint16_t>>& y_gpu, const std::vector<std::vector<uint16_t>>& y_cpu,
                  CombineDtype combine, const char* what) {
  const reference::ErrorBound bound = reference::same_points_bound(combine);
  for (size_t r = 0; r < y_gpu.size(); ++r) {
    ASSERT_EQ(y_gpu[r].size(), y_cpu[r].size());
    if (y_gpu[r].empty()) continue;
    const double err = rel_l2_bf16(y_gpu[r], y_cpu[r]);
    std::printf("[routed] %s rank %zu: rel-L2 vs cpu backend = %.3e (bound %.2e: %s)\n", what, r, err, bound.rel_l2,
                bound.derivation.c_str());
    EXPECT_LE(err, bound.rel_l2) << what << " rank " << r;
  }
}

struct RoutedCase {
  const char* name;
  int64_t H, I, E, k, R, T;
  Routing routing;
  bool bf16;
  CombineDtype combine;
  OwnerReduce owner_reduce = OwnerReduce::kOff;  // MoeConfig::owner_reduce
  GroupKind group = GroupKind::kNcclGpus;        // EP > 1: one GPU per rank, or R ranks on one GPU
  std::string test_name() const { return std::string(name) + (R > 1 ? std::string("_") + group_suffix(group) : ""); }
};

// Every case; those with R > 1 both on R GPUs and on R logical ranks of one GPU.
std::vector<RoutedCase> on_both_groups(std::vector<RoutedCase> cases) {
  std::vector<RoutedCase> out;
  for (const RoutedCase& c : cases) {
    out.push_back(c);
    if (c.R > 1 && c.group == GroupKind::kNcclGpus) {
      RoutedCase shared = c;
      shared.group = GroupKind::kSharedGpu;
      out.push_back(shared);
    }
  }
  return out;
}

class Sm90Routed : public ::testing::TestWithParam<RoutedCase> {};

TEST_P(Sm90Routed, MatchesCpuBackendAndIsDeterministic) {
  const RoutedCase& p = GetParam();
  MEGAMOE_REQUIRE_SM90_GPUS(p.group == GroupKind::kSharedGpu ? 1 : p.R);
  std::vector<int64_t> tokens(p.R, p.T);
  if (p.R > 1) tokens[0] = 0;  // a rank with no tokens still takes part
  if (p.R > 1) tokens[1] = p.T;  // T = max_tokens_per_rank
  MoeProblem problem = reference::make_random_problem(geometry(p.H, p.I, p.E, p.k, p.R, p.T), 1234, tokens, p.routing);
  MoeConfig c;
  c.combine_dtype = p.combine;
  c.owner_reduce = p.owner_reduce;
  if (p.bf16) {
    c.weight_format = WeightFormat::kBf16;
    c.dispatch_format = DispatchFormat::kBf16;
  }
  Harness h(problem, c, p.group);
  ASSERT_TRUE(h.build());
  std::vector<std::vector<uint16_t>> y_gpu, y_cpu, y_again, y_graph, unused;
  ASSERT_TRUE(h.run(problem.ranks, &y_gpu, &y_cpu));
  expect_close(y_gpu, y_cpu, p.combine, p.test_name().c_str());
  ASSERT_TRUE(h.run(problem.ranks, &y_again, &unused));
  EXPECT_EQ(y_gpu, y_again) << "repeated forwards differ: a race";
  ASSERT_TRUE(h.run(problem.ranks, &y_graph, &unused, /*graph=*/true));
  EXPECT_EQ(y_gpu, y_graph) << "CUDA-graph replay differs from eager";
  // The float64 unquantised reference, reported (the bound above is against the cpu backend).
  for (int r = 0; r < p.R; ++r) {
    const RankInputs& in = problem.ranks[r];
    if (in.num_tokens == 0) continue;
    std::vector<float> x(in.x_bf16.size()), y(y_gpu[r].size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = fmt::bf16_to_float(in.x_bf16[i]);
    for (size_t i = 0; i < y.size(); ++i) y[i] = fmt::bf16_to_float(y_gpu[r][i]);
    std::vector<double> ref(y.size());
    reference::reference_moe(problem.geometry, in.num_tokens, x.data(), in.topk_ids.data(), in.topk_weights.data(),
                             problem.w13.data(), problem.w2.data(), ref.data());
    std::printf("[routed] %s rank %d: rel-L2 vs float64 unquantised reference = %.3e\n", p.test_name().c_str(), r,
                reference::rel_l2(y.data(), ref.data(), static_cast<int64_t>(y.size())));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, Sm90Routed,
    ::testing::ValuesIn(on_both_groups({RoutedCase{"Fp8_EP1_Tiny_T64", 512, 256, 16, 4, 1, 64, Routing::kUniform, false, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_Qwen3_30B_T96", 2048, 768, 128, 8, 1, 96, Routing::kWithDropped, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_DeepSeekV3Dims_E16_T8", 7168, 2048, 16, 8, 1, 8, Routing::kUniform, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Bf16_EP1_Tiny_T33", 512, 256, 16, 4, 1, 33, Routing::kUniform, true, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_SingleExpert_T100", 512, 256, 16, 4, 1, 100, Routing::kSingleExpert, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP2_Tiny_T64", 512, 256, 16, 4, 2, 64, Routing::kUniform, false, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP2_Qwen3_30B_T64_Mxfp8Wire", 2048, 768, 128, 8, 2, 64, Routing::kWithDropped, false,
                                 CombineDtype::kMxfp8},
                      RoutedCase{"Fp8_EP2_DeepSeekV3Dims_E16_T8", 7168, 2048, 16, 8, 2, 8, Routing::kUniform, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP2_SingleExpert_T64", 512, 256, 16, 4, 2, 64, Routing::kSingleExpert, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_Tiny_T64_OwnerReduce", 512, 256, 16, 4, 1, 64, Routing::kUniform, false,
                                 CombineDtype::kBf16, OwnerReduce::kOn},
                      RoutedCase{"Fp8_EP2_Qwen3_30B_T64_OwnerReduce", 2048, 768, 128, 8, 2, 64, Routing::kWithDropped,
                                 false, CombineDtype::kBf16, OwnerReduce::kOn},
                      RoutedCase{"Fp8_EP2_DeepSeekV3Dims_E16_T8_OwnerReduce_Mxfp8Wire", 7168, 2048, 16, 8, 2, 8,
                                 Routing::kUniform, false, CombineDtype::kMxfp8, OwnerReduce::kAuto},
                      // EP4 on logical ranks of one GPU (and on 4 GPUs where there are 4)
                      RoutedCase{"Fp8_EP4_Tiny_T48", 512, 256, 16, 4, 4, 48, Routing::kWithDropped, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP4_Qwen3_30B_T32_Nvfp4Wire", 2048, 768, 128, 8, 4, 32, Routing::kUniform, false,
                                 CombineDtype::kNvfp4},
                      RoutedCase{"Bf16_EP4_Tiny_T40_OwnerReduce", 512, 256, 16, 4, 4, 40, Routing::kUniform, true,
                                 CombineDtype::kBf16, OwnerReduce::kOn}})),
    [](const ::testing::TestParamInfo<RoutedCase>& info) { return info.param.test_name(); });

// Layers of one geometry share one symmetric workspace (EP1 layers built without a communicator
// share their device's one-rank group, so their pool keys match).
TEST(Sm90RoutedWorkspace, Ep1LayersOfOneGeometryShareOneWorkspace) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, 1, 32), 5, {32});
  MoeConfig c;
  c.backend = Backend::kRouted;
  const int64_t before = WorkspacePool::global().num_live();
  std::unique_ptr<MoeLayer> a, b;
  ASSERT_TRUE(MoeLayer::create(problem.geometry, c, reference::local_weights(problem, 0), nullptr, &a).is_ok());
  ASSERT_TRUE(MoeLayer::create(problem.geometry, c, reference::local_weights(problem, 0), nullptr, &b).is_ok());
  ASSERT_TRUE(a->warmup().is_ok());
  ASSERT_TRUE(b->warmup().is_ok());
  EXPECT_EQ(WorkspacePool::global().num_live(), before + 1);
}

// 1000 forwards with a random T per rank (0..max) and random routing, each output checked against
// the cpu backend; no hang (every wait is bounded). Each forward must lie within the quantisation
// error model's bound of the cpu backend (a race, a lost slot or a stale row fails it); the
// same-points bound applies to the rel-L2 pooled over all forwards: one forward of a few tokens
// holds only a few requantised codes that differ, too few for its own rel-L2 to be that estimate.
TEST(Sm90RoutedSoak, Fp8_EP2_Tiny_1000RandomForwards) {
  const int R = 2;  // on two GPUs where there are two, else two logical ranks of one
  const GroupKind kind = cuda_device_count_or_zero() >= 2 ? GroupKind::kNcclGpus : GroupKind::kSharedGpu;
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const int64_t T_max = 48, H = 512, k = 4, E = 16;
  MoeProblem problem = reference::make_random_problem(geometry(H, 256, E, k, R, T_max), 99,
                                                      std::vector<int64_t>(R, T_max));
  const double per_forward_bound = reference::error_bound(MoeConfig{}, k).rel_l2;
  L2Sums pooled;
  Harness h(problem, MoeConfig{}, kind);
  ASSERT_TRUE(h.build());
  std::mt19937_64 rng(7);
  double worst = 0;
  for (int it = 0; it < 1000; ++it) {
    std::vector<RankInputs> in(R);
    for (int r = 0; r < R; ++r) {
      const int64_t T = static_cast<int64_t>(rng() % (T_max + 1));
      in[r].num_tokens = T;
      in[r].x_bf16.assign(problem.ranks[r].x_bf16.begin(), problem.ranks[r].x_bf16.begin() + T * H);
      in[r].topk_ids.resize(T * k);
      in[r].topk_weights.resize(T * k);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> perm(E);
        for (int e = 0; e < E; ++e) perm[e] = e;
        for (int64_t j = 0; j < k; ++j) {
          std::swap(perm[j], perm[j + rng() % (E - j)]);
          in[r].topk_ids[t * k + j] = (rng() % 8 == 0) ? -1 : perm[j];
          in[r].topk_weights[t * k + j] = 0.05f + static_cast<float>(rng() % 1000) / 1000.f;
        }
      }
    }
    std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
    ASSERT_TRUE(h.run(in, &y_gpu, &y_cpu)) << "iteration " << it;
    for (int r = 0; r < R; ++r) {
      if (y_gpu[r].empty()) continue;
      const double err = rel_l2_bf16(y_gpu[r], y_cpu[r]);
      worst = std::max(worst, err);
      ASSERT_LE(err, per_forward_bound) << "iteration " << it << " rank " << r;
      pooled.add(y_gpu[r], y_cpu[r]);
    }
  }
  std::printf("[routed] 1000 random forwards, EP%d: rel-L2 vs cpu backend pooled %.3e (bound %.1e), worst forward "
              "%.3e (bound %.3e)\n", R, pooled.rel(), reference::kSamePointsRelL2, worst, per_forward_bound);
  EXPECT_LE(pooled.rel(), reference::kSamePointsRelL2);
}

}  // namespace
}  // namespace megamoe
