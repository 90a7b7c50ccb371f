// mxfp4 expert weights (e2m1 + e8m0 per 32) in the GPU backends on an H200: each backend against the
// cpu backend on the same mxfp4 weights (prepare_weights quantises the problem's fp32 weights to
// mxfp4 once per layer, identically for both; the cpu backend computes with their exact values),
// within the bound the fp8-block layers meet against it (reference::same_points_bound_one_forward
// for one forward of T tokens: the mxfp4 GEMM is the fp8-block GEMM on an exact e4m3 expansion
// unless a 128 x 128 block spans more than e4m3's binades), repeats and CUDA-graph replays bitwise;
// T = 1, odd T and T = T_max, a rank with no tokens; EP1 and EP2 on logical ranks sharing GPU 0.
// Routed runs every case with one and with two math warpgroups per mxfp4 tile (MEGAMOE_GEMM_FP4_MATH_WG
// 1 / 2: test names end in _Wg1 / _Wg2), and some with the prefill path forced (MEGAMOE_MXFP4_EXPAND_ROWS
// 1: the weights expanded to fp8-block before each GEMM, fp8-block's GEMM on them; names end in
// _Expand), which is also bit for bit the in-kernel path (Sm90Mxfp4Prefill), and some with two CTAs
// per SM on the 16-row tiles (MEGAMOE_GEMM_FP4_CTAS_PER_SM 2: names end in _2PerSm; bit for bit one
// per SM, Sm90Mxfp4TwoCtasPerSm); mega has one math
// warpgroup (its own role layout) and never expands.
// Skips without an sm_90 GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu/gpu_skip.h"
#include "gpu/fp4_layer_check.h"
#include "gpu/layer_harness.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/backends.h"
#include "core/env.h"
#include "kernels/routed/routed_gemm_args.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "reference/error_model.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe {
namespace {

using gpu_test::GroupKind;
using gpu_test::check_fp4_layer;
using gpu_test::Harness;
using gpu_test::rel_l2_bf16;
using reference::MoeProblem;
using reference::RankInputs;
using reference::Routing;

struct Mxfp4LayerCase {
  const char* name;
  Backend backend;
  int64_t H, I, E, k, R, T;
  Routing routing;
  CombineDtype combine = CombineDtype::kBf16;
  int fp4_math_wg = 0;  // routed: MEGAMOE_GEMM_FP4_MATH_WG for the layer (0: unset)
  bool expand = false;  // routed: MEGAMOE_MXFP4_EXPAND_ROWS=1 (every forward expands)
  bool chunks = false;  // with expand: MEGAMOE_MXFP4_EXPAND_MIB=1 (4 tiny experts per chunk)
  int ctas_per_sm = 0;  // routed: MEGAMOE_GEMM_FP4_CTAS_PER_SM for the layer (0: unset)
  std::string test_name() const {
    return std::string(to_string(backend)) + "_" + name + (R > 1 ? "_SharedGpu" : "") +
           (fp4_math_wg > 0 ? "_Wg" + std::to_string(fp4_math_wg) : "") + (expand ? "_Expand" : "") +
           (chunks ? "Chunks" : "") + (ctas_per_sm == 2 ? "_2PerSm" : "");
  }
};

// An environment knob set to `value` for the scope (null: unset), read again on entry and exit.
struct EnvScope {
  EnvScope(const char* name, const char* value) : name_(name) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
    reload_env_knobs();
  }
  ~EnvScope() {
    unsetenv(name_);
    reload_env_knobs();
  }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  const char* name_;
};

// MEGAMOE_GEMM_FP4_MATH_WG = wg for the scope (wg 0: left unset).
struct Fp4MathWgScope : EnvScope {
  explicit Fp4MathWgScope(int wg)
      : EnvScope("MEGAMOE_GEMM_FP4_MATH_WG", wg > 0 ? (wg == 1 ? "1" : "2") : nullptr) {}
};

MoeGeometry geometry(const Mxfp4LayerCase& p) {
  MoeGeometry g;
  g.hidden = p.H;
  g.intermediate = p.I;
  g.num_experts = p.E;
  g.top_k = p.k;
  g.ep_size = p.R;
  g.max_tokens_per_rank = p.T;
  return g;
}

class Sm90Mxfp4Layer : public ::testing::TestWithParam<Mxfp4LayerCase> {};

