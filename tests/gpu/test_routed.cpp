// Routed backend on H200s: against the cpu backend on the same inputs (same quantisation points),
// EP1 on one GPU, EP > 1 on one GPU per rank (NCCL, one process, one thread per rank) and on logical
// ranks sharing one GPU (create_shared_gpu_group). Skips without enough GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"
#include "gpu/layer_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "core/env.h"
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

// One forward per rank of `hidden`-wide rows against the cpu backend, within the one-forward
// same-points bound of its token count.
void expect_close(const std::vector<std::vector<uint16_t>>& y_gpu, const std::vector<std::vector<uint16_t>>& y_cpu,
                  CombineDtype combine, const char* what, int64_t hidden) {
  for (size_t r = 0; r < y_gpu.size(); ++r) {
    ASSERT_EQ(y_gpu[r].size(), y_cpu[r].size());
    if (y_gpu[r].empty()) continue;
    const int64_t tokens = static_cast<int64_t>(y_gpu[r].size()) / hidden;
    const reference::ErrorBound bound = reference::same_points_bound_one_forward(combine, tokens);
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
  expect_close(y_gpu, y_cpu, p.combine, p.test_name().c_str(), p.H);
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
                      // top-2 / top-6 at odd max_tokens_per_rank: pools of 2 and 198 pairs (not multiples
                      // of 4) were refused at warmup before the pool rows were rounded up
                      RoutedCase{"Fp8_EP1_Top2_T1", 512, 256, 8, 2, 1, 1, Routing::kUniform, false, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_Top6_T33", 512, 256, 32, 6, 1, 33, Routing::kWithDropped, false,
                                 CombineDtype::kBf16},
                      RoutedCase{"Bf16_EP1_Top6_T33", 512, 256, 32, 6, 1, 33, Routing::kUniform, true, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP1_Top6_T33_Mxfp8Wire", 512, 256, 32, 6, 1, 33, Routing::kUniform, false,
                                 CombineDtype::kMxfp8},
                      RoutedCase{"Fp8_EP2_Top2_T1", 512, 256, 8, 2, 2, 1, Routing::kUniform, false, CombineDtype::kBf16},
                      RoutedCase{"Fp8_EP2_Top6_T33", 512, 256, 32, 6, 2, 33, Routing::kWithDropped, false,
                                 CombineDtype::kBf16},
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

// The design's main claim: layers of one geometry share one workspace (one per rank) and run one
// after another on one stream, each with its own weights; alternating forwards, each against its
// cpu twin.
void alternate_two_layers(GroupKind kind, int R) {
  const MoeGeometry g = geometry(512, 256, 16, 4, R, 48);
  std::vector<int64_t> tokens(R, 48);
  tokens[0] = 17;
  MoeProblem a = reference::make_random_problem(g, 101, tokens), b = reference::make_random_problem(g, 202, tokens);
  const int64_t before = WorkspacePool::global().num_live();
  Harness h(a, MoeConfig{}, kind, Backend::kRouted, {&b});
  ASSERT_TRUE(h.build());
  EXPECT_EQ(WorkspacePool::global().num_live(), before + 2 * R)  // gpu + cpu: one workspace each per rank
      << "layers of one geometry must share one workspace per rank";
  std::vector<std::vector<uint16_t>> ya0, yb0;
  for (int it = 0; it < 6; ++it) {
    const int layer = it % 2;
    const MoeProblem& p = layer == 0 ? a : b;
    std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
    ASSERT_TRUE(h.run(p.ranks, &y_gpu, &y_cpu, /*graph=*/false, layer)) << "iteration " << it;
    expect_close(y_gpu, y_cpu, CombineDtype::kBf16, layer == 0 ? "shared workspace, layer A" : "shared workspace, layer B",
                 g.hidden);
    std::vector<std::vector<uint16_t>>& first = layer == 0 ? ya0 : yb0;
    if (first.empty()) first = y_gpu;
    else EXPECT_EQ(y_gpu, first) << "layer " << layer << " iteration " << it << ": the other layer's forward leaked in";
  }
  EXPECT_NE(ya0, yb0);  // different weights
}

TEST(Sm90RoutedSharing, TwoLayersSharingAWorkspaceAlternateOnOneStream_EP1) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  alternate_two_layers(GroupKind::kNcclGpus, 1);
}

TEST(Sm90RoutedSharing, TwoLayersSharingAWorkspaceAlternateOnOneStream_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  alternate_two_layers(GroupKind::kSharedGpu, 2);
}

// The tile bucket from the rows received (MEGAMOE_TILE_BUCKET=received): a rank with T = 0 (and one
// with T = 1) receiving a full pool from its peer runs the pool's tiles, chosen on the device, and
// gets the cpu backend's results; the peer (T = T_max) runs one launch per GEMM as before.
TEST(Sm90RoutedTileBucket, RanksWithFewTokensReceivingAFullPool_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  setenv("MEGAMOE_TILE_BUCKET", "received", 1);
  reload_env_knobs();
  for (int64_t t0 : {0, 1}) {
    const MoeGeometry g = geometry(2048, 768, 32, 8, 2, 512);
    MoeProblem problem = reference::make_random_problem(g, 77 + t0, {t0, 512});
    Harness h(problem, MoeConfig{}, GroupKind::kSharedGpu);
    ASSERT_TRUE(h.build());
    for (int it = 0; it < 3; ++it) {
      std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
      ASSERT_TRUE(h.run(problem.ranks, &y_gpu, &y_cpu, /*graph=*/it == 2));
      expect_close(y_gpu, y_cpu, CombineDtype::kBf16, t0 == 0 ? "T=0 rank, received bucket" : "T=1 rank, received bucket",
                   g.hidden);
    }
  }
  unsetenv("MEGAMOE_TILE_BUCKET");
  reload_env_knobs();
}

// release() is collective and bounded; afterwards forwards are refused, and a new group works.
TEST(Sm90RoutedRelease, ReleaseThenForwardIsRefusedAndANewGroupWorks_EP2_SharedGpu) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const MoeGeometry g = geometry(512, 256, 16, 4, 2, 32);
  MoeProblem problem = reference::make_random_problem(g, 9, {32, 20});
  {
    Harness h(problem, MoeConfig{}, GroupKind::kSharedGpu);
    ASSERT_TRUE(h.build());
    std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
    ASSERT_TRUE(h.run(problem.ranks, &y_gpu, &y_cpu));
    ASSERT_TRUE(h.release_all());
    ASSERT_TRUE(h.release_all());  // idempotent
    const Status st = h.gpu_layer(0)->forward(TensorView(), TensorView(), TensorView(), TensorView());
    EXPECT_FALSE(st.is_ok());
  }
  Harness again(problem, MoeConfig{}, GroupKind::kSharedGpu);
  ASSERT_TRUE(again.build());
  std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
  ASSERT_TRUE(again.run(problem.ranks, &y_gpu, &y_cpu));
  expect_close(y_gpu, y_cpu, CombineDtype::kBf16, "after a released group", g.hidden);
}

