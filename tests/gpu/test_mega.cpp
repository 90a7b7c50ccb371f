// Mega backend (one kernel per forward) on an H200: against the cpu backend on the same inputs (same
// quantisation points, the bounds the routed backend meets), bitwise against the routed backend where
// their arithmetic is the same, bitwise across repeats and CUDA-graph replays, one kernel node per
// captured forward, 0 tokens, every token to one expert, T = T_max, the gate and `auto`. EP1 (one
// GPU). Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gpu/gpu_skip.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "reference/error_model.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe {
namespace {

using reference::MoeProblem;
using reference::RankInputs;
using reference::Routing;

MoeGeometry geometry(int64_t H, int64_t I, int64_t E, int64_t k, int64_t T) {
  MoeGeometry g;
  g.hidden = H;
  g.intermediate = I;
  g.num_experts = E;
  g.top_k = k;
  g.ep_size = 1;
  g.max_tokens_per_rank = T;
  return g;
}

struct L2Sums {
  double diff = 0, ref = 0;
  void add(const std::vector<uint16_t>& y, const std::vector<uint16_t>& ref_y) {
    for (size_t i = 0; i < y.size(); ++i) {
      const double a = fmt::bf16_to_float(y[i]), b = fmt::bf16_to_float(ref_y[i]);
      diff += std::isfinite(a) ? (a - b) * (a - b) : INFINITY;
      ref += b * b;
    }
  }
  double rel() const { return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff); }
};

double rel_l2_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  L2Sums s;  // a poisoned (never written) element or a NaN makes it infinite
  s.add(a, b);
  return s.rel();
}