TEST_P(Sm90Mxfp4Layer, MatchesCpuBackendOnTheSameMxfp4Weights) {
  const Mxfp4LayerCase& p = GetParam();
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  std::vector<int64_t> tokens(p.R, p.T);
  if (p.R > 1) tokens[0] = p.T > 1 ? p.T / 2 : 0;  // uneven; T = 1: a rank with no tokens
  MoeProblem problem = reference::make_random_problem(geometry(p), 4321, tokens, p.routing);
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  c.dispatch_format = DispatchFormat::kFp8Block;
  c.combine_dtype = p.combine;
  c.backend = p.backend;
  const Status gate = p.backend == Backend::kMega ? mega_capability(problem.geometry, c)
                                                   : routed_capability(problem.geometry, c);
  ASSERT_TRUE(gate.is_ok()) << gate.to_string();
  const Fp4MathWgScope knob(p.fp4_math_wg);
  const EnvScope expand("MEGAMOE_MXFP4_EXPAND_ROWS", p.expand ? "1" : nullptr);
  const EnvScope mib("MEGAMOE_MXFP4_EXPAND_MIB", p.chunks ? "1" : nullptr);
  const EnvScope cps("MEGAMOE_GEMM_FP4_CTAS_PER_SM", p.ctas_per_sm == 2 ? "2" : nullptr);
  Harness h(problem, c, p.R > 1 ? GroupKind::kSharedGpu : GroupKind::kNcclGpus, p.backend);
  ASSERT_TRUE(h.build());
  ASSERT_EQ(h.gpu_layer(0)->backend(), p.backend);
  check_fp4_layer(h, problem, p.combine, "mxfp4", p.test_name());
}

std::vector<Mxfp4LayerCase> cases_for(Backend b) {
  return {
      Mxfp4LayerCase{"EP1_Tiny_T1", b, 512, 256, 16, 4, 1, 1, Routing::kUniform},
      Mxfp4LayerCase{"EP1_Tiny_T33", b, 512, 256, 16, 4, 1, 33, Routing::kUniform},
      Mxfp4LayerCase{"EP1_Top6_T33_Dropped", b, 512, 256, 32, 6, 1, 33, Routing::kWithDropped},
      Mxfp4LayerCase{"EP1_SingleExpert_T100", b, 512, 256, 16, 4, 1, 100, Routing::kSingleExpert},
      Mxfp4LayerCase{"EP1_Qwen3_30B_T96_Dropped", b, 2048, 768, 128, 8, 1, 96, Routing::kWithDropped},
      Mxfp4LayerCase{"EP1_DeepSeekV3Dims_E16_T8", b, 7168, 2048, 16, 8, 1, 8, Routing::kUniform},
      Mxfp4LayerCase{"EP1_Tiny_T64_Mxfp8Wire", b, 512, 256, 16, 4, 1, 64, Routing::kUniform, CombineDtype::kMxfp8},
      Mxfp4LayerCase{"EP2_Tiny_T1", b, 512, 256, 16, 4, 2, 1, Routing::kUniform},
      Mxfp4LayerCase{"EP2_Tiny_T33", b, 512, 256, 16, 4, 2, 33, Routing::kWithDropped},
      Mxfp4LayerCase{"EP2_Qwen3_30B_T64_Mxfp8Wire", b, 2048, 768, 128, 8, 2, 64, Routing::kUniform,
                     CombineDtype::kMxfp8},
  };
}

std::vector<Mxfp4LayerCase> all_cases() {
  std::vector<Mxfp4LayerCase> out;
  for (int wg : {1, 2})
    for (Mxfp4LayerCase c : cases_for(Backend::kRouted)) {
      c.fp4_math_wg = wg;
      out.push_back(c);
    }
  // The prefill path at every size (forced): dropped slots, experts with no rows (skipped by the
  // expansion), deepseek-v3's dimensions, a quantised wire, EP2 on logical ranks.
  for (Mxfp4LayerCase c : cases_for(Backend::kRouted)) {
    const std::string n = c.name;
    if (n != "EP1_Tiny_T33" && n != "EP1_Top6_T33_Dropped" && n != "EP1_SingleExpert_T100" &&
        n != "EP1_DeepSeekV3Dims_E16_T8" && n != "EP1_Tiny_T64_Mxfp8Wire" && n != "EP2_Tiny_T33")
      continue;
    c.expand = true;
    out.push_back(c);
    if (n == "EP1_Tiny_T33" || n == "EP2_Tiny_T33") {  // 256 KiB per expert: chunks of 4 in 1 MiB
      c.chunks = true;
      out.push_back(c);
    }
  }
  // Two CTAs per SM forced (the layer's own choice needs ~5 tiles per SM): T = 1, dropped slots, one
  // expert, deepseek-v3's dimensions, a quantised wire (EP1: logical ranks sharing a GPU run one).
  for (Mxfp4LayerCase c : cases_for(Backend::kRouted)) {
    const std::string n = c.name;
    if (n != "EP1_Tiny_T1" && n != "EP1_Top6_T33_Dropped" && n != "EP1_SingleExpert_T100" &&
        n != "EP1_DeepSeekV3Dims_E16_T8" && n != "EP1_Tiny_T64_Mxfp8Wire")
      continue;
    c.fp4_math_wg = 2;
    c.ctas_per_sm = 2;
    out.push_back(c);
  }
  for (const Mxfp4LayerCase& c : cases_for(Backend::kMega)) out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sm90, Sm90Mxfp4Layer, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Mxfp4LayerCase>& info) { return info.param.test_name(); });

