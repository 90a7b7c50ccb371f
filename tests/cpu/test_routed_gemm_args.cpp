// The routed backend's grouped-GEMM arguments (make_routed_gemm_args) through the real
// validate_grouped_gemm, for the presets' geometries at EP 1 / 2 / 8 and odd max_tokens_per_rank: the
// pool's scale leading dimension is its row count, which must be a multiple of 4 (top-2 at T_max = 1
// and top-6 at T_max = 33 were refused at warmup). No GPU: any 16-byte aligned addresses do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/backends.h"
#include "core/env.h"
#include "kernels/routed/routed_gemm_args.h"
#include "megamoe/workspace.h"

namespace megamoe {
namespace {

struct Preset {
  const char* name;
  int64_t hidden, intermediate, experts, top_k;
};

const Preset kPresets[] = {{"deepseek-v3", 7168, 2048, 256, 8},    {"deepseek-v4-flash", 4096, 2048, 256, 6},
                           {"qwen3-235b-a22b", 4096, 1536, 128, 8}, {"qwen3-30b-a3b", 2048, 768, 128, 8},
                           {"mixtral-8x7b", 4096, 14336, 8, 2},     {"tiny", 512, 256, 16, 4}};

// deepseek-v3's dimensions (H 7168, I 2048, top-8) with `experts`, EP `ep` and T_max `t_max`.
MoeGeometry deepseek_v3_geometry(int64_t experts, int64_t ep, int64_t t_max) {
  MoeGeometry g;
  g.hidden = 7168;
  g.intermediate = 2048;
  g.num_experts = experts;
  g.top_k = 8;
  g.ep_size = ep;
  g.max_tokens_per_rank = t_max;
  return g;
}

RoutedGemmBuffers fake_buffers(const MoeGeometry& g) {
  RoutedGemmBuffers b;
  char* const addr = reinterpret_cast<char*>(uintptr_t(1) << 40);
  b.workspace = addr;
  b.w13 = b.w2 = addr;
  b.w13_scales = b.w2_scales = b.a_scales = reinterpret_cast<float*>(addr);
  b.expert_out = addr;
  b.tile_counters = reinterpret_cast<int32_t*>(addr);
  b.pool_dst = reinterpret_cast<int32_t*>(addr);
  b.pool_weight = reinterpret_cast<float*>(addr);
  b.num_ranks = static_cast<int>(g.ep_size);
  b.rows_per_rank = g.max_tokens_per_rank * g.top_k;
  for (int r = 0; r < b.num_ranks; ++r) b.peer_combine[r] = addr;
  return b;
}

TEST(RoutedGemmArgs, EveryPresetAtOddMaxTokensValidates) {
  int checked = 0;
  for (const Preset& p : kPresets) {
    for (int64_t ep : {1, 2, 8}) {
      if (p.experts % ep != 0) continue;
      for (int64_t t_max : {1, 2, 3, 7, 33, 127, 1000, 4095}) {
        for (bool bf16 : {false, true}) {
          for (CombineDtype wire : {CombineDtype::kBf16, CombineDtype::kMxfp8}) {
            MoeGeometry g;
            g.hidden = p.hidden;
            g.intermediate = p.intermediate;
            g.num_experts = p.experts;
            g.top_k = p.top_k;
            g.ep_size = ep;
            g.max_tokens_per_rank = t_max;
            MoeConfig c;
            c.combine_dtype = wire;
            if (bf16) {
              c.weight_format = WeightFormat::kBf16;
              c.dispatch_format = DispatchFormat::kBf16;
            }
            const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
            gemm::GroupedGemmArgs fc1, fc2;
            const Status st = make_routed_gemm_args(g, c, l, fake_buffers(g), 0, 0, &fc1, &fc2);
            ASSERT_TRUE(st.is_ok()) << p.name << " EP" << ep << " T_max " << t_max << (bf16 ? " bf16" : " fp8")
                                    << " pool_rows " << l.pool_rows << ": " << st.to_string();
            EXPECT_EQ(fc1.ld_a_scales % 4, 0);
            EXPECT_TRUE(routed_format_gate(g, c).is_ok()) << p.name << " EP" << ep << " T_max " << t_max;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
}

// mxfp4 weights: both GEMMs in the mxfp4 mode (the weights' image as b, no b_scales, the fp8-block
// A side and SwiGLU + fp8 epilogue), for every preset; tile knobs the mxfp4 GEMM has no configuration
// for (64- and 128-row tiles, 128 wide, clusters) are left to its heuristic, never refused at warmup.
TEST(RoutedGemmArgs, Mxfp4WeightsRunTheGemmsMxfp4Mode) {
  for (const Preset& p : kPresets) {
    for (int64_t ep : {1, 8}) {
      if (p.experts % ep != 0) continue;
      for (int32_t bm : {0, 16, 32, 64, 128}) {
        MoeGeometry g;
        g.hidden = p.hidden;
        g.intermediate = p.intermediate;
        g.num_experts = p.experts;
        g.top_k = p.top_k;
        g.ep_size = ep;
        g.max_tokens_per_rank = 33;
        MoeConfig c;
        c.weight_format = WeightFormat::kMxfp4;
        c.knobs.block_m = bm;
        c.knobs.block_n = bm == 64 ? 128 : 0;
        c.knobs.gemm_cluster = bm == 128 ? 2 : 0;
        const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
        RoutedGemmBuffers b = fake_buffers(g);
        b.w13_scales = b.w2_scales = nullptr;  // mxfp4: inside the weights' images
        gemm::GroupedGemmArgs fc1, fc2;
        const Status st = make_routed_gemm_args(g, c, l, b, 0, 0, &fc1, &fc2);
        ASSERT_TRUE(st.is_ok()) << p.name << " EP" << ep << " block_m " << bm << ": " << st.to_string();
        EXPECT_EQ(fc1.dtype, gemm::GemmDtype::kMxfp4);
        EXPECT_EQ(fc2.dtype, gemm::GemmDtype::kMxfp4);
        EXPECT_EQ(fc1.epilogue, gemm::GemmEpilogue::kSwigluFp8);
        EXPECT_EQ(fc1.b_scales, nullptr);
        EXPECT_EQ(fc2.b_scales, nullptr);
        EXPECT_NE(fc1.a_scales, nullptr);
        EXPECT_EQ(fc2.a_scales, fc1.d_scales);
        EXPECT_EQ(fc1.tiles.block_m, bm == 16 || bm == 32 || bm == 64 ? bm : 0);  // 64: two math warpgroups (the default)
        EXPECT_EQ(fc2.tiles.block_n, 0);
        EXPECT_NE(fc1.tiles.cluster, 2);
        EXPECT_EQ(fc1.tiles.fp4_math_wg, 0);  // 0 passed: the GEMM's default
        // one math warpgroup asked for: a 64-row knob goes back to the heuristic (the GEMM's 64-row
        // mxfp4 tiles run two)
        gemm::GroupedGemmArgs fc1_1wg, fc2_1wg;
        ASSERT_TRUE(make_routed_gemm_args(g, c, l, b, 0, 1, &fc1_1wg, &fc2_1wg).is_ok());
        EXPECT_EQ(fc1_1wg.tiles.block_m, bm == 16 || bm == 32 ? bm : 0);
        EXPECT_EQ(fc2_1wg.tiles.block_m, bm == 16 || bm == 32 ? bm : 0);
        EXPECT_EQ(fc1_1wg.tiles.fp4_math_wg, 1);
        EXPECT_TRUE(routed_format_gate(g, c).is_ok()) << p.name << ": " << routed_format_gate(g, c).message();
      }
    }
  }
}

// nvfp4 weights (bf16 dispatch), FP4 in HBM: both GEMMs the nvfp4 GEMM on the layer's images (FC1's
// scaled SwiGLU reads the image's global scales, no b_expert_scale; 16- or 32-row tiles: a larger BLOCK_M
// knob is left to the GEMM), FC2 the plain store into the combine rows with the pool's row weights (into
// which the pool build folds w2's global scales); at prefill (make_routed_expanded_gemm_args) both bf16
// on the expansion, FC1 with b_expert_scale = w13's global scales and the knob's bf16 tiles; no scales
// anywhere else; the bf16 intermediate; for every preset whose hidden runs 256-wide tiles and every
// tile knob. On the expansion without the global scales FC1 is refused.
TEST(RoutedGemmArgs, Nvfp4WeightsRunTheNvfp4GemmOnTheImagesAndBf16OnTheExpansion) {
  int checked = 0;
  for (const Preset& p : kPresets) {
    for (int64_t ep : {1, 8}) {
      if (p.experts % ep != 0) continue;
      for (int32_t bm : {0, 16, 32, 64, 128}) {
        MoeGeometry g;
        g.hidden = p.hidden;
        g.intermediate = p.intermediate;
        g.num_experts = p.experts;
        g.top_k = p.top_k;
        g.ep_size = ep;
        g.max_tokens_per_rank = 33;
        MoeConfig c;
        c.weight_format = WeightFormat::kNvfp4;
        c.dispatch_format = DispatchFormat::kBf16;
        c.knobs.block_m = bm;
        EXPECT_EQ(c.intermediate_format(), DispatchFormat::kBf16);
        const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
        EXPECT_EQ(l.params.intermediate_format, kWsBf16);
        RoutedGemmBuffers b = fake_buffers(g);
        b.w13_scales = b.w2_scales = b.a_scales = nullptr;  // bf16 tokens: no block or activation scales
        float* const expert_scale = reinterpret_cast<float*>(uintptr_t(3) << 40);
        b.w13_expert_scale = expert_scale;
        const bool gate_ok = routed_format_gate(g, c).is_ok();
        EXPECT_EQ(gate_ok, p.hidden % 256 == 0) << p.name << ": " << routed_format_gate(g, c).message();
        if (!gate_ok) continue;
        gemm::GroupedGemmArgs fc1, fc2;
        Status st = make_routed_gemm_args(g, c, l, b, 0, 0, &fc1, &fc2);
        ASSERT_TRUE(st.is_ok()) << p.name << " EP" << ep << " block_m " << bm << ": " << st.to_string();
        EXPECT_EQ(fc1.dtype, gemm::GemmDtype::kNvfp4);
        EXPECT_EQ(fc2.dtype, gemm::GemmDtype::kNvfp4);
        EXPECT_EQ(fc1.epilogue, gemm::GemmEpilogue::kSwigluBf16Scaled);
        EXPECT_EQ(fc1.b_expert_scale, nullptr);  // the image's
        EXPECT_EQ(fc1.b, b.w13);
        EXPECT_EQ(fc2.epilogue, gemm::GemmEpilogue::kStoreBf16);
        EXPECT_EQ(fc2.row_weight, b.pool_weight);
        EXPECT_EQ(fc2.row_map, b.pool_dst);
        EXPECT_EQ(fc2.num_peer_d, static_cast<int32_t>(ep));
        EXPECT_EQ(fc1.a_scales, nullptr);
        EXPECT_EQ(fc1.b_scales, nullptr);
        EXPECT_EQ(fc2.b_scales, nullptr);
        EXPECT_EQ(fc1.tiles.block_m, bm == 16 || bm == 32 ? bm : 0);
        // prefill: bf16 on the expansion
        void* const expanded = reinterpret_cast<void*>(uintptr_t(5) << 40);
        st = make_routed_expanded_gemm_args(g, c, l, b, expanded, 0, &fc1, &fc2);
        ASSERT_TRUE(st.is_ok()) << p.name << " EP" << ep << " block_m " << bm << ": " << st.to_string();
        EXPECT_EQ(fc1.dtype, gemm::GemmDtype::kBf16);
        EXPECT_EQ(fc2.dtype, gemm::GemmDtype::kBf16);
        EXPECT_EQ(fc1.b, expanded);
        EXPECT_EQ(fc2.b, expanded);
        EXPECT_EQ(fc1.epilogue, gemm::GemmEpilogue::kSwigluBf16Scaled);
        EXPECT_EQ(fc1.b_expert_scale, expert_scale);
        EXPECT_EQ(fc2.b_expert_scale, nullptr);
        EXPECT_EQ(fc2.row_weight, b.pool_weight);
        EXPECT_EQ(fc1.tiles.block_m, bm == 16 || bm == 32 ? 0 : bm);  // bf16 tiles: 64 or 128 rows
        b.w13_expert_scale = nullptr;
        const Status missing = make_routed_expanded_gemm_args(g, c, l, b, expanded, 0, &fc1, &fc2);
        ASSERT_FALSE(missing.is_ok());
        EXPECT_NE(missing.message().find("b_expert_scale=null"), std::string::npos) << missing.message();
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 30);
}

// The nvfp4 prefill expansion: off, the default threshold, bf16's two bytes per weight in the chunk
// bound, and a bad knob named.
TEST(RoutedGemmArgs, Nvfp4ExpansionThresholdAndScratch) {
  MoeGeometry g = deepseek_v3_geometry(32, 1, 8192);  // 2048 rows per expert at T_max
  RoutedMxfp4Expansion x;
  ASSERT_TRUE(routed_nvfp4_expansion(g, "", "", &x).is_ok());
  EXPECT_EQ(x.threshold_rows, kDefaultNvfp4ExpandRows);
  EXPECT_TRUE(x.expands());
  const int64_t per_expert = 2 * 2048 * 7168 * 2;
  EXPECT_EQ(x.chunk_experts, std::min<int64_t>(32, kDefaultMxfp4ExpandBytes / per_expert));
  EXPECT_EQ(x.scratch_bytes, x.chunk_experts * per_expert);
  ASSERT_TRUE(routed_nvfp4_expansion(g, "off", "", &x).is_ok());
  EXPECT_FALSE(x.expands());
  const Status bad = routed_nvfp4_expansion(g, "many", "", &x);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("MEGAMOE_NVFP4_EXPAND_ROWS"), std::string::npos) << bad.message();
}

TEST(RoutedGemmArgs, TheBucketHintFollowsTheRowsReceived) {
  MoeGeometry g = deepseek_v3_geometry(256, 2, 0);  // 128 local experts
  EXPECT_EQ(routed_rows_per_expert(g, 0), 1);
  EXPECT_EQ(routed_rows_per_expert(g, 128 * 64), 64 + 16);  // mean 64: + 2 sqrt(64)
  EXPECT_GT(routed_rows_per_expert(g, 2 * 8192 * 8), routed_rows_per_expert(g, 8 * 8));
}

TEST(RoutedGemmArgs, TheTileOrderKnobReachesBothGemms) {
  MoeGeometry g = deepseek_v3_geometry(256, 2, 128);
  const gemm::GemmTileOrder want[] = {gemm::GemmTileOrder::kAuto, gemm::GemmTileOrder::kCounter,
                                      gemm::GemmTileOrder::kRoundRobin};
  for (int32_t order : {0, 1, 2}) {
    MoeConfig c;
    c.knobs.gemm_tile_order = order;
    const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
    gemm::GroupedGemmArgs fc1, fc2;
    ASSERT_TRUE(make_routed_gemm_args(g, c, l, fake_buffers(g), 0, 0, &fc1, &fc2).is_ok());
    EXPECT_EQ(fc1.tile_order, want[order]) << "gemm_tile_order " << order;
    EXPECT_EQ(fc2.tile_order, want[order]) << "gemm_tile_order " << order;
  }
}

// MEGAMOE_GEMM_FP4_MATH_WG: "1" or "2" (unset: 2) reaches both mxfp4 GEMMs' tiles as the GEMM takes
// them; any other value is refused naming the variable, the value and the rule; other weight formats
// leave the field 0 (the GEMM refuses it set there).
TEST(RoutedGemmArgs, TheFp4MathWgKnobReachesBothMxfp4Gemms) {
  int32_t wg = -1;
  ASSERT_TRUE(routed_fp4_math_wg("", &wg).is_ok());
  EXPECT_EQ(wg, gemm::kDefaultFp4MathWG);
  EXPECT_EQ(wg, 2);
  for (const char* bad : {"0", "3", "-1", "two", " 2", "2 ", "12", "1.0"}) {
    wg = -1;
    const Status st = routed_fp4_math_wg(bad, &wg);
    ASSERT_FALSE(st.is_ok()) << bad;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::string("MEGAMOE_GEMM_FP4_MATH_WG='") + bad + "'"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("must be 1 or 2"), std::string::npos) << st.message();
    EXPECT_EQ(wg, -1) << bad;
  }
  MoeGeometry g = deepseek_v3_geometry(256, 2, 8);
  for (const char* value : {"1", "2"}) {
    ASSERT_EQ(setenv("MEGAMOE_GEMM_FP4_MATH_WG", value, 1), 0);
    reload_env_knobs();
    EXPECT_EQ(env_knobs().gemm_fp4_math_wg, value);
    ASSERT_TRUE(routed_fp4_math_wg(env_knobs().gemm_fp4_math_wg, &wg).is_ok());
    EXPECT_EQ(wg, value[0] - '0');
    for (WeightFormat wf : {WeightFormat::kMxfp4, WeightFormat::kFp8Block}) {
      MoeConfig c;
      c.weight_format = wf;
      const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
      RoutedGemmBuffers b = fake_buffers(g);
      if (wf == WeightFormat::kMxfp4) b.w13_scales = b.w2_scales = nullptr;
      gemm::GroupedGemmArgs fc1, fc2;
      const Status st = make_routed_gemm_args(g, c, l, b, 0, wg, &fc1, &fc2);
      ASSERT_TRUE(st.is_ok()) << value << " " << to_string(wf) << ": " << st.to_string();
      const int32_t want = wf == WeightFormat::kMxfp4 ? wg : 0;
      EXPECT_EQ(fc1.tiles.fp4_math_wg, want) << value << " " << to_string(wf);
      EXPECT_EQ(fc2.tiles.fp4_math_wg, want) << value << " " << to_string(wf);
    }
  }
  ASSERT_EQ(setenv("MEGAMOE_GEMM_FP4_MATH_WG", "3", 1), 0);
  reload_env_knobs();
  const Status st = routed_fp4_math_wg(env_knobs().gemm_fp4_math_wg, &wg);
  EXPECT_NE(st.message().find("MEGAMOE_GEMM_FP4_MATH_WG='3', must be 1 or 2"), std::string::npos) << st.message();
  ASSERT_EQ(unsetenv("MEGAMOE_GEMM_FP4_MATH_WG"), 0);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().gemm_fp4_math_wg, "");
  // The GEMM's own rule on the field.
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
  RoutedGemmBuffers b = fake_buffers(g);
  b.w13_scales = b.w2_scales = nullptr;
  gemm::GroupedGemmArgs fc1, fc2;
  const Status bad = make_routed_gemm_args(g, c, l, b, 0, 3, &fc1, &fc2);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("tiles.fp4_math_wg=3"), std::string::npos) << bad.message();
}

// MEGAMOE_GEMM_FP4_CTAS_PER_SM: "1" or "2" (unset: 0, chosen per forward); any other value refused
// naming the variable, the value and the rule, the output untouched. The GEMM's validation takes any
// parsed value beside any tiles the layer may set (the GEMM runs two only on 16-row tiles of two math
// warpgroups).
TEST(RoutedGemmArgs, TheFp4CtasPerSmKnobParsesAndTheGemmTakesIt) {
  int32_t cps = -1;
  ASSERT_TRUE(routed_fp4_ctas_per_sm("", &cps).is_ok());
  EXPECT_EQ(cps, 0);
  for (const char* value : {"1", "2"}) {
    ASSERT_TRUE(routed_fp4_ctas_per_sm(value, &cps).is_ok()) << value;
    EXPECT_EQ(cps, value[0] - '0');
  }
  for (const char* bad : {"0", "3", "-1", "two", " 2", "2 ", "1.0"}) {
    cps = -1;
    const Status st = routed_fp4_ctas_per_sm(bad, &cps);
    ASSERT_FALSE(st.is_ok()) << bad;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::string("MEGAMOE_GEMM_FP4_CTAS_PER_SM='") + bad + "', must be 1 or 2"),
              std::string::npos)
        << st.message();
    EXPECT_EQ(cps, -1) << bad;
  }
  ASSERT_EQ(setenv("MEGAMOE_GEMM_FP4_CTAS_PER_SM", "2", 1), 0);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().gemm_fp4_ctas_per_sm, "2");
  ASSERT_EQ(unsetenv("MEGAMOE_GEMM_FP4_CTAS_PER_SM"), 0);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().gemm_fp4_ctas_per_sm, "");