// Device copies of one rank's inputs and a poisoned output.
struct DeviceInputs {
  void *x = nullptr, *ids = nullptr, *w = nullptr, *y = nullptr;
  int64_t T = 0, H = 0, k = 0;
  DeviceInputs(const RankInputs& in, int64_t H_, int64_t k_) : T(in.num_tokens), H(H_), k(k_) {
    const size_t xb = std::max<size_t>(1, T * H * 2), ib = std::max<size_t>(1, T * k * 4);
    cudaMalloc(&x, xb);
    cudaMalloc(&ids, ib);
    cudaMalloc(&w, ib);
    cudaMalloc(&y, xb);
    cudaMemcpy(x, in.x_bf16.data(), T * H * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(ids, in.topk_ids.data(), T * k * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(w, in.topk_weights.data(), T * k * 4, cudaMemcpyHostToDevice);
    poison(nullptr);
  }
  ~DeviceInputs() {
    cudaFree(x);
    cudaFree(ids);
    cudaFree(w);
    cudaFree(y);
  }
  void poison(cudaStream_t s) { cudaMemsetAsync(y, 0xFF, std::max<size_t>(1, T * H * 2), s); }
  Status forward(MoeLayer& layer, cudaStream_t s) const {
    const Device d = Device::cuda(0);
    return layer.forward(TensorView(x, DType::kBFloat16, {T, H}, d), TensorView(ids, DType::kInt32, {T, k}, d),
                         TensorView(w, DType::kFloat32, {T, k}, d), TensorView(y, DType::kBFloat16, {T, H}, d), s);
  }
  std::vector<uint16_t> output() const {
    std::vector<uint16_t> out(T * H);
    cudaMemcpy(out.data(), y, T * H * 2, cudaMemcpyDeviceToHost);
    return out;
  }
};

std::vector<uint16_t> cpu_forward(MoeLayer& cpu, const RankInputs& in, int64_t H, int64_t k) {
  const int64_t T = in.num_tokens;
  std::vector<uint16_t> y(T * H, 0xFFFF);
  TensorView cx(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, H});
  TensorView cids(const_cast<int32_t*>(in.topk_ids.data()), DType::kInt32, {T, k});
  TensorView cw(const_cast<float*>(in.topk_weights.data()), DType::kFloat32, {T, k});
  EXPECT_TRUE(cpu.forward(cx, cids, cw, TensorView(y.data(), DType::kBFloat16, {T, H})).is_ok());
  return y;
}

::testing::AssertionResult make_layer(const MoeProblem& p, MoeConfig c, Backend b, std::unique_ptr<MoeLayer>* out) {
  c.backend = b;
  Status st = MoeLayer::create(p.geometry, c, reference::local_weights(p, 0), nullptr, out);
  if (st.is_ok()) st = (*out)->warmup();
  if (!st.is_ok()) return ::testing::AssertionFailure() << to_string(b) << ": " << st.to_string();
  return ::testing::AssertionSuccess();
}

struct MegaCase {
  const char* name;
  int64_t H, I, E, k, T_max, T;
  Routing routing;
  bool bf16;
  int32_t block_m;  // Knobs::block_m (0: by T)
};

class Sm90Mega : public ::testing::TestWithParam<MegaCase> {};

// Against the cpu backend (bound: the routed backend's), then repeats and graph replays bitwise, and
// one kernel node per captured forward.
TEST_P(Sm90Mega, MatchesCpuBackendRepeatsAndReplaysBitwise) {
  const MegaCase& c = GetParam();
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeProblem problem = reference::make_random_problem(geometry(c.H, c.I, c.E, c.k, c.T_max), 1234, {c.T}, c.routing);
  MoeConfig cfg;
  cfg.knobs.block_m = c.block_m;
  if (c.bf16) {
    cfg.weight_format = WeightFormat::kBf16;
    cfg.dispatch_format = DispatchFormat::kBf16;
  }
  std::unique_ptr<MoeLayer> mega, cpu;
  ASSERT_TRUE(make_layer(problem, cfg, Backend::kMega, &mega));
  ASSERT_EQ(mega->backend(), Backend::kMega);
  ASSERT_TRUE(make_layer(problem, cfg, Backend::kCpu, &cpu));
  const RankInputs& in = problem.ranks[0];
  cudaStream_t s;
  cudaStreamCreate(&s);
  DeviceInputs d(in, c.H, c.k);
  ASSERT_TRUE(d.forward(*mega, s).is_ok());
  const Status err = mega->check_error(s);
  ASSERT_TRUE(err.is_ok()) << err.to_string();
  const std::vector<uint16_t> y = d.output(), y_cpu = cpu_forward(*cpu, in, c.H, c.k);
  const reference::ErrorBound bound = reference::same_points_bound(CombineDtype::kBf16);
  const double rel = rel_l2_bf16(y, y_cpu);
  std::printf("[mega] %s: rel-L2 vs cpu backend = %.3e (bound %.2e)\n", c.name, rel, bound.rel_l2);
  EXPECT_LE(rel, bound.rel_l2);
  // Repeats: bitwise (no race, no state left behind).
  for (int rep = 0; rep < 3; ++rep) {
    d.poison(s);
    ASSERT_TRUE(d.forward(*mega, s).is_ok());
    ASSERT_TRUE(mega->check_error(s).is_ok());
    ASSERT_EQ(d.output(), y) << "repeat " << rep << " differs: a race";
  }
  // Capture: exactly one kernel node; replays equal eager, the output poisoned before every replay.
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status cst = d.forward(*mega, s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_TRUE(cst.is_ok()) << cst.to_string();
  size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 1u) << "a captured mega forward must be one kernel node";
  std::vector<cudaGraphNode_t> list(nodes);
  cudaGraphGetNodes(graph, list.data(), &nodes);
  for (cudaGraphNode_t n : list) {
    cudaGraphNodeType type;
    cudaGraphNodeGetType(n, &type);
    EXPECT_EQ(type, cudaGraphNodeTypeKernel);
  }
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < 3; ++rep) {
    d.poison(s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_TRUE(mega->check_error(s).is_ok());
    ASSERT_EQ(d.output(), y) << "graph replay " << rep << " differs from eager";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // The float64 unquantised reference, reported.
  if (in.num_tokens > 0) {
    std::vector<float> x(in.x_bf16.size()), yf(y.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = fmt::bf16_to_float(in.x_bf16[i]);
    for (size_t i = 0; i < y.size(); ++i) yf[i] = fmt::bf16_to_float(y[i]);
    std::vector<double> ref(y.size());
    reference::reference_moe(problem.geometry, in.num_tokens, x.data(), in.topk_ids.data(), in.topk_weights.data(),
                             problem.w13.data(), problem.w2.data(), ref.data());
    std::printf("[mega] %s: rel-L2 vs float64 unquantised reference = %.3e\n", c.name,
                reference::rel_l2(yf.data(), ref.data(), static_cast<int64_t>(yf.size())));
  }
  cudaStreamDestroy(s);
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, Sm90Mega,
    ::testing::Values(MegaCase{"Fp8_Tiny_T64", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 0},
                      MegaCase{"Fp8_Tiny_T64_BM16", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 16},
                      MegaCase{"Fp8_Tiny_T64_BM128", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 128},
                      MegaCase{"Fp8_Tiny_T1", 512, 256, 16, 4, 64, 1, Routing::kUniform, false, 0},
                      MegaCase{"Fp8_Qwen3_30B_T96_Dropped", 2048, 768, 128, 8, 96, 96, Routing::kWithDropped, false, 0},
                      MegaCase{"Fp8_DeepSeekV3Dims_E16_T8", 7168, 2048, 16, 8, 8, 8, Routing::kUniform, false, 0},
                      MegaCase{"Fp8_SingleExpert_T100", 512, 256, 16, 4, 100, 100, Routing::kSingleExpert, false, 0},
                      MegaCase{"Fp8_Tiny_TMax1024", 512, 256, 16, 4, 1024, 1024, Routing::kUniform, false, 0},
                      MegaCase{"Fp8_Tiny_T300_of_512", 512, 256, 16, 4, 512, 300, Routing::kWithDropped, false, 0},
                      MegaCase{"Bf16_Tiny_T33", 512, 256, 16, 4, 33, 33, Routing::kUniform, true, 0},
                      MegaCase{"Bf16_Tiny_T200_BM128", 512, 256, 16, 4, 200, 200, Routing::kUniform, true, 128}),
    [](const ::testing::TestParamInfo<MegaCase>& info) { return std::string(info.param.name); });

// A 0-token forward launches and returns (y is empty), and the next forward is still right: the
// workspace's counters were left as the 0-token launch found them.
TEST(Sm90MegaEdges, ZeroTokensThenTokens) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, 64), 77, {64});
  std::unique_ptr<MoeLayer> mega, cpu;
  ASSERT_TRUE(make_layer(problem, MoeConfig{}, Backend::kMega, &mega));
  ASSERT_TRUE(make_layer(problem, MoeConfig{}, Backend::kCpu, &cpu));
  RankInputs none;
  DeviceInputs d0(none, 512, 4), d(problem.ranks[0], 512, 4);
  for (int rep = 0; rep < 3; ++rep) {
    ASSERT_TRUE(d0.forward(*mega, nullptr).is_ok());
    const Status st = mega->check_error(nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  ASSERT_TRUE(d.forward(*mega, nullptr).is_ok());
  ASSERT_TRUE(mega->check_error(nullptr).is_ok());
  const double rel = rel_l2_bf16(d.output(), cpu_forward(*cpu, problem.ranks[0], 512, 4));
  std::printf("[mega] after three 0-token forwards: rel-L2 vs cpu backend = %.3e\n", rel);
  EXPECT_LE(rel, reference::kSamePointsRelL2);
}

// Bitwise equal to the routed backend where the arithmetic is the same: fp8-block weights, bf16 wire
// one row per slot, the same BLOCK_M for both GEMMs (the dispatch quantisation, the GEMMs' K order
// and promotion, the SwiGLU requant and the slot-order combine are the same code).
TEST(Sm90MegaEdges, BitwiseEqualToRoutedAtTheSameTiles) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  for (int bm : {16, 64, 128}) {
    MoeProblem problem = reference::make_random_problem(geometry(2048, 768, 128, 8, 96), 5, {96}, Routing::kWithDropped);
    MoeConfig c;
    c.knobs.block_m = bm;
    std::unique_ptr<MoeLayer> mega, routed;
    ASSERT_TRUE(make_layer(problem, c, Backend::kMega, &mega));
    ASSERT_TRUE(make_layer(problem, c, Backend::kRouted, &routed));
    DeviceInputs d(problem.ranks[0], 2048, 8);
    ASSERT_TRUE(d.forward(*mega, nullptr).is_ok());
    ASSERT_TRUE(mega->check_error(nullptr).is_ok());
    const std::vector<uint16_t> ym = d.output();
    d.poison(nullptr);
    ASSERT_TRUE(d.forward(*routed, nullptr).is_ok());
    ASSERT_TRUE(routed->check_error(nullptr).is_ok());
    const std::vector<uint16_t> yr = d.output();
    int64_t differ = 0;
    for (size_t i = 0; i < ym.size(); ++i) differ += ym[i] != yr[i];
    std::printf("[mega] BLOCK_M %d: %lld of %zu outputs differ from routed's (rel-L2 %.3e)\n", bm,
                static_cast<long long>(differ), ym.size(), rel_l2_bf16(ym, yr));
    EXPECT_EQ(differ, 0) << "BLOCK_M " << bm;
  }
}

// `auto` resolves to mega up to mega_max_tokens_per_rank and to routed above it; the gate refuses
// what the kernel does not run, naming the rule.
TEST(Sm90MegaEdges, AutoSelectsMegaUpToTheThresholdAndTheGateNamesTheRule) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeConfig c;
  c.mega_max_tokens_per_rank = 64;
  for (int64_t T_max : {64, 65}) {
    MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, T_max), 3, {T_max});
    std::unique_ptr<MoeLayer> layer;
    ASSERT_TRUE(make_layer(problem, c, Backend::kAuto, &layer));
    // Until a device run validates the kernel, `auto` keeps to routed and says why.
    const bool validated = layer->selection().reason.find("has not run on a GPU") == std::string::npos;
    EXPECT_EQ(layer->backend(), validated && T_max <= 64 ? Backend::kMega : Backend::kRouted) << layer->selection().reason;
  }
  MoeConfig q;
  q.combine_dtype = CombineDtype::kMxfp8;
  const Status gate = mega_capability(geometry(512, 256, 16, 4, 64), q);
  EXPECT_FALSE(gate.is_ok());
  EXPECT_NE(gate.message().find("combine"), std::string::npos) << gate.message();
  EXPECT_FALSE(mega_capability(geometry(640, 256, 16, 4, 64), MoeConfig{}).is_ok());  // hidden % 256
}

