// Backend selection: `auto` resolves once, at construction, with TensorRT-LLM's MEGAMOE_AUTO rule.
#include <gtest/gtest.h>

#include <string>

#include "core/backends.h"
#include "core/device.h"
#include "megamoe/layer.h"

namespace megamoe {
namespace {

MoeGeometry geometry_with_tokens(int64_t t) {
  MoeGeometry g;
  g.hidden = 7168;
  g.intermediate = 2048;
  g.num_experts = 256;
  g.top_k = 8;
  g.ep_size = 8;
  g.ep_rank = 0;
  g.max_tokens_per_rank = t;
  return g;
}

const Status kPass = Status::ok();
const Status kMegaDown(StatusCode::kUnavailable, "mega gate says no");
const Status kRoutedDown(StatusCode::kUnavailable, "routed gate says no");

struct SelectionCase {
  int64_t tokens;
  int64_t threshold;
  bool mega_ok, routed_ok;
  Backend expected;
};

class AutoSelection : public ::testing::TestWithParam<SelectionCase> {};

TEST_P(AutoSelection, FollowsTheRule) {
  const SelectionCase& p = GetParam();
  MoeConfig c;
  c.mega_max_tokens_per_rank = p.threshold;
  BackendSelection s =
      select_backend(geometry_with_tokens(p.tokens), c, p.mega_ok ? kPass : kMegaDown, p.routed_ok ? kPass : kRoutedDown);
  EXPECT_EQ(s.backend, p.expected) << s.reason;
  EXPECT_FALSE(s.reason.empty());
}

INSTANTIATE_TEST_SUITE_P(
    Selection, AutoSelection,
    ::testing::Values(SelectionCase{256, 1024, true, true, Backend::kMega},      // decode
                      SelectionCase{1024, 1024, true, true, Backend::kMega},     // at the threshold
                      SelectionCase{1025, 1024, true, true, Backend::kRouted},   // just above
                      SelectionCase{8192, 1024, true, true, Backend::kRouted},   // prefill
                      SelectionCase{4096, 4096, true, true, Backend::kMega},     // raised threshold
                      SelectionCase{4097, 4096, true, true, Backend::kRouted},
                      SelectionCase{256, 1024, false, true, Backend::kRouted},   // mega's gate fails
                      SelectionCase{256, 1024, false, false, Backend::kCpu},     // both fail
                      // routed fails above the threshold: mega, the GPU backend that runs it
                      SelectionCase{8192, 1024, true, false, Backend::kMega},
                      SelectionCase{1, 0, true, false, Backend::kCpu},           // threshold 0: never mega
                      SelectionCase{0, 1024, true, true, Backend::kRouted},      // 0 is not in (0, threshold]
                      SelectionCase{1, 0, true, true, Backend::kRouted}));       // threshold 0: never mega

TEST(Selection, FallbackReasonsAreLogged) {
  MoeConfig c;
  BackendSelection s = select_backend(geometry_with_tokens(256), c, kMegaDown, kRoutedDown);
  EXPECT_EQ(s.backend, Backend::kCpu);
  EXPECT_NE(s.reason.find("mega gate says no"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("routed gate says no"), std::string::npos) << s.reason;
  s = select_backend(geometry_with_tokens(513), c, kPass, kPass);
  EXPECT_NE(s.reason.find("max_tokens_per_rank=513 > mega_max_tokens_per_rank=512"), std::string::npos) << s.reason;
}

TEST(Selection, ExplicitBackendIsKept) {
  MoeConfig c;
  c.backend = Backend::kRouted;
  BackendSelection s = select_backend(geometry_with_tokens(8), c, kPass, kRoutedDown);
  EXPECT_EQ(s.backend, Backend::kRouted);  // the gate is enforced by MoeLayer::create, not overridden
}

TEST(Selection, RealGatesAnswerHonestly) {
  MoeGeometry g = geometry_with_tokens(128);
  MoeConfig c;
  Status mega = mega_capability(g, c), routed = routed_capability(g, c);
  EXPECT_FALSE(mega.is_ok());
  if (cuda_device_count() == 0) {
    EXPECT_FALSE(routed.is_ok());
    EXPECT_NE(mega.message().find("no CUDA device"), std::string::npos) << mega.message();
    EXPECT_NE(routed.message().find("no CUDA device"), std::string::npos) << routed.message();
    EXPECT_EQ(select_backend(g, c).backend, Backend::kCpu);
  } else {
    EXPECT_NE(mega.message().find("not built yet"), std::string::npos) << mega.message();
    EXPECT_TRUE(routed.is_ok()) << routed.message();
    EXPECT_EQ(select_backend(g, c).backend, Backend::kRouted);  // 128 tokens: mega is not built
  }
  EXPECT_TRUE(cpu_capability(g, c).is_ok());
}

TEST(Selection, RoutedFormatGateNamesTheUnsupportedFormat) {
  MoeGeometry g = geometry_with_tokens(128);
  MoeConfig c;
  EXPECT_TRUE(routed_format_gate(g, c).is_ok());
  c.weight_format = WeightFormat::kNvfp4;
  Status st = routed_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("nvfp4"), std::string::npos) << st.message();
  c.weight_format = WeightFormat::kBf16;  // bf16 weights need a bf16 dispatch wire
  st = routed_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("dispatch_format=fp8-block"), std::string::npos) << st.message();
  c.dispatch_format = DispatchFormat::kBf16;
  EXPECT_TRUE(routed_format_gate(g, c).is_ok());
  c.in_kernel_fc2_reduce = true;
  EXPECT_FALSE(routed_format_gate(g, c).is_ok());
}

// mxfp4 weights: accepted by the routed gate with an fp8-block dispatch on a hidden the mxfp4 GEMM's
// 256-wide tiles divide; otherwise refused naming the field, its value and the rule, and `auto` then
// does not pick routed.
TEST(Selection, RoutedGateTakesMxfp4WeightsAndNamesItsRules) {
  MoeGeometry g = geometry_with_tokens(128);
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  EXPECT_EQ(c.dispatch_format, DispatchFormat::kFp8Block);
  EXPECT_TRUE(routed_format_gate(g, c).is_ok()) << routed_format_gate(g, c).message();
  c.dispatch_format = DispatchFormat::kBf16;
  Status st = routed_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("mxfp4 weights with dispatch_format=fp8-block"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("got dispatch_format=bf16"), std::string::npos) << st.message();
  c.dispatch_format = DispatchFormat::kFp8Block;
  g.hidden = 384;  // a multiple of 128 (the geometry accepts it), not of 256
  ASSERT_TRUE(c.validate(g).is_ok());
  st = routed_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("hidden=384"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("multiple of 256 with weight_format=mxfp4"), std::string::npos) << st.message();
  const BackendSelection s = select_backend(g, c, mega_format_gate(g, c), st);
  EXPECT_EQ(s.backend, Backend::kCpu) << s.reason;
  EXPECT_NE(s.reason.find("hidden=384"), std::string::npos) << s.reason;
  // fp8-block weights keep their 128 rule.
  c.weight_format = WeightFormat::kFp8Block;
  EXPECT_TRUE(routed_format_gate(g, c).is_ok()) << routed_format_gate(g, c).message();
}

// The mega backend's static gate takes mxfp4 weights on the same rules (its pairing message names
// mega); `auto` does not pick mega for them (MoeLayer::create's selection keeps to routed).
TEST(Selection, MegaGateTakesMxfp4Weights) {
  MoeGeometry g = geometry_with_tokens(64);
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp4;
  EXPECT_TRUE(mega_format_gate(g, c).is_ok()) << mega_format_gate(g, c).message();
  c.dispatch_format = DispatchFormat::kBf16;
  const Status st = mega_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("the mega backend runs mxfp4 weights with dispatch_format=fp8-block"), std::string::npos)
      << st.message();
  c.weight_format = WeightFormat::kNvfp4;
  c.dispatch_format = DispatchFormat::kFp8Block;
  EXPECT_FALSE(mega_format_gate(g, c).is_ok());
}