  MoeGeometry g = deepseek_v3_geometry(32, 1, 8);
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
  RoutedGemmBuffers b = fake_buffers(g);
  b.w13_scales = b.w2_scales = nullptr;
  for (int32_t want : {0, 1, 2}) {
    for (int32_t bm : {0, 16, 32}) {
      for (int32_t wg : {0, 1, 2}) {
        gemm::GroupedGemmArgs fc1, fc2;
        ASSERT_TRUE(make_routed_gemm_args(g, c, l, b, 0, wg, &fc1, &fc2).is_ok());
        fc1.tiles.block_m = bm;
        fc1.tiles.ctas_per_sm = want;
        EXPECT_TRUE(gemm::validate_grouped_gemm(fc1).is_ok())
            << want << " " << bm << " " << wg << ": " << gemm::validate_grouped_gemm(fc1).message();
      }
    }
  }
}

// The per-forward choice: the expected 16-row tiles (experts hit x m-blocks x n-blocks) against
// kFp4TwoCtasMinTilesPerSm per SM, as measured for deepseek-v3's dims on 132 SMs: 32 experts at 1 and
// 8 tokens keep FC1 at one CTA per SM (113 and 442 tiles) and FC2 from 8 tokens on at two (773); 256
// experts at 8 tokens both at two (909 and 1591).
TEST(RoutedGemmArgs, TwoCtasPerSmFromFiveTilesPerSm) {
  MoeGeometry g = deepseek_v3_geometry(32, 1, 0);
  const int64_t n1 = 2 * g.intermediate, n2 = g.hidden;
  EXPECT_EQ(routed_fp4_expected_tiles(g, 0, n1), 0.0);
  EXPECT_NEAR(routed_fp4_expected_tiles(g, 1, n1), 16.0, 1e-9);  // one expert, 16 n-blocks
  EXPECT_NEAR(routed_fp4_expected_tiles(g, 8, n1), 16.0 * 32 * (1 - std::pow(31.0 / 32, 8)), 1e-9);
  EXPECT_NEAR(routed_fp4_expected_tiles(g, 64, n1), 16.0 * 32 * (1 - std::pow(31.0 / 32, 64)), 1e-9);
  EXPECT_NEAR(routed_fp4_expected_tiles(g, 32 * 40, n2), 32.0 * 3 * 28, 1e-6);  // 40 rows per expert: 3 m-blocks
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 8, n1, 132), 1);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 8, n2, 132), 1);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n1, 132), 1);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n2, 132), 2);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n2, 200), 1);  // more SMs: fewer tiles each
  g.num_experts = 256;
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n1, 132), 2);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n2, 132), 2);
  EXPECT_EQ(routed_fp4_auto_ctas_per_sm(g, 64, n1, 0), 2);  // no SM count: as one SM
}

