// Mega backend (one kernel per forward) on an H200: against the cpu backend on the same inputs (same
// quantisation points, the bounds the routed backend meets), bitwise against the routed backend where
// their arithmetic is the same, bitwise across repeats and CUDA-graph replays, one kernel node per
// captured forward, 0 tokens, every token to one expert, T = T_max, the gate and `auto`; EP1 on one
// GPU, and R = 2 and 4 logical ranks sharing GPU 0 (uneven T, a 0-token rank, a peer that skips a
// launch). Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "gpu/gpu_skip.h"
#include "gpu/layer_harness.h"
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
using gpu_test::GroupKind;
using gpu_test::Harness;
using gpu_test::L2Sums;
using gpu_test::rel_l2_bf16;

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
  CombineDtype combine = CombineDtype::kBf16;
  OwnerReduce owner_reduce = OwnerReduce::kAuto;  // auto: on with a quantised wire
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
  cfg.combine_dtype = c.combine;
  cfg.owner_reduce = c.owner_reduce;
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
  const reference::ErrorBound bound = reference::same_points_bound_one_forward(c.combine, in.num_tokens);
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
                      MegaCase{"Bf16_Tiny_T200_BM128", 512, 256, 16, 4, 200, 200, Routing::kUniform, true, 128},
                      // staged combines: FC2's rows sent after FC2 in the wire's format
                      MegaCase{"Fp8_Qwen3_30B_T96_Mxfp8Wire", 2048, 768, 128, 8, 96, 96, Routing::kWithDropped, false, 0,
                               CombineDtype::kMxfp8},
                      MegaCase{"Fp8_Tiny_T64_Nvfp4Wire", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 0,
                               CombineDtype::kNvfp4},
                      MegaCase{"Fp8_Tiny_T64_Mxfp8Wire_PerSlot", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 0,
                               CombineDtype::kMxfp8, OwnerReduce::kOff},
                      MegaCase{"Fp8_Tiny_T64_Bf16Wire_OwnerReduce", 512, 256, 16, 4, 64, 64, Routing::kUniform, false, 16,
                               CombineDtype::kBf16, OwnerReduce::kOn},
                      MegaCase{"Fp8_DeepSeekV3Dims_E16_T8_Mxfp8Wire", 7168, 2048, 16, 8, 8, 8, Routing::kUniform, false, 0,
                               CombineDtype::kMxfp8}),
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
  EXPECT_LE(rel, reference::same_points_bound_one_forward(CombineDtype::kBf16, 64).rel_l2);
}

// output_scale (SGLang's routed_scaling_factor) against the cpu backend, and the EPLB receive counts
// (set_expert_counts) against the routing's truth, accumulated over two forwards.
TEST(Sm90MegaEdges, OutputScaleAndExpertCounts) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, 64), 31, {64}, Routing::kWithDropped);
  MoeConfig c;
  c.output_scale = 2.5f;
  std::unique_ptr<MoeLayer> mega, cpu;
  ASSERT_TRUE(make_layer(problem, c, Backend::kMega, &mega));
  ASSERT_TRUE(make_layer(problem, c, Backend::kCpu, &cpu));
  void* counts = nullptr;
  ASSERT_EQ(cudaMalloc(&counts, 16 * 8), cudaSuccess);
  ASSERT_EQ(cudaMemset(counts, 0, 16 * 8), cudaSuccess);
  ASSERT_TRUE(mega->set_expert_counts(TensorView(counts, DType::kInt64, {16}, Device::cuda(0))).is_ok());
  DeviceInputs d(problem.ranks[0], 512, 4);
  for (int rep = 0; rep < 2; ++rep) {
    ASSERT_TRUE(d.forward(*mega, nullptr).is_ok());
    ASSERT_TRUE(mega->check_error(nullptr).is_ok());
  }
  const double rel = rel_l2_bf16(d.output(), cpu_forward(*cpu, problem.ranks[0], 512, 4));
  std::printf("[mega] output_scale 2.5: rel-L2 vs cpu backend = %.3e\n", rel);
  EXPECT_LE(rel, reference::same_points_bound_one_forward(CombineDtype::kBf16, problem.ranks[0].num_tokens).rel_l2);
  std::vector<long long> got(16), want(16, 0);
  cudaMemcpy(got.data(), counts, 16 * 8, cudaMemcpyDeviceToHost);
  const RankInputs& in = problem.ranks[0];
  for (int64_t t = 0; t < in.num_tokens; ++t)
    for (int j = 0; j < 4; ++j) {
      const int32_t e = in.topk_ids[t * 4 + j];
      bool repeat = false;
      for (int i = 0; i < j; ++i) repeat = repeat || in.topk_ids[t * 4 + i] == e;
      if (e >= 0 && e < 16 && !repeat) want[e] += 2;  // two forwards
    }
  EXPECT_EQ(got, want);
  cudaFree(counts);
}