// nvfp4 weights run on the routed backend as bf16 (expanded at upload) with a bf16 dispatch and the
// bf16 wire FC2 writes itself: accepted on those rules; an fp8-block dispatch, a quantised wire or the
// owner reduce refused naming the field, its value and the rule. The mega gate takes them too, but
// `auto` keeps to routed (mega_auto_format_gate: mega's nvfp4 kernel is not timed yet).
TEST(Selection, RoutedGateTakesNvfp4WeightsWithABf16DispatchAndNamesItsRules) {
  MoeGeometry g = geometry_with_tokens(128);
  MoeConfig c;
  c.weight_format = WeightFormat::kNvfp4;
  c.dispatch_format = DispatchFormat::kBf16;
  Status st = routed_format_gate(g, c);
  EXPECT_TRUE(st.is_ok()) << st.message();
  EXPECT_TRUE(mega_format_gate(g, c).is_ok()) << mega_format_gate(g, c).message();
  const Status mega = mega_auto_format_gate(c);
  ASSERT_FALSE(mega.is_ok());
  BackendSelection s = select_backend(g, c, mega, routed_format_gate(g, c));
  EXPECT_EQ(s.backend, Backend::kRouted) << s.reason;
  EXPECT_NE(s.reason.find("mega backend's nvfp4 kernel has not been measured"), std::string::npos) << s.reason;
  // The pairing: bf16 dispatch only.
  c.dispatch_format = DispatchFormat::kFp8Block;
  st = routed_format_gate(g, c);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("the routed backend runs nvfp4 weights with dispatch_format=bf16"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("got dispatch_format=fp8-block"), std::string::npos) << st.message();
  c.dispatch_format = DispatchFormat::kBf16;
  // The combine: FC2's own bf16 wire (w2's global scale rides in its row weights).
  for (CombineDtype wire : {CombineDtype::kMxfp8, CombineDtype::kNvfp4}) {
    MoeConfig q = c;
    q.combine_dtype = wire;
    ASSERT_TRUE(q.validate(g).is_ok());
    st = routed_format_gate(g, q);
    ASSERT_FALSE(st.is_ok()) << to_string(wire);
    EXPECT_NE(st.message().find("combine_dtype=bf16 and no owner reduce"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(std::string("got combine_dtype=") + to_string(wire)), std::string::npos)
        << st.message();
  }
  MoeConfig owner = c;
  owner.owner_reduce = OwnerReduce::kOn;
  st = routed_format_gate(g, owner);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("owner_reduce=on"), std::string::npos) << st.message();
  // The other formats keep their rules.
  c.weight_format = WeightFormat::kBf16;
  EXPECT_TRUE(routed_format_gate(g, c).is_ok()) << routed_format_gate(g, c).message();
}