// MEGAMOE_MXFP4_EXPAND_ROWS: a positive integer or "off" (0: never); unset: the default; anything else
// refused naming the variable, the value and the rule, the output untouched.
TEST(RoutedGemmArgs, TheMxfp4ExpandRowsKnobParses) {
  int64_t rows = -1;
  ASSERT_TRUE(routed_mxfp4_expand_rows("", &rows).is_ok());
  EXPECT_EQ(rows, kDefaultMxfp4ExpandRows);
  ASSERT_TRUE(routed_mxfp4_expand_rows("off", &rows).is_ok());
  EXPECT_EQ(rows, 0);
  ASSERT_TRUE(routed_mxfp4_expand_rows("1", &rows).is_ok());
  EXPECT_EQ(rows, 1);
  ASSERT_TRUE(routed_mxfp4_expand_rows("2048", &rows).is_ok());
  EXPECT_EQ(rows, 2048);
  for (const char* bad : {"0", "-1", "+5", " 5", "5 ", "5x", "on", "OFF", "1e3", "99999999999999999999"}) {
    rows = -1;
    const Status st = routed_mxfp4_expand_rows(bad, &rows);
    ASSERT_FALSE(st.is_ok()) << bad;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::string("MEGAMOE_MXFP4_EXPAND_ROWS='") + bad + "'"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("must be 'off' or a positive integer"), std::string::npos) << st.message();
    EXPECT_EQ(rows, -1) << bad;
  }
  ASSERT_EQ(setenv("MEGAMOE_MXFP4_EXPAND_ROWS", "off", 1), 0);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().mxfp4_expand_rows, "off");
  ASSERT_EQ(unsetenv("MEGAMOE_MXFP4_EXPAND_ROWS"), 0);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().mxfp4_expand_rows, "");
}