// int64 ids and bf16 weights (torch.topk's and some engines' dtypes) through the conversion kernel:
// bitwise equal to int32 ids with fp32 weights holding the same bf16 values, with an output scale.
TEST(Sm90MegaEdges, Int64IdsAndBf16WeightsEqualInt32Fp32Bitwise) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  const int64_t T = 48, H = 512, k = 4;
  MoeProblem problem = reference::make_random_problem(geometry(H, 256, 16, k, T), 41, {T}, Routing::kWithDropped);
  RankInputs in = problem.ranks[0];
  std::vector<uint16_t> w_bf16(T * k);
  for (int64_t i = 0; i < T * k; ++i) {  // the fp32 weights rounded to bf16, so both forms hold one value
    w_bf16[i] = fmt::float_to_bf16(in.topk_weights[i]);
    in.topk_weights[i] = fmt::bf16_to_float(w_bf16[i]);
  }
  std::vector<long long> ids64(in.topk_ids.begin(), in.topk_ids.end());
  MoeConfig c;
  c.output_scale = 1.5f;
  std::unique_ptr<MoeLayer> mega;
  ASSERT_TRUE(make_layer(problem, c, Backend::kMega, &mega));
  DeviceInputs d(in, H, k);
  ASSERT_TRUE(d.forward(*mega, nullptr).is_ok());
  ASSERT_TRUE(mega->check_error(nullptr).is_ok());
  const std::vector<uint16_t> want = d.output();
  void *dids = nullptr, *dw = nullptr;
  ASSERT_EQ(cudaMalloc(&dids, T * k * 8), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, T * k * 2), cudaSuccess);
  cudaMemcpy(dids, ids64.data(), T * k * 8, cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w_bf16.data(), T * k * 2, cudaMemcpyHostToDevice);
  const Device dev = Device::cuda(0);
  for (int form = 0; form < 3; ++form) {  // int64 + fp32, int32 + bf16, int64 + bf16
    d.poison(nullptr);
    const TensorView ids = form != 1 ? TensorView(dids, DType::kInt64, {T, k}, dev) : TensorView(d.ids, DType::kInt32, {T, k}, dev);
    const TensorView w = form != 0 ? TensorView(dw, DType::kBFloat16, {T, k}, dev) : TensorView(d.w, DType::kFloat32, {T, k}, dev);
    ASSERT_TRUE(mega->forward(TensorView(d.x, DType::kBFloat16, {T, H}, dev), ids, w,
                              TensorView(d.y, DType::kBFloat16, {T, H}, dev), nullptr).is_ok());
    ASSERT_TRUE(mega->check_error(nullptr).is_ok());
    EXPECT_EQ(d.output(), want) << "form " << form;
  }
  cudaFree(dids);
  cudaFree(dw);
}