// Prefill sizes: a pool of 2048 rows against the cpu backend, on the mxfp4 GEMM's swapped tiles
// (MEGAMOE_MXFP4_EXPAND_ROWS off; one and two math warpgroups per tile) and on fp8-block's tiles over
// the expanded weights (expansion forced, all experts at once and in chunks; and by the default
// threshold at T = 4096), the paths bit for bit equal (the same products: the expansion is the
// GEMM's own, Mxfp4Expand in test_gemm_mxfp4).
class Sm90Mxfp4Prefill : public ::testing::TestWithParam<int> {};

TEST_P(Sm90Mxfp4Prefill, RoutedPoolOf2048Rows_ExpandedEqualsInKernel) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const int wg = GetParam();
  Mxfp4LayerCase p{"EP1_Tiny_T512", Backend::kRouted, 512, 256, 16, 4, 1, 512, Routing::kUniform};
  MoeProblem problem = reference::make_random_problem(geometry(p), 99, {512});
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  c.knobs.block_m = 128;  // no mxfp4 configuration: left to the heuristic (swapped tiles); fp8-block's 128
  const Fp4MathWgScope knob(wg);
  std::vector<std::vector<uint16_t>> y[3];
  for (int expand = 0; expand < 3; ++expand) {  // off; all 16 experts at once; chunks of 4 (1 MiB)
    const EnvScope rows("MEGAMOE_MXFP4_EXPAND_ROWS", expand ? "1" : "off");
    const EnvScope mib("MEGAMOE_MXFP4_EXPAND_MIB", expand == 2 ? "1" : nullptr);
    Harness h(problem, c, GroupKind::kNcclGpus, Backend::kRouted);
    ASSERT_TRUE(h.build());
    std::vector<std::vector<uint16_t>> y_cpu;
    ASSERT_TRUE(h.run(problem.ranks, &y[expand], &y_cpu));
    const double err = rel_l2_bf16(y[expand][0], y_cpu[0]);
    std::printf("[mxfp4] routed EP1 T512 (%s, %d math warpgroups): rel-L2 vs cpu backend = %.3e\n",
                expand == 2 ? "expanded to fp8-block, chunks of 4 experts"
                : expand    ? "expanded to fp8-block"
                            : "in-kernel expansion",
                wg, err);
    EXPECT_LE(err, reference::same_points_bound_one_forward(CombineDtype::kBf16, 512).rel_l2);
  }
  for (int v = 1; v < 3; ++v) {
    int64_t diffs = 0;
    for (size_t i = 0; i < y[0][0].size(); ++i) diffs += y[0][0][i] != y[v][0][i];
    std::printf("[mxfp4] routed EP1 T512: %lld of %zu outputs differ between the in-kernel and the expanded path%s\n",
                (long long)diffs, y[0][0].size(), v == 2 ? " (chunks)" : "");
    EXPECT_EQ(diffs, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Sm90, Sm90Mxfp4Prefill, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) { return "Wg" + std::to_string(info.param); });

// The default threshold: T = 4096 on 16 experts of top-4 is 1024 rows per expert, past
// kDefaultMxfp4ExpandRows, so the layer expands by itself; against the cpu backend, a repeat and a
// graph replay (both expansions captured) bitwise.
TEST(Sm90Mxfp4PrefillDefault, RoutedT4096ExpandsByTheDefaultThreshold) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  Mxfp4LayerCase p{"EP1_Tiny_T4096_DefaultExpand", Backend::kRouted, 512, 256, 16, 4, 1, 4096, Routing::kUniform};
  ASSERT_GE(routed_rows_per_expert(geometry(p), 4096 * 4), kDefaultMxfp4ExpandRows);
  MoeProblem problem = reference::make_random_problem(geometry(p), 7, {4096});
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  const EnvScope rows("MEGAMOE_MXFP4_EXPAND_ROWS", nullptr);
  Harness h(problem, c, GroupKind::kNcclGpus, Backend::kRouted);
  ASSERT_TRUE(h.build());
  check_fp4_layer(h, problem, CombineDtype::kBf16, "mxfp4", p.test_name());
}