// What `auto` asks of mega's weight format beyond the gate: fp8-block and bf16 (measured) pass;
// mxfp4 is refused, and nvfp4 where routed runs it (bf16 wire, no owner reduce), each naming the
// format, so `auto` builds routed; nvfp4 with a quantised wire or the owner reduce (routed refuses
// both) goes to mega, not to cpu.
TEST(Selection, MegaAutoFormatGateKeepsUntimedFormatsOnRouted) {
  const MoeGeometry g = geometry_with_tokens(64);
  MoeConfig c;
  EXPECT_TRUE(mega_auto_format_gate(c).is_ok());
  c.weight_format = WeightFormat::kBf16;
  c.dispatch_format = DispatchFormat::kBf16;
  EXPECT_TRUE(mega_auto_format_gate(c).is_ok());
  MoeConfig m;
  m.weight_format = WeightFormat::kMxfp4;
  Status st = mega_auto_format_gate(m);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("auto keeps to routed with weight_format=mxfp4"), std::string::npos) << st.message();
  EXPECT_EQ(select_backend(g, m, st, routed_format_gate(g, m)).backend, Backend::kRouted);
  MoeConfig n;
  n.weight_format = WeightFormat::kNvfp4;
  n.dispatch_format = DispatchFormat::kBf16;
  ASSERT_TRUE(n.validate(g).is_ok());
  ASSERT_TRUE(mega_format_gate(g, n).is_ok()) << mega_format_gate(g, n).message();
  st = mega_auto_format_gate(n);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("auto keeps to routed with weight_format=nvfp4"), std::string::npos) << st.message();
  BackendSelection s = select_backend(g, n, st, routed_format_gate(g, n));
  EXPECT_EQ(s.backend, Backend::kRouted) << s.reason;
  // Only mega runs nvfp4 with a quantised wire or the owner reduce.
  for (int variant = 0; variant < 3; ++variant) {
    MoeConfig q = n;
    if (variant == 0) q.combine_dtype = CombineDtype::kMxfp8;
    if (variant == 1) q.combine_dtype = CombineDtype::kNvfp4;
    if (variant == 2) q.owner_reduce = OwnerReduce::kOn;
    ASSERT_TRUE(q.validate(g).is_ok()) << variant;
    EXPECT_TRUE(mega_format_gate(g, q).is_ok()) << variant << ": " << mega_format_gate(g, q).message();
    EXPECT_FALSE(routed_format_gate(g, q).is_ok()) << variant;
    st = mega_auto_format_gate(q);
    EXPECT_TRUE(st.is_ok()) << variant << ": " << st.message();
    s = select_backend(g, q, st, routed_format_gate(g, q));
    EXPECT_EQ(s.backend, Backend::kMega) << variant << ": " << s.reason;
  }
}