// A bad expert id is skipped (as -1) and reported by check_error with the first bad (token, slot).
TEST(Sm90MegaEdges, BadExpertIdsAreReportedAndSkipped) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, 32), 21, {32});
  RankInputs in = problem.ranks[0];
  in.topk_ids[5 * 4 + 2] = 16;  // E = 16: out of range
  std::unique_ptr<MoeLayer> mega;
  ASSERT_TRUE(make_layer(problem, MoeConfig{}, Backend::kMega, &mega));
  DeviceInputs d(in, 512, 4);
  ASSERT_TRUE(d.forward(*mega, nullptr).is_ok());
  const Status st = mega->check_error(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("topk_ids[5, 2]=16"), std::string::npos) << st.message();
  EXPECT_TRUE(mega->check_error(nullptr).is_ok()) << "reported once, then cleared";
}

// Bitwise equal to the routed backend where the arithmetic is the same: fp8-block weights, the same
// BLOCK_M for both GEMMs (the dispatch quantisation, the GEMMs' K order and promotion, the SwiGLU
// requant are the same code), and the same combine: a bf16 wire one row per slot (FC2's epilogue
// weights and rounds each row once in both), or an mxfp8 wire with the owner reduce (both send from
// FC2's unweighted bf16 rows through the same encoder and reduce).
TEST(Sm90MegaEdges, BitwiseEqualToRoutedAtTheSameTiles) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  for (int run = 0; run < 4; ++run) {
    constexpr int kBlockMs[] = {16, 64, 128, 64};
    const int bm = kBlockMs[run];
    MoeProblem problem = reference::make_random_problem(geometry(2048, 768, 128, 8, 96), 5, {96}, Routing::kWithDropped);
    MoeConfig c;
    c.knobs.block_m = bm;
    if (run == 3) c.combine_dtype = CombineDtype::kMxfp8;  // staged send + owner reduce in both backends
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
    std::printf("[mega] BLOCK_M %d, %s wire: %lld of %zu outputs differ from routed's (rel-L2 %.3e)\n", bm,
                to_string(c.combine_dtype),
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
    EXPECT_EQ(layer->backend(), T_max <= 64 ? Backend::kMega : Backend::kRouted) << layer->selection().reason;
  }
  MoeConfig q;
  q.in_kernel_fc2_reduce = true;  // above the threshold too: routed has no in-kernel reduce
  for (int64_t T_max : {64, 65}) {
    MoeProblem problem = reference::make_random_problem(geometry(512, 256, 16, 4, T_max), 3, {T_max});
    std::unique_ptr<MoeLayer> layer;
    q.mega_max_tokens_per_rank = 64;
    ASSERT_TRUE(make_layer(problem, q, Backend::kAuto, &layer));
    EXPECT_EQ(layer->backend(), Backend::kMega) << layer->selection().reason;
  }
  EXPECT_FALSE(mega_capability(geometry(640, 256, 16, 4, 64), MoeConfig{}).is_ok());  // hidden % 256
}