// The soak: random forwards of a GPU backend against the cpu backend (random T per rank in
// 0..T_max, random routing with -1 slots, skewed and single-expert steps, every combine wire; EP1 and
// EP2). Each forward must lie within the quantisation error model's bound of the cpu backend (a race,
// a lost slot or a stale row fails it); the same-points bound applies to the rel-L2 pooled over all
// forwards of a wire (one forward of a few tokens holds too few differing codes for its own rel-L2 to
// be that estimate). MEGAMOE_SOAK_FORWARDS (default 600) forwards per case, split over the wires;
// `scripts/device.sh soak` runs 10 000. A backend is named by its string, so the mega backend joins by
// adding its name to the cases.
struct SoakCase {
  const char* backend;  // "routed" (later "mega")
  int R;
  GroupKind group;
};

class Sm90Soak : public ::testing::TestWithParam<SoakCase> {};

// Distinct ids per token (a repeat is bad input); mode 0 uniform, 1 skewed (a hot expert takes most
// slots 0), 2 every token's first slot on one expert.
void random_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E, int mode, RankInputs* in) {
  in->topk_ids.assign(T * k, -1);
  in->topk_weights.assign(T * k, 0.f);
  const int64_t hot = static_cast<int64_t>(rng() % E);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int64_t j = 0; j < k; ++j) {
      std::swap(perm[j], perm[j + rng() % (E - j)]);
      int32_t id = perm[j];
      if (j == 0 && (mode == 2 || (mode == 1 && rng() % 4 != 0))) {
        for (int64_t jj = 1; jj < E; ++jj)
          if (perm[jj] == hot) std::swap(perm[0], perm[jj]);
        id = perm[0] = static_cast<int32_t>(hot);
      }
      in->topk_ids[t * k + j] = (rng() % 8 == 0 && !(mode == 2 && j == 0)) ? -1 : id;
      in->topk_weights[t * k + j] = 0.05f + static_cast<float>(rng() % 1000) / 1000.f;
    }
  }
}