// The routed gate carries the EP transport's limits and the grouped GEMMs' shape rules, so `auto`
// never picks a routed layer that create() or warmup() would refuse: each row is a geometry that the
// config validation accepts, with the field and rule the gate names, and what auto then picks.
struct RoutedLimitCase {
  const char* what;
  int64_t hidden, intermediate, experts, top_k, ep_size, max_tokens;
  const char* field;  // "" when the gate passes
  const char* rule;
};

class RoutedGateLimits : public ::testing::TestWithParam<RoutedLimitCase> {};

TEST_P(RoutedGateLimits, AutoFallsBackWithTheReason) {
  const RoutedLimitCase& p = GetParam();
  MoeGeometry g;
  g.hidden = p.hidden;
  g.intermediate = p.intermediate;
  g.num_experts = p.experts;
  g.top_k = p.top_k;
  g.ep_size = p.ep_size;
  g.max_tokens_per_rank = p.max_tokens;
  MoeConfig c;
  ASSERT_TRUE(c.validate(g).is_ok()) << c.validate(g).to_string();
  const Status gate = routed_format_gate(g, c);
  const BackendSelection s = select_backend(g, c, kMegaDown, gate);
  if (std::string(p.field).empty()) {
    EXPECT_TRUE(gate.is_ok()) << p.what << ": " << gate.message();
    EXPECT_EQ(s.backend, Backend::kRouted) << s.reason;
    return;
  }
  ASSERT_FALSE(gate.is_ok()) << p.what;
  EXPECT_EQ(gate.code(), StatusCode::kUnavailable);
  EXPECT_NE(gate.message().find(p.field), std::string::npos) << p.what << ": " << gate.message();
  EXPECT_NE(gate.message().find(p.rule), std::string::npos) << p.what << ": " << gate.message();
  EXPECT_EQ(s.backend, Backend::kCpu) << s.reason;
  EXPECT_NE(s.reason.find(p.field), std::string::npos) << s.reason;  // the fallback says why
}