// The in-kernel FC2 reduce (bf16 red.add into the source's accumulation rows, copied to y in the same
// launch): against the cpu backend's in-kernel reduce (same quantisation points, another add order)
// within in_kernel_reduce_bound_one_forward, every repeat and graph replay too (their adds race, so
// they need not be bitwise equal; each is poisoned first, so a row left unwritten fails), and the
// accumulation rows are zero again after each launch (a repeat that found them dirty would double).
TEST(Sm90MegaEdges, InKernelFc2ReduceWithinItsBound) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  cudaSetDevice(0);
  struct Shape {
    const char* name;
    int64_t H, I, E, k, T;
    Routing routing;
    int32_t block_m;
  };
  for (const Shape& sh : {Shape{"Tiny_T64", 512, 256, 16, 4, 64, Routing::kUniform, 0},
                          Shape{"Tiny_T64_BM16", 512, 256, 16, 4, 64, Routing::kUniform, 16},
                          Shape{"Qwen3_30B_T96_Dropped", 2048, 768, 128, 8, 96, Routing::kWithDropped, 0},
                          Shape{"SingleExpert_T100", 512, 256, 16, 4, 100, Routing::kSingleExpert, 0}}) {
    MoeProblem problem = reference::make_random_problem(geometry(sh.H, sh.I, sh.E, sh.k, sh.T), 77, {sh.T}, sh.routing);
    MoeConfig cfg;
    cfg.in_kernel_fc2_reduce = true;
    cfg.knobs.block_m = sh.block_m;
    std::unique_ptr<MoeLayer> mega, cpu;
    ASSERT_TRUE(make_layer(problem, cfg, Backend::kMega, &mega));
    ASSERT_EQ(mega->backend(), Backend::kMega);
    ASSERT_TRUE(make_layer(problem, cfg, Backend::kCpu, &cpu));
    const RankInputs& in = problem.ranks[0];
    cudaStream_t s;
    cudaStreamCreate(&s);
    DeviceInputs d(in, sh.H, sh.k);
    const std::vector<uint16_t> y_cpu = cpu_forward(*cpu, in, sh.H, sh.k);
    const reference::ErrorBound bound = reference::in_kernel_reduce_bound_one_forward(sh.k, sh.T);
    const auto check = [&](const char* what) {
      const Status err = mega->check_error(s);
      ASSERT_TRUE(err.is_ok()) << err.to_string();
      const double rel = rel_l2_bf16(d.output(), y_cpu);
      std::printf("[mega] in-kernel reduce %s %s: rel-L2 vs cpu backend = %.3e (bound %.2e)\n", sh.name, what, rel,
                  bound.rel_l2);
      EXPECT_LE(rel, bound.rel_l2) << sh.name << " " << what;
    };
    for (int rep = 0; rep < 3; ++rep) {
      d.poison(s);
      ASSERT_TRUE(d.forward(*mega, s).is_ok());
      check(rep == 0 ? "first" : "repeat");
    }
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status cst = d.forward(*mega, s);
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    ASSERT_TRUE(cst.is_ok()) << cst.to_string();
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    EXPECT_EQ(nodes, 1u);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int rep = 0; rep < 2; ++rep) {
      d.poison(s);
      ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
      check("graph replay");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// Two logical ranks with the in-kernel reduce: every owner adds into the source's accumulation rows
// through its peer pointer (uneven T, a rank with none), within the bound, repeat and graph replay too.
TEST(Sm90MegaSharedGpuEdges, InKernelFc2ReduceAtTwoRanks) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  MoeGeometry g = geometry(2048, 768, 128, 8, 64);
  g.ep_size = 2;
  for (const std::vector<int64_t>& tokens : {std::vector<int64_t>{64, 41}, std::vector<int64_t>{0, 64}}) {
    MoeProblem problem = reference::make_random_problem(g, 4242, tokens, Routing::kWithDropped);
    MoeConfig cfg;
    cfg.in_kernel_fc2_reduce = true;
    Harness h(problem, cfg, GroupKind::kSharedGpu, Backend::kMega);
    ASSERT_TRUE(h.build());
    for (int pass = 0; pass < 3; ++pass) {
      std::vector<std::vector<uint16_t>> y, y_cpu;
      ASSERT_TRUE(h.run(problem.ranks, &y, &y_cpu, /*graph=*/pass == 2));
      for (int r = 0; r < 2; ++r) {
        ASSERT_EQ(y[r].size(), y_cpu[r].size());
        if (y[r].empty()) continue;
        const double bound = reference::in_kernel_reduce_bound_one_forward(g.top_k, tokens[r]).rel_l2;
        const double rel = rel_l2_bf16(y[r], y_cpu[r]);
        std::printf("[mega] in-kernel reduce R2 pass %d rank %d (T=%lld): rel-L2 vs cpu backend = %.3e (bound %.2e)\n",
                    pass, r, static_cast<long long>(tokens[r]), rel, bound);
        EXPECT_LE(rel, bound) << "pass " << pass << " rank " << r;
      }
    }
  }
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

// R logical ranks sharing GPU 0 (each with its grid of SMs / R CTAs): against the cpu backend with a
// 0-token rank and uneven T, repeats bitwise, graph replays equal to eager.
struct MegaEpCase {
  const char* name;
  int64_t H, I, E, k, R, T_max;
  Routing routing;
  CombineDtype combine = CombineDtype::kBf16;
};
class Sm90MegaSharedGpu : public ::testing::TestWithParam<MegaEpCase> {};

TEST_P(Sm90MegaSharedGpu, MatchesCpuBackendWithUnevenAndEmptyRanks) {
  const MegaEpCase& c = GetParam();
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  MoeGeometry g = geometry(c.H, c.I, c.E, c.k, c.T_max);
  g.ep_size = c.R;
  std::vector<int64_t> tokens(c.R);
  for (int64_t r = 0; r < c.R; ++r) tokens[r] = r == 0 ? 0 : r == 1 ? c.T_max : (c.T_max * r) / (c.R + 1);
  MoeProblem problem = reference::make_random_problem(g, 4321, tokens, c.routing);
  MoeConfig cfg;
  cfg.combine_dtype = c.combine;
  Harness h(problem, cfg, GroupKind::kSharedGpu, Backend::kMega);
  ASSERT_TRUE(h.build());
  std::vector<std::vector<uint16_t>> y, y_cpu, y_again, y_graph, unused;
  ASSERT_TRUE(h.run(problem.ranks, &y, &y_cpu));
  for (int64_t r = 0; r < c.R; ++r) {
    ASSERT_EQ(y[r].size(), y_cpu[r].size());
    if (y[r].empty()) continue;
    const double bound = reference::same_points_bound_one_forward(c.combine, tokens[r]).rel_l2;
    const double rel = rel_l2_bf16(y[r], y_cpu[r]);
    std::printf("[mega] %s rank %lld (T=%lld): rel-L2 vs cpu backend = %.3e (bound %.2e)\n", c.name,
                static_cast<long long>(r), static_cast<long long>(tokens[r]), rel, bound);
    EXPECT_LE(rel, bound) << c.name << " rank " << r;
  }
  ASSERT_TRUE(h.run(problem.ranks, &y_again, &unused));
  EXPECT_EQ(y, y_again) << "repeated forwards differ: a race";
  ASSERT_TRUE(h.run(problem.ranks, &y_graph, &unused, /*graph=*/true));
  EXPECT_EQ(y, y_graph) << "CUDA-graph replay differs from eager";
}

INSTANTIATE_TEST_SUITE_P(
    Sm90, Sm90MegaSharedGpu,
    ::testing::Values(MegaEpCase{"Fp8_R2_Tiny_T64", 512, 256, 16, 4, 2, 64, Routing::kUniform},
                      MegaEpCase{"Fp8_R2_Qwen3_30B_T64_Dropped", 2048, 768, 128, 8, 2, 64, Routing::kWithDropped},
                      MegaEpCase{"Fp8_R2_DeepSeekV3Dims_E16_T8", 7168, 2048, 16, 8, 2, 8, Routing::kUniform},
                      MegaEpCase{"Fp8_R2_SingleExpert_T64", 512, 256, 16, 4, 2, 64, Routing::kSingleExpert},
                      MegaEpCase{"Fp8_R4_Tiny_T48", 512, 256, 16, 4, 4, 48, Routing::kUniform},
                      MegaEpCase{"Fp8_R4_Qwen3_30B_T300", 2048, 768, 128, 8, 4, 300, Routing::kWithDropped},
                      MegaEpCase{"Fp8_R2_Qwen3_30B_T64_Mxfp8Wire", 2048, 768, 128, 8, 2, 64, Routing::kWithDropped,
                                 CombineDtype::kMxfp8},
                      MegaEpCase{"Fp8_R4_Tiny_T48_Nvfp4Wire", 512, 256, 16, 4, 4, 48, Routing::kUniform,
                                 CombineDtype::kNvfp4}),
    [](const ::testing::TestParamInfo<MegaEpCase>& info) { return std::string(info.param.name); });

// Two logical ranks: mega bitwise equal to routed at the same BLOCK_M with a bf16 wire (see
// BitwiseEqualToRoutedAtTheSameTiles), uneven T, so the placement and combine across ranks are
// checked bit for bit, not only within the cpu-backend bound.
TEST(Sm90MegaSharedGpuEdges, BitwiseEqualToRoutedAtTwoRanks) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  MoeGeometry g = geometry(2048, 768, 128, 8, 64);
  g.ep_size = 2;
  MoeProblem problem = reference::make_random_problem(g, 606, {64, 41}, Routing::kWithDropped);
  MoeConfig cfg;
  cfg.knobs.block_m = 64;
  std::vector<std::vector<uint16_t>> y[2], y_cpu, unused;
  const Backend backends[2] = {Backend::kMega, Backend::kRouted};
  for (int b = 0; b < 2; ++b) {
    Harness h(problem, cfg, GroupKind::kSharedGpu, backends[b]);
    ASSERT_TRUE(h.build());
    ASSERT_TRUE(h.run(problem.ranks, &y[b], b == 0 ? &y_cpu : &unused)) << to_string(backends[b]);
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(y[0][r].size(), y[1][r].size());
    int64_t differ = 0;
    for (size_t i = 0; i < y[0][r].size(); ++i) differ += y[0][r][i] != y[1][r][i];
    std::printf("[mega] R2 rank %d: %lld of %zu outputs differ from routed's; rel-L2 vs cpu backend %.3e\n", r,
                static_cast<long long>(differ), y[0][r].size(), rel_l2_bf16(y[0][r], y_cpu[r]));
    EXPECT_EQ(differ, 0) << "rank " << r;
  }
}