// The expansion's chunks: whole experts within the bound, at least one, at most E_l; the bound from
// MEGAMOE_MXFP4_EXPAND_MIB (MiB; unset: 1 GiB), anything but a positive integer refused naming it.
TEST(RoutedGemmArgs, TheMxfp4ExpansionChunkBoundsTheScratch) {
  MoeGeometry g = deepseek_v3_geometry(256, 8, 0);  // 32 local experts x 29.4 MB: one chunk of all of them
  EXPECT_EQ(routed_mxfp4_expand_chunk(g, kDefaultMxfp4ExpandBytes), 32);
  g.ep_size = 1;  // 256: chunks of 36 (36 x 29.4 MB <= 1 GiB < 37 x)
  const int64_t chunk = routed_mxfp4_expand_chunk(g, kDefaultMxfp4ExpandBytes);
  EXPECT_EQ(chunk, 36);
  EXPECT_LE(chunk * 2 * g.intermediate * g.hidden, kDefaultMxfp4ExpandBytes);
  EXPECT_GT((chunk + 1) * 2 * g.intermediate * g.hidden, kDefaultMxfp4ExpandBytes);
  EXPECT_EQ(routed_mxfp4_expand_chunk(g, 100 << 20), 3);  // 100 MiB: 3 x 29.4 MB
  EXPECT_EQ(routed_mxfp4_expand_chunk(g, 1), 1);          // below one expert: still one at a time
  int64_t bytes = -1;
  ASSERT_TRUE(routed_mxfp4_expand_bytes("", &bytes).is_ok());
  EXPECT_EQ(bytes, kDefaultMxfp4ExpandBytes);
  ASSERT_TRUE(routed_mxfp4_expand_bytes("3", &bytes).is_ok());
  EXPECT_EQ(bytes, 3 << 20);
  for (const char* bad : {"0", "-2", "1.5", "1G", " 64", "off"}) {
    bytes = -1;
    const Status st = routed_mxfp4_expand_bytes(bad, &bytes);
    ASSERT_FALSE(st.is_ok()) << bad;
    EXPECT_NE(st.message().find(std::string("MEGAMOE_MXFP4_EXPAND_MIB='") + bad + "', must be a positive integer"),
              std::string::npos)
        << st.message();
    EXPECT_EQ(bytes, -1) << bad;
  }
}