// Many forwards with a random T (0..T_max) and random routing, each against the cpu backend.
TEST(Sm90MegaSoak, Fp8_Tiny_1000RandomForwards) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  const int64_t T_max = 48, H = 512, k = 4, E = 16;
  MoeProblem problem = reference::make_random_problem(geometry(H, 256, E, k, T_max), 99, {T_max});
  std::unique_ptr<MoeLayer> mega, cpu;
  ASSERT_TRUE(make_layer(problem, MoeConfig{}, Backend::kMega, &mega));
  ASSERT_TRUE(make_layer(problem, MoeConfig{}, Backend::kCpu, &cpu));
  const double per_forward_bound = reference::error_bound(MoeConfig{}, k).rel_l2;
  std::mt19937_64 rng(7);
  L2Sums pooled;
  double worst = 0;
  for (int it = 0; it < 1000; ++it) {
    RankInputs in;
    const int64_t T = static_cast<int64_t>(rng() % (T_max + 1));
    in.num_tokens = T;
    in.x_bf16.assign(problem.ranks[0].x_bf16.begin(), problem.ranks[0].x_bf16.begin() + T * H);
    in.topk_ids.resize(T * k);
    in.topk_weights.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> perm(E);
      for (int e = 0; e < E; ++e) perm[e] = e;
      for (int64_t j = 0; j < k; ++j) {
        std::swap(perm[j], perm[j + rng() % (E - j)]);
        in.topk_ids[t * k + j] = (rng() % 8 == 0) ? -1 : perm[j];
        in.topk_weights[t * k + j] = 0.05f + static_cast<float>(rng() % 1000) / 1000.f;
      }
    }
    DeviceInputs d(in, H, k);
    ASSERT_TRUE(d.forward(*mega, nullptr).is_ok()) << "iteration " << it;
    const Status st = mega->check_error(nullptr);
    ASSERT_TRUE(st.is_ok()) << "iteration " << it << ": " << st.to_string();
    if (T == 0) continue;
    const std::vector<uint16_t> y = d.output(), y_cpu = cpu_forward(*cpu, in, H, k);
    const double err = rel_l2_bf16(y, y_cpu);
    worst = std::max(worst, err);
    ASSERT_LE(err, per_forward_bound) << "iteration " << it;
    pooled.add(y, y_cpu);
  }
  std::printf("[mega] 1000 random forwards, EP1: rel-L2 vs cpu backend pooled %.3e (bound %.1e), worst %.3e (bound %.3e)\n",
              pooled.rel(), reference::kSamePointsRelL2, worst, per_forward_bound);
  EXPECT_LE(pooled.rel(), reference::kSamePointsRelL2);
}

}  // namespace
}  // namespace megamoe