// Rank 1 of two logical ranks skips a launch: rank 0's kernel gives up at its dispatch wait and
// reports a timeout naming the stage and the peer; rank 1 sees rank 0's abort; nothing hangs.
TEST(Sm90MegaSharedGpuEdges, PeerThatSkipsALaunchTimesOut) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  MoeGeometry g = geometry(512, 256, 16, 4, 32);  // its own workspace key: the aborted group is not reused
  g.ep_size = 2;
  MoeProblem problem = reference::make_random_problem(g, 8, {16, 16});
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_shared_gpu_group(0, 2, &ranks).is_ok());
  std::vector<std::unique_ptr<MoeLayer>> layers(2);
  std::vector<Status> built(2), results(2);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(0);
      MoeConfig c;
      c.backend = Backend::kMega;
      Status st = MoeLayer::create(g.for_rank(r), c, reference::local_weights(problem, r), ranks[r], &layers[r]);
      if (st.is_ok()) st = layers[r]->warmup();
      built[r] = st;
      if (!st.is_ok()) return;
      const cudaStream_t s = gpu_test::make_rank_stream(ranks[r].get());
      if (r == 0) {
        DeviceInputs d(problem.ranks[0], 512, 4);
        const Status f = d.forward(*layers[0], s);
        results[0] = f.is_ok() ? layers[0]->check_error(s) : f;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        results[1] = layers[1]->check_error(s);
      }
      gpu_test::drop_rank_stream(ranks[r].get(), s);
    });
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(built[0].is_ok() && built[1].is_ok()) << built[0].to_string() << " / " << built[1].to_string();
  std::printf("[mega] rank 0: %s\n[mega] rank 1: %s\n(%.2f s)\n", results[0].to_string().c_str(),
              results[1].to_string().c_str(), secs);
  EXPECT_EQ(results[0].code(), StatusCode::kTimeout) << results[0].to_string();
  EXPECT_NE(results[0].message().find("dispatch-done"), std::string::npos) << results[0].to_string();
  EXPECT_NE(results[0].message().find("peer rank 1"), std::string::npos) << results[0].to_string();
  EXPECT_TRUE(results[1].is_ok() || results[1].message().find("rank 0") != std::string::npos) << results[1].to_string();
  EXPECT_LT(secs, 60.0);
  std::vector<std::thread> teardown;  // each rank's layer on its own thread
  for (int r = 0; r < 2; ++r)
    teardown.emplace_back([&, r] {
      cudaSetDevice(0);
      layers[r].reset();
    });
  for (auto& t : teardown) t.join();
}

}  // namespace
}  // namespace megamoe