// Two CTAs per SM compute every tile as one does (the same K loop and epilogue, only where the tile
// runs differs): deepseek-v3's dimensions on 16 experts at 8 tokens (16-row tiles), bit for bit.
TEST(Sm90Mxfp4TwoCtasPerSm, BitEqualToOnePerSm) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  Mxfp4LayerCase p{"EP1_DeepSeekV3Dims_E16_T8", Backend::kRouted, 7168, 2048, 16, 8, 1, 8, Routing::kUniform};
  MoeProblem problem = reference::make_random_problem(geometry(p), 31, {8});
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  std::vector<std::vector<uint16_t>> y[2];
  for (int v = 0; v < 2; ++v) {
    const EnvScope cps("MEGAMOE_GEMM_FP4_CTAS_PER_SM", v == 0 ? "1" : "2");
    Harness h(problem, c, GroupKind::kNcclGpus, Backend::kRouted);
    ASSERT_TRUE(h.build());
    std::vector<std::vector<uint16_t>> y_cpu;
    ASSERT_TRUE(h.run(problem.ranks, &y[v], &y_cpu));
    const double err = rel_l2_bf16(y[v][0], y_cpu[0]);
    std::printf("[mxfp4] routed EP1 deepseek-v3 dims T8, %d CTA(s) per SM: rel-L2 vs cpu backend = %.3e\n", v + 1,
                err);
    EXPECT_LE(err, reference::same_points_bound_one_forward(CombineDtype::kBf16, 8).rel_l2);
  }
  int64_t diffs = 0;
  for (size_t i = 0; i < y[0][0].size(); ++i) diffs += y[0][0][i] != y[1][0][i];
  std::printf("[mxfp4] routed EP1 deepseek-v3 dims T8: %lld of %zu outputs differ between 1 and 2 CTAs per SM\n",
              (long long)diffs, y[0][0].size());
  EXPECT_EQ(diffs, 0);
}

// A tiny routed mxfp4 layer built and warmed up with environment knob `name` = `value`; the status of
// the first step that failed (ok when both did). Checks that the capability gate does not read it.
Status tiny_mxfp4_warmup_with(const char* name, const char* value) {
  Mxfp4LayerCase p{"EP1_Tiny_T8", Backend::kRouted, 512, 256, 16, 4, 1, 8, Routing::kUniform};
  MoeProblem problem = reference::make_random_problem(geometry(p), 5, {8});
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  c.backend = Backend::kRouted;
  const EnvScope knob(name, value);
  EXPECT_TRUE(routed_capability(problem.geometry, c).is_ok()) << name << "=" << value;
  std::unique_ptr<MoeLayer> layer;
  Status st = MoeLayer::create(problem.geometry.for_rank(0), c, reference::local_weights(problem, 0), nullptr, &layer);
  if (st.is_ok()) st = layer->warmup();
  return st;
}

// A bad MEGAMOE_GEMM_FP4_MATH_WG fails the routed mxfp4 layer's warmup, naming the variable, the value
// and the rule (and does not turn `auto` away from routed: the gate does not read it).
TEST(Sm90Mxfp4Knob, BadFp4MathWgFailsTheWarmupNamingTheKnob) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const Status st = tiny_mxfp4_warmup_with("MEGAMOE_GEMM_FP4_MATH_WG", "4");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("MEGAMOE_GEMM_FP4_MATH_WG='4', must be 1 or 2"), std::string::npos) << st.to_string();
}

// A bad MEGAMOE_GEMM_FP4_CTAS_PER_SM likewise.
TEST(Sm90Mxfp4Knob, BadFp4CtasPerSmFailsTheWarmupNamingTheKnob) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const Status st = tiny_mxfp4_warmup_with("MEGAMOE_GEMM_FP4_CTAS_PER_SM", "3");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("MEGAMOE_GEMM_FP4_CTAS_PER_SM='3', must be 1 or 2"), std::string::npos)
      << st.to_string();
}

// A bad MEGAMOE_MXFP4_EXPAND_ROWS likewise (read even when T_max never reaches the threshold).
TEST(Sm90Mxfp4Knob, BadExpandRowsFailsTheWarmupNamingTheKnob) {
  MEGAMOE_REQUIRE_SM90_GPUS(1);
  const Status st = tiny_mxfp4_warmup_with("MEGAMOE_MXFP4_EXPAND_ROWS", "many");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("MEGAMOE_MXFP4_EXPAND_ROWS='many', must be 'off' or a positive integer"),
            std::string::npos)
      << st.to_string();
}

}  // namespace
}  // namespace megamoe