INSTANTIATE_TEST_SUITE_P(
    Selection, RoutedGateLimits,
    ::testing::Values(
        RoutedLimitCase{"deepseek-v3 EP8", 7168, 2048, 256, 8, 8, 256, "", ""},
        RoutedLimitCase{"top-16 is the transport's bound", 2048, 768, 128, 16, 2, 64, "", ""},
        RoutedLimitCase{"a top-20 model", 2048, 768, 128, 20, 2, 64, "top_k=20", "[1, 16]"},
        RoutedLimitCase{"EP16: beyond one NVLink domain", 2048, 768, 128, 8, 16, 64, "ep_size=16", "[1, 8]"},
        RoutedLimitCase{"T_max above the transport's 16-bit rows", 2048, 768, 128, 8, 2, 70000,
                        "max_tokens_per_rank=70000", "[0, 65535]"},
        RoutedLimitCase{"T_max at the bound", 512, 256, 16, 4, 1, 65535, "", ""},
        RoutedLimitCase{"mixtral-8x7b EP1, T_max 1 (pool of 2 pairs)", 4096, 14336, 8, 2, 1, 1, "", ""},
        RoutedLimitCase{"deepseek-v4-flash EP1, T_max 33 (pool of 198 pairs)", 4096, 2048, 256, 6, 1, 33, "", ""},
        RoutedLimitCase{"1024 local experts", 512, 256, 1024, 4, 1, 8, "local experts", "512"}),
    [](const ::testing::TestParamInfo<RoutedLimitCase>& info) { return "Case" + std::to_string(info.index); });

TEST(Selection, AGroupThatIsNotAGpuGroupMakesAutoPickCpu) {
  MoeGeometry g = geometry_with_tokens(8);
  g.ep_size = 2;
  g.num_experts = 8;
  g.hidden = 128;
  g.intermediate = 128;
  g.top_k = 2;
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_host_group(2, &ranks).is_ok());
  std::string why;
  EXPECT_EQ(layer_device_of(ranks[0].get(), &why), -1);
  EXPECT_NE(why.find("not a GPU group's"), std::string::npos) << why;
  const BackendSelection s = select_backend_for(g, MoeConfig{}, ranks[0].get());
  EXPECT_EQ(s.backend, Backend::kCpu) << s.reason;
  EXPECT_NE(s.reason.find("not a GPU group's"), std::string::npos) << s.reason;
}

TEST(Selection, ExplicitUnavailableBackendFailsCreate) {
  MoeGeometry g = geometry_with_tokens(8);
  g.ep_size = 1;
  g.num_experts = 8;
  g.hidden = 128;
  g.intermediate = 128;
  g.top_k = 2;
  MoeConfig c;
  c.backend = Backend::kMega;
  std::unique_ptr<MoeLayer> layer;
  Status st = MoeLayer::create(g, c, MoeWeights{}, nullptr, &layer);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("backend=mega is unavailable"), std::string::npos) << st.message();
  EXPECT_EQ(layer, nullptr);
}

TEST(Selection, CreateChecksTheCommunicator) {
  MoeGeometry g = geometry_with_tokens(8);
  g.ep_size = 2;
  g.num_experts = 8;
  g.hidden = 128;
  g.intermediate = 128;
  g.top_k = 2;
  MoeConfig c;
  c.backend = Backend::kCpu;
  std::unique_ptr<MoeLayer> layer;
  Status st = MoeLayer::create(g, c, MoeWeights{}, nullptr, &layer);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("comm=null"), std::string::npos) << st.message();
  std::vector<std::shared_ptr<Communicator>> ranks;
  ASSERT_TRUE(create_host_group(4, &ranks).is_ok());
  st = MoeLayer::create(g, c, MoeWeights{}, ranks[0], &layer);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("comm.size()=4"), std::string::npos) << st.message();
  ASSERT_TRUE(create_host_group(2, &ranks).is_ok());
  st = MoeLayer::create(g, c, MoeWeights{}, ranks[1], &layer);  // geometry says rank 0
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("comm.rank()=1"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace megamoe