// What a layer allocates: the chunk's w13 in e4m3 when T_max's bucket reaches the threshold, nothing
// below it or with the expansion off; the knobs' errors pass through.
TEST(RoutedGemmArgs, TheMxfp4ExpansionScratchFollowsTMaxAndTheKnobs) {
  MoeGeometry g = deepseek_v3_geometry(256, 8, 8192);  // 2048 rows per expert on average
  RoutedMxfp4Expansion x;
  ASSERT_TRUE(routed_mxfp4_expansion(g, "", "", &x).is_ok());
  EXPECT_EQ(x.threshold_rows, kDefaultMxfp4ExpandRows);
  EXPECT_EQ(x.t_max_rows, routed_rows_per_expert(g, 8192 * 8));
  EXPECT_EQ(x.chunk_experts, 32);
  EXPECT_EQ(x.scratch_bytes, 32 * 2 * 2048 * 7168);
  EXPECT_TRUE(x.expands());
  ASSERT_TRUE(routed_mxfp4_expansion(g, "off", "", &x).is_ok());
  EXPECT_EQ(x.threshold_rows, 0);
  EXPECT_FALSE(x.expands());
  ASSERT_TRUE(routed_mxfp4_expansion(g, "", "100", &x).is_ok());  // 100 MiB: 3 experts per chunk
  EXPECT_EQ(x.chunk_experts, 3);
  EXPECT_EQ(x.scratch_bytes, 3 * 2 * 2048 * 7168);
  g.max_tokens_per_rank = 512;  // bucket 128 + 2 sqrt(128) = 151 rows: below 256
  ASSERT_TRUE(routed_mxfp4_expansion(g, "", "", &x).is_ok());
  EXPECT_LT(x.t_max_rows, kDefaultMxfp4ExpandRows);
  EXPECT_FALSE(x.expands());
  EXPECT_EQ(x.scratch_bytes, 0);
  ASSERT_TRUE(routed_mxfp4_expansion(g, "151", "", &x).is_ok());
  EXPECT_TRUE(x.expands());
  const Status bad_rows = routed_mxfp4_expansion(g, "x", "", &x);
  EXPECT_NE(bad_rows.message().find("MEGAMOE_MXFP4_EXPAND_ROWS='x'"), std::string::npos) << bad_rows.message();
  const Status bad_mib = routed_mxfp4_expansion(g, "", "0", &x);
  EXPECT_NE(bad_mib.message().find("MEGAMOE_MXFP4_EXPAND_MIB='0'"), std::string::npos) << bad_mib.message();
}