TEST_P(Sm90Soak, RandomForwardsMatchTheCpuBackend) {
  const SoakCase& p = GetParam();
  MEGAMOE_REQUIRE_SM90_GPUS(p.group == GroupKind::kSharedGpu ? 1 : p.R);
  const std::string backend(p.backend);
  const Backend gpu_backend = backend == "mega" ? Backend::kMega : Backend::kRouted;
  if (backend != "routed" && backend != "mega") GTEST_SKIP() << "no backend named " << backend;
  int64_t forwards = 600;
  if (const char* v = std::getenv("MEGAMOE_SOAK_FORWARDS"); v && *v) forwards = std::max<int64_t>(3, std::atoll(v));
  const int R = p.R;
  const int64_t T_max = 48, H = 512, k = 4, E = 16;
  const CombineDtype wires[] = {CombineDtype::kBf16, CombineDtype::kMxfp8, CombineDtype::kNvfp4};
  int64_t total = 0, outputs = 0;
  double worst_overall = 0;
  for (CombineDtype wire : wires) {
    MoeProblem problem = reference::make_random_problem(geometry(H, 256, E, k, R, T_max), 99 + static_cast<int>(wire),
                                                        std::vector<int64_t>(R, T_max));
    MoeConfig c;
    c.combine_dtype = wire;
    c.backend = gpu_backend;
    const Status gate = gpu_backend == Backend::kMega ? mega_capability(problem.geometry, c)
                                                      : routed_capability(problem.geometry, c);
    if (!gate.is_ok()) {
      std::printf("[soak] backend=%s wire=%s skipped: %s\n", p.backend, to_string(wire), gate.message().c_str());
      continue;
    }
    const double per_forward_bound = reference::error_bound(c, k).rel_l2;
    const double pooled_bound = reference::same_points_bound(wire).rel_l2;
    L2Sums pooled;
    Harness h(problem, c, p.group, gpu_backend);
    ASSERT_TRUE(h.build());
    std::mt19937_64 rng(7 + static_cast<int>(wire));
    double worst = 0;
    const int64_t n = forwards / 3;
    for (int64_t it = 0; it < n; ++it) {
      std::vector<RankInputs> in(R);
      const int mode = static_cast<int>(rng() % 10) < 6 ? 0 : (rng() % 3 != 0 ? 1 : 2);
      for (int r = 0; r < R; ++r) {
        const int64_t T = static_cast<int64_t>(rng() % (T_max + 1));
        in[r].num_tokens = T;
        in[r].x_bf16.assign(problem.ranks[r].x_bf16.begin(), problem.ranks[r].x_bf16.begin() + T * H);
        random_routing(rng, T, k, E, mode, &in[r]);
      }
      std::vector<std::vector<uint16_t>> y_gpu, y_cpu;
      ASSERT_TRUE(h.run(in, &y_gpu, &y_cpu)) << to_string(wire) << " forward " << it;
      for (int r = 0; r < R; ++r) {
        if (y_gpu[r].empty()) continue;
        const double err = rel_l2_bf16(y_gpu[r], y_cpu[r]);
        worst = std::max(worst, err);
        ASSERT_LE(err, per_forward_bound) << to_string(wire) << " forward " << it << " rank " << r;
        pooled.add(y_gpu[r], y_cpu[r]);
        ++outputs;
      }
    }
    total += n;
    worst_overall = std::max(worst_overall, worst);
    std::printf("[soak] backend=%s ep=%d group=%s wire=%s forwards=%lld rel-L2 vs cpu: pooled %.3e (bound %.2e), "
                "worst forward %.3e (bound %.3e)\n",
                p.backend, R, R > 1 ? group_suffix(p.group) : "-", to_string(wire), static_cast<long long>(n),
                pooled.rel(), pooled_bound, worst, per_forward_bound);
    EXPECT_LE(pooled.rel(), pooled_bound) << to_string(wire);
  }
  std::printf("[soak] backend=%s ep=%d total forwards=%lld outputs checked=%lld worst=%.3e\n", p.backend, R,
              static_cast<long long>(total), static_cast<long long>(outputs), worst_overall);
}

INSTANTIATE_TEST_SUITE_P(Sm90, Sm90Soak,
                         ::testing::Values(SoakCase{"routed", 1, GroupKind::kNcclGpus},
                                           SoakCase{"routed", 2, GroupKind::kSharedGpu},
                                           SoakCase{"routed", 2, GroupKind::kNcclGpus},
                                           SoakCase{"mega", 1, GroupKind::kNcclGpus},
                                           SoakCase{"mega", 2, GroupKind::kSharedGpu}),
                         [](const ::testing::TestParamInfo<SoakCase>& info) {
                           return std::string(info.param.backend) + "_EP" + std::to_string(info.param.R) +
                                  (info.param.R > 1 ? std::string("_") + group_suffix(info.param.group) : "");
                         });

}  // namespace
}  // namespace megamoe