// The prefill GEMMs of an mxfp4 layer: fp8-block GEMMs on the expansion (b), the mxfp4 images' block
// scales (their first region) as b_scales, fp8-block's tiles; the rest as the mxfp4 GEMMs have it.
// Every preset with mxfp4's shapes validates; other formats are refused.
TEST(RoutedGemmArgs, TheExpandedMxfp4GemmsAreFp8BlockOnTheExpansion) {
  int checked = 0;
  for (const Preset& p : kPresets) {
    if (p.hidden % 256 != 0) continue;
    for (int64_t t_max : {1, 33, 4096}) {
      MoeGeometry g;
      g.hidden = p.hidden;
      g.intermediate = p.intermediate;
      g.num_experts = p.experts;
      g.top_k = p.top_k;
      g.ep_size = 1;
      g.max_tokens_per_rank = t_max;
      MoeConfig c;
      c.weight_format = WeightFormat::kMxfp4;
      const WorkspaceLayout l = WorkspaceLayout::make(workspace_params(g, c));
      RoutedGemmBuffers b = fake_buffers(g);
      char* const w13 = reinterpret_cast<char*>(uintptr_t(2) << 40);
      char* const w2 = reinterpret_cast<char*>(uintptr_t(3) << 40);
      char* const expanded = reinterpret_cast<char*>(uintptr_t(4) << 40);
      b.w13 = w13;
      b.w2 = w2;
      b.w13_scales = b.w2_scales = nullptr;
      gemm::GroupedGemmArgs m1, m2, x1, x2;
      ASSERT_TRUE(make_routed_gemm_args(g, c, l, b, 0, 0, &m1, &m2).is_ok()) << p.name;
      const Status st = make_routed_expanded_gemm_args(g, c, l, b, expanded, 0, &x1, &x2);
      ASSERT_TRUE(st.is_ok()) << p.name << " T_max " << t_max << ": " << st.to_string();
      for (const gemm::GroupedGemmArgs* x : {&x1, &x2}) {
        EXPECT_EQ(x->dtype, gemm::GemmDtype::kFp8Block) << p.name;
        EXPECT_EQ(x->b, expanded) << p.name;
        EXPECT_EQ(x->tiles.fp4_math_wg, 0) << p.name;
      }
      EXPECT_EQ(x1.b_scales, reinterpret_cast<const float*>(w13)) << p.name;
      EXPECT_EQ(x2.b_scales, reinterpret_cast<const float*>(w2)) << p.name;
      EXPECT_EQ(x1.epilogue, m1.epilogue);
      EXPECT_EQ(x2.epilogue, m2.epilogue);
      EXPECT_EQ(x1.a, m1.a);
      EXPECT_EQ(x1.d, m1.d);
      EXPECT_EQ(x1.d_scales, m1.d_scales);
      EXPECT_EQ(x2.a_scales, m2.a_scales);
      EXPECT_EQ(x2.num_peer_d, m2.num_peer_d);
      EXPECT_EQ(x1.expected_m_per_expert, m1.expected_m_per_expert);
      ++checked;
    }
  }
  EXPECT_GE(checked, 12);
  MoeGeometry g;
  g.hidden = 512;
  g.intermediate = 256;
  g.num_experts = 16;
  g.top_k = 4;
  g.max_tokens_per_rank = 8;
  MoeConfig c;  // fp8-block
  gemm::GroupedGemmArgs x1, x2;
  const Status bad = make_routed_expanded_gemm_args(g, c, WorkspaceLayout::make(workspace_params(g, c)),
                                                    fake_buffers(g), fake_buffers(g).workspace, 0, &x1, &x2);
  EXPECT_EQ(bad.code(), StatusCode::kInternal) << bad.to_string();
}

}  // namespace
}  // namespace megamoe
