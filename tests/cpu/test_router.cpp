// Router (megamoe/router.h): hand-checked cases for softmax top-k and DeepSeek-V3 grouped top-k, ties,
// renormalisation, scaling, correction bias, group exclusion, DeepSeek-V3-shaped random cases against
// an independent implementation, and validation messages.
//
// Hand cases pick logits as logit(p) = ln(p / (1 - p)) so that sigmoid gives back p (to ~1e-7), and
// softmax cases pick logits as ln(q) so that the probabilities are q / sum(q).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "megamoe/router.h"

namespace megamoe {
namespace {

constexpr float kHandTol = 2e-6f;  // fp32 sigmoid/softmax of hand-picked logits vs exact fractions
constexpr int32_t kPoisonId = -777;

float logit_of(double p) { return static_cast<float>(std::log(p / (1.0 - p))); }
float ln(double q) { return static_cast<float>(std::log(q)); }

RouterConfig softmax_cfg(int64_t num_experts, int64_t top_k, bool renormalize, double scale = 1.0) {
  RouterConfig cfg;
  cfg.kind = RouterKind::kSoftmaxTopK;
  cfg.num_experts = num_experts;
  cfg.top_k = top_k;
  cfg.renormalize = renormalize;
  cfg.routed_scaling_factor = scale;
  return cfg;
}

RouterConfig dsv3_cfg(int64_t num_experts, int64_t top_k, int64_t n_group, int64_t topk_group,
                      bool renormalize, double scale = 1.0) {
  RouterConfig cfg;
  cfg.kind = RouterKind::kDeepSeekV3;
  cfg.num_experts = num_experts;
  cfg.top_k = top_k;
  cfg.n_group = n_group;
  cfg.topk_group = topk_group;
  cfg.renormalize = renormalize;
  cfg.routed_scaling_factor = scale;
  return cfg;
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Routes with poisoned outputs; fails the test if route() does not succeed.
Routed run(const RouterConfig& cfg, const std::vector<float>& logits, const std::vector<float>* bias = nullptr) {
  const int64_t num_tokens = static_cast<int64_t>(logits.size()) / cfg.num_experts;
  Routed r;
  r.ids.assign(static_cast<size_t>(num_tokens * cfg.top_k), kPoisonId);
  r.weights.assign(r.ids.size(), std::numeric_limits<float>::quiet_NaN());
  Status st = route(cfg, logits.data(), bias != nullptr ? bias->data() : nullptr, num_tokens, r.ids.data(),
                    r.weights.data());
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return r;
}

void expect_weights(const std::vector<float>& got, const std::vector<double>& want, float tol = kHandTol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_NEAR(got[j], want[j], tol) << "slot " << j;
}

// ------------------------------------------------------------------------------------------------
// Softmax top-k, hand-checked.

// logits = ln{3, 1, 4, 2}: softmax = {3, 1, 4, 2} / 10 = {0.3, 0.1, 0.4, 0.2}.
// top-2 by probability: expert 2 (0.4), expert 0 (0.3).
const std::vector<float> kSoftmaxRow = {ln(3), ln(1), ln(4), ln(2)};

TEST(Router, Softmax_E4_K2_NoRenorm) {
  Routed r = run(softmax_cfg(4, 2, /*renormalize=*/false), kSoftmaxRow);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(r.weights, {0.4, 0.3});
}

TEST(Router, Softmax_E4_K2_Renorm) {
  // {0.4, 0.3} / 0.7 = {4/7, 3/7}.
  Routed r = run(softmax_cfg(4, 2, true), kSoftmaxRow);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(r.weights, {4.0 / 7.0, 3.0 / 7.0});
}

TEST(Router, Softmax_E4_K2_ScalingFactor) {
  // renormalised then x2.5: {10/7, 7.5/7}; not renormalised, x2: {0.8, 0.6}.
  Routed r = run(softmax_cfg(4, 2, true, 2.5), kSoftmaxRow);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(r.weights, {10.0 / 7.0, 7.5 / 7.0}, 4 * kHandTol);
  Routed r2 = run(softmax_cfg(4, 2, false, 2.0), kSoftmaxRow);
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(r2.weights, {0.8, 0.6}, 4 * kHandTol);
}

TEST(Router, Softmax_KEqualsE_RenormSumsToOne) {
  // k = E: all four in probability order {2, 0, 3, 1}; renormalising a full softmax changes nothing.
  Routed r = run(softmax_cfg(4, 4, true), kSoftmaxRow);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0, 3, 1}));
  expect_weights(r.weights, {0.4, 0.3, 0.2, 0.1});
}

TEST(Router, Softmax_TiesResolveToLowerIndex) {
  // All equal: p = 0.25 each, bitwise equal -> ids 0, 1.
  Routed r = run(softmax_cfg(4, 2, false), {0.5f, 0.5f, 0.5f, 0.5f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  expect_weights(r.weights, {0.25, 0.25});
  // logits {1, 3, 3, 0, 3}: three-way tie at 3 -> 1, 2, 4 (expert 4 only at k = 3).
  Routed r2 = run(softmax_cfg(5, 2, true), {1.f, 3.f, 3.f, 0.f, 3.f});
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{1, 2}));
  expect_weights(r2.weights, {0.5, 0.5});
  EXPECT_EQ(r2.weights[0], r2.weights[1]);
  Routed r3 = run(softmax_cfg(5, 3, true), {1.f, 3.f, 3.f, 0.f, 3.f});
  EXPECT_EQ(r3.ids, (std::vector<int32_t>{1, 2, 4}));
  expect_weights(r3.weights, {1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0});
}

TEST(Router, Softmax_LargeLogitsAreMaxSubtracted) {
  // {1000, 999, 998}: exp(1000) overflows fp32, the max-subtracted form does not.
  // p0 = 1 / (1 + e^-1 + e^-2) = 0.6652409558; top-1 renormalised = 1.
  Routed r = run(softmax_cfg(3, 1, false), {998.f, 1000.f, 999.f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  expect_weights(r.weights, {1.0 / (1.0 + std::exp(-1.0) + std::exp(-2.0))});
  Routed r2 = run(softmax_cfg(3, 2, true), {-1000.f, -998.f, -999.f});
  // p = {e^-2, 1, e^-1} / Z; top-2 = {1, 2}, renormalised {1, e^-1} / (1 + e^-1).
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{1, 2}));
  expect_weights(r2.weights, {1.0 / (1.0 + std::exp(-1.0)), std::exp(-1.0) / (1.0 + std::exp(-1.0))});
}

// ------------------------------------------------------------------------------------------------
// DeepSeek-V3 grouped top-k, hand-checked.

TEST(Router, DeepSeekV3_GroupExcludedDespiteHoldingBestExpert) {
  // E=8, n_group=4 (groups {0,1} {2,3} {4,5} {6,7}), topk_group=2, k=2, no bias.
  // scores:        0.9 0.1 | 0.6 0.6 | 0.7 0.4 | 0.2 0.3
  // group (top-2): 1.0     | 1.2     | 1.1     | 0.5      -> keep groups 1 and 2.
  // Group 0 is dropped although expert 0 (0.9) is the single best expert.
  // candidates {2: 0.6, 3: 0.6, 4: 0.7, 5: 0.4} -> expert 4, then expert 2 (tie with 3: lower index).
  const std::vector<float> row = {logit_of(0.9), logit_of(0.1), logit_of(0.6), logit_of(0.6),
                                  logit_of(0.7), logit_of(0.4), logit_of(0.2), logit_of(0.3)};
  Routed r = run(dsv3_cfg(8, 2, 4, 2, /*renormalize=*/false), row);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 2}));
  expect_weights(r.weights, {0.7, 0.6});
  // renormalised: {0.7, 0.6} / 1.3; x2.5: {1.75, 1.5} / 1.3.
  Routed rn = run(dsv3_cfg(8, 2, 4, 2, true), row);
  EXPECT_EQ(rn.ids, (std::vector<int32_t>{4, 2}));
  expect_weights(rn.weights, {0.7 / 1.3, 0.6 / 1.3});
  Routed rs = run(dsv3_cfg(8, 2, 4, 2, true, 2.5), row);
  EXPECT_EQ(rs.ids, (std::vector<int32_t>{4, 2}));
  expect_weights(rs.weights, {1.75 / 1.3, 1.5 / 1.3}, 4 * kHandTol);
  // Ungrouped (n_group=1) the same row picks the two best experts, 0 (0.9) and 4 (0.7).
  Routed ru = run(dsv3_cfg(8, 2, 1, 1, false), row);
  EXPECT_EQ(ru.ids, (std::vector<int32_t>{0, 4}));
  expect_weights(ru.weights, {0.9, 0.7});
}

TEST(Router, DeepSeekV3_GroupScoreIsSumOfTop2) {
  // E=8, n_group=2 (groups {0..3} {4..7}), topk_group=1, k=2.
  // group 0: 0.6 0.6 0.1 0.1  -> top-2 sum 1.2  (max 0.6, full sum 1.4)
  // group 1: 0.7 0.45 0.45 0.45 -> top-2 sum 1.15 (max 0.7, full sum 2.05)
  // top-2 sum keeps group 0 (max or full sum would keep group 1) -> experts 0, 1 (tie at 0.6).
  const std::vector<float> row = {logit_of(0.6), logit_of(0.6),  logit_of(0.1),  logit_of(0.1),
                                  logit_of(0.7), logit_of(0.45), logit_of(0.45), logit_of(0.45)};
  Routed r = run(dsv3_cfg(8, 2, 2, 1, false), row);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  expect_weights(r.weights, {0.6, 0.6});
  Routed rn = run(dsv3_cfg(8, 2, 2, 1, true), row);
  EXPECT_EQ(rn.ids, (std::vector<int32_t>{0, 1}));
  expect_weights(rn.weights, {0.5, 0.5});
}

TEST(Router, DeepSeekV3_EqualGroupScoresLowerGroupWins) {
  // E=8, n_group=4.
  // scores: 0.2 0.1 | 0.5 0.3 | 0.3 0.5 | 0.7 0.05
  // groups: 0.3     | 0.8     | 0.8     | 0.75     (groups 1 and 2 bitwise equal: same two values)
  // topk_group=1, k=1: tie between groups 1 and 2 -> group 1 -> expert 2 (0.5). A wrong group tie
  // break would give expert 5 (also 0.5). Group 3 holds the best expert (0.7) and is dropped.
  const std::vector<float> row = {logit_of(0.2), logit_of(0.1), logit_of(0.5), logit_of(0.3),
                                  logit_of(0.3), logit_of(0.5), logit_of(0.7), logit_of(0.05)};
  Routed r = run(dsv3_cfg(8, 1, 4, 1, false), row);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2}));
  expect_weights(r.weights, {0.5});
  Routed rn = run(dsv3_cfg(8, 1, 4, 1, true), row);
  EXPECT_EQ(rn.ids, (std::vector<int32_t>{2}));
  expect_weights(rn.weights, {1.0});
  // topk_group=2, k=2: groups 1, 2 kept; experts 2 and 5 tie at 0.5 -> {2, 5}; x2.5 -> 1.25 each.
  Routed r2 = run(dsv3_cfg(8, 2, 4, 2, false, 2.5), row);
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{2, 5}));
  expect_weights(r2.weights, {1.25, 1.25}, 4 * kHandTol);
  EXPECT_EQ(r2.weights[0], r2.weights[1]);
}

TEST(Router, DeepSeekV3_BiasChangesChoiceNotWeights) {
  // E=4, ungrouped, k=2. scores {0.9, 0.8, 0.3, 0.2}.
  // no bias: picks 0 (0.9), 1 (0.8).
  // bias {0, 0, 0.7, 0}: choice {0.9, 0.8, 1.0, 0.2} -> picks 2 (1.0), 0 (0.9), in that slot order;
  // weights are the unbiased scores {0.3, 0.9} (slot 0 holds the smaller weight);
  // renormalised {0.25, 0.75}; x2.5 -> {0.625, 1.875}.
  const std::vector<float> row = {logit_of(0.9), logit_of(0.8), logit_of(0.3), logit_of(0.2)};
  const std::vector<float> bias = {0.f, 0.f, 0.7f, 0.f};
  Routed r0 = run(dsv3_cfg(4, 2, 1, 1, false), row);
  EXPECT_EQ(r0.ids, (std::vector<int32_t>{0, 1}));
  expect_weights(r0.weights, {0.9, 0.8});
  Routed r = run(dsv3_cfg(4, 2, 1, 1, false), row, &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(r.weights, {0.3, 0.9});
  Routed rn = run(dsv3_cfg(4, 2, 1, 1, true), row, &bias);
  EXPECT_EQ(rn.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(rn.weights, {0.25, 0.75});
  Routed rs = run(dsv3_cfg(4, 2, 1, 1, true, 2.5), row, &bias);
  EXPECT_EQ(rs.ids, (std::vector<int32_t>{2, 0}));
  expect_weights(rs.weights, {0.625, 1.875}, 4 * kHandTol);
}

TEST(Router, DeepSeekV3_BiasMovesGroupSelection) {
  // E=8, n_group=4, topk_group=1, k=1.
  // scores: 0.9 0.1 | 0.5 0.4 | 0.2 0.2 | 0.3 0.1
  // no bias: groups 1.0 | 0.9 | 0.4 | 0.4 -> group 0 -> expert 0, weight 0.9.
  // bias[3] = +0.2: choice of group 1 = {0.5, 0.6}, group score 1.1 -> group 1 -> expert 3 (0.6 > 0.5),
  // weight = its unbiased score 0.4 (1.0 renormalised).
  const std::vector<float> row = {logit_of(0.9), logit_of(0.1), logit_of(0.5), logit_of(0.4),
                                  logit_of(0.2), logit_of(0.2), logit_of(0.3), logit_of(0.1)};
  std::vector<float> bias(8, 0.f);
  Routed r0 = run(dsv3_cfg(8, 1, 4, 1, false), row, &bias);
  EXPECT_EQ(r0.ids, (std::vector<int32_t>{0}));
  expect_weights(r0.weights, {0.9});
  bias[3] = 0.2f;
  Routed r = run(dsv3_cfg(8, 1, 4, 1, false), row, &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3}));
  expect_weights(r.weights, {0.4});
  Routed rn = run(dsv3_cfg(8, 1, 4, 1, true), row, &bias);
  EXPECT_EQ(rn.ids, (std::vector<int32_t>{3}));
  expect_weights(rn.weights, {1.0});
}

TEST(Router, DeepSeekV3_DroppedGroupsNeverPickedEvenWithNegativeChoice) {
  // E=6, n_group=2 (groups {0,1,2} {3,4,5}), topk_group=1, k=2. logits 0 -> scores exactly 0.5.
  // bias {-1, -0.9, -1.2, -3, -3, -3}: choice {-0.5, -0.4, -0.7, -2.5, -2.5, -2.5}.
  // groups: -0.4 + -0.5 = -0.9 vs -5.0 -> group 0. Picks 1 (-0.4), 0 (-0.5). An implementation that
  // zero-fills dropped experts (instead of excluding them) would pick 3 and 4 (0 > -0.4).
  // weights: {0.5, 0.5}, no renorm, x2 -> {1, 1}.
  const std::vector<float> row(6, 0.f);
  const std::vector<float> bias = {-1.f, -0.9f, -1.2f, -3.f, -3.f, -3.f};
  Routed r = run(dsv3_cfg(6, 2, 2, 1, false, 2.0), row, &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  expect_weights(r.weights, {1.0, 1.0}, 0.f);
}

TEST(Router, DeepSeekV3_TiesResolveToLowerIndex) {
  // Equal logits everywhere: every group scores the same -> groups 0, 1 of 4 kept (E=8, n_group=4,
  // topk_group=2) -> experts 0..3 all tie -> k=3 gives {0, 1, 2}; renormalised 1/3 each.
  const std::vector<float> row(8, 0.25f);
  Routed r = run(dsv3_cfg(8, 3, 4, 2, true), row);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2}));
  expect_weights(r.weights, {1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0});
}

TEST(Router, DeepSeekV3_UnderflowedScoresRenormaliseToZeroNotNan) {
  // logits -200: exp(200) overflows fp32, sigmoid = 1 / inf = 0 exactly; the renormalising sum is 0
  // and the contract leaves the weights at 0. Ties -> experts 0, 1.
  const std::vector<float> row(4, -200.f);
  Routed r = run(dsv3_cfg(4, 2, 2, 1, true, 2.5), row);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.weights, (std::vector<float>{0.f, 0.f}));
}

TEST(Router, ZeroTokensWritesNothingAndAcceptsNulls) {
  EXPECT_TRUE(route(dsv3_cfg(8, 2, 4, 2, true), nullptr, nullptr, 0, nullptr, nullptr).is_ok());
  int32_t id = kPoisonId;
  float w = -1.f;
  const float logit = 1.f;
  EXPECT_TRUE(route(softmax_cfg(1, 1, true), &logit, nullptr, 0, &id, &w).is_ok());
  EXPECT_EQ(id, kPoisonId);
  EXPECT_EQ(w, -1.f);
}

// ------------------------------------------------------------------------------------------------
// Random cases against independent, straightforward implementations (full stable sorts, -inf masks,
// fp64 weights).

struct Reference {
  std::vector<int32_t> ids;
  std::vector<double> weights;
  // Tokens where the last kept group / the last picked expert ties with the first one left out, so
  // the tie rule decides the result.
  int64_t group_boundary_ties = 0;
  int64_t expert_boundary_ties = 0;
};

// Indices 0..n-1 ordered by value, descending; stable, so equal values keep the lower index first.
std::vector<int32_t> order_desc(const std::vector<float>& values) {
  std::vector<int32_t> idx(values.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return values[a] > values[b]; });
  return idx;
}

Reference reference_deepseek_v3(const RouterConfig& cfg, const std::vector<float>& logits,
                                const std::vector<float>& bias, int64_t num_tokens) {
  const int64_t E = cfg.num_experts, k = cfg.top_k, G = cfg.n_group, per_group = E / G;
  Reference ref;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<float> score(E), choice(E);
    for (int64_t e = 0; e < E; ++e) {
      // The contract's fp32 formula, so selection values match the library bit for bit.
      score[e] = 1.0f / (1.0f + std::exp(-logits[t * E + e]));
      choice[e] = score[e] + bias[e];
    }
    std::vector<float> group_score(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(members.begin(), members.end(), std::greater<float>());
      group_score[g] = members[0] + members[1];
    }
    std::vector<int32_t> group_order = order_desc(group_score);
    std::vector<bool> kept(G, false);
    for (int64_t i = 0; i < cfg.topk_group; ++i) kept[group_order[i]] = true;
    if (cfg.topk_group < G &&
        group_score[group_order[cfg.topk_group - 1]] == group_score[group_order[cfg.topk_group]]) {
      ++ref.group_boundary_ties;
    }
    std::vector<float> masked(E);
    for (int64_t e = 0; e < E; ++e) {
      masked[e] = kept[e / per_group] ? choice[e] : -std::numeric_limits<float>::infinity();
    }
    std::vector<int32_t> expert_order = order_desc(masked);
    if (masked[expert_order[k - 1]] == masked[expert_order[k]]) ++ref.expert_boundary_ties;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += score[expert_order[j]];
    for (int64_t j = 0; j < k; ++j) {
      ref.ids.push_back(expert_order[j]);
      double w = score[expert_order[j]];
      if (cfg.renormalize) w /= sum;
      ref.weights.push_back(w * cfg.routed_scaling_factor);
    }
  }
  return ref;
}

Reference reference_softmax(const RouterConfig& cfg, const std::vector<float>& logits, int64_t num_tokens) {
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  Reference ref;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    // softmax is monotone: the top-k by probability are the top-k by logit.
    std::vector<int32_t> order = order_desc(row);
    const double row_max = row[order[0]];
    double z = 0.0;
    for (float l : row) z += std::exp(l - row_max);
    double picked = 0.0;
    for (int64_t j = 0; j < k; ++j) picked += std::exp(row[order[j]] - row_max) / z;
    for (int64_t j = 0; j < k; ++j) {
      ref.ids.push_back(order[j]);
      double w = std::exp(row[order[j]] - row_max) / z;
      if (cfg.renormalize) w /= picked;
      ref.weights.push_back(w * cfg.routed_scaling_factor);
    }
  }
  return ref;
}

void expect_matches(const Routed& got, const Reference& want, int64_t top_k, double tol) {
  ASSERT_EQ(got.ids.size(), want.ids.size());
  int64_t id_mismatches = 0;
  double max_err = 0.0;
  for (size_t i = 0; i < want.ids.size(); ++i) {
    if (got.ids[i] != want.ids[i]) {
      if (++id_mismatches <= 5) {
        ADD_FAILURE() << "token " << i / top_k << " slot " << i % top_k << ": id " << got.ids[i]
                      << " want " << want.ids[i];
      }
    }
    max_err = std::max(max_err, std::abs(static_cast<double>(got.weights[i]) - want.weights[i]));
  }
  EXPECT_EQ(id_mismatches, 0);
  EXPECT_LE(max_err, tol) << "max |weight - reference| = " << max_err;
  std::printf("[ router ] %zu slots, id mismatches %lld, max weight error %.3g\n", want.ids.size(),
              static_cast<long long>(id_mismatches), max_err);
}

// Structural invariants a correct route() output always has.
void expect_well_formed(const RouterConfig& cfg, const Routed& got, int64_t num_tokens) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::set<int32_t> seen;
    double sum = 0.0;
    for (int64_t j = 0; j < cfg.top_k; ++j) {
      const int32_t id = got.ids[t * cfg.top_k + j];
      const float w = got.weights[t * cfg.top_k + j];
      ASSERT_GE(id, 0);
      ASSERT_LT(id, cfg.num_experts);
      ASSERT_TRUE(seen.insert(id).second) << "token " << t << " repeats expert " << id;
      ASSERT_TRUE(std::isfinite(w) && w >= 0.f) << "token " << t << " slot " << j << " weight " << w;
      sum += w;
    }
    if (cfg.kind == RouterKind::kDeepSeekV3 && cfg.n_group > 1) {
      std::set<int64_t> groups;
      for (int32_t id : seen) groups.insert(id / (cfg.num_experts / cfg.n_group));
      EXPECT_LE(static_cast<int64_t>(groups.size()), cfg.topk_group) << "token " << t;
    }
    if (cfg.renormalize) {
      EXPECT_NEAR(sum, cfg.routed_scaling_factor, 1e-5 * cfg.routed_scaling_factor) << "token " << t;
    }
  }
}

// DeepSeek-V3 / R1 shape: E=256, n_group=8, topk_group=4, k=8, scaling 2.5, with a correction bias.
// `quantized`: logits on a 1/4 grid and the bias on a 1/32 grid, so equal choices and equal group scores
// are common and every tie rule is exercised.
void run_deepseek_v3_random(bool quantized, bool renormalize, uint32_t seed) {
  const RouterConfig cfg = dsv3_cfg(256, 8, 8, 4, renormalize, 2.5);
  const int64_t num_tokens = 257;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_int_distribution<int> grid(-12, 12);
  std::uniform_real_distribution<float> uniform(-0.25f, 0.25f);
  std::uniform_int_distribution<int> bias_grid(-8, 8);
  std::vector<float> logits(static_cast<size_t>(num_tokens * cfg.num_experts));
  for (float& l : logits) l = quantized ? grid(rng) / 4.f : normal(rng);
  std::vector<float> bias(static_cast<size_t>(cfg.num_experts));
  for (float& b : bias) b = quantized ? bias_grid(rng) / 32.f : uniform(rng);
  Routed got = run(cfg, logits, &bias);
  expect_well_formed(cfg, got, num_tokens);
  const Reference ref = reference_deepseek_v3(cfg, logits, bias, num_tokens);
  std::printf("[ router ] ties deciding the result: %lld group boundaries, %lld expert boundaries\n",
              static_cast<long long>(ref.group_boundary_ties), static_cast<long long>(ref.expert_boundary_ties));
  if (quantized) {
    EXPECT_GT(ref.group_boundary_ties, 0);
    EXPECT_GT(ref.expert_boundary_ties, 0);
  }
  expect_matches(got, ref, cfg.top_k, 2e-6 * 2.5 * 4);
}

TEST(Router, DeepSeekV3_Random_E256_G8_TG4_K8_Continuous) { run_deepseek_v3_random(false, true, 1234); }
TEST(Router, DeepSeekV3_Random_E256_G8_TG4_K8_QuantizedTies) { run_deepseek_v3_random(true, true, 99); }
TEST(Router, DeepSeekV3_Random_E256_G8_TG4_K8_NoRenorm) { run_deepseek_v3_random(false, false, 7); }

TEST(Router, DeepSeekV3_AllGroupsKeptEqualsUngrouped) {
  // topk_group == n_group keeps every group: the result must equal n_group == 1.
  const int64_t num_tokens = 64;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.5f);
  std::vector<float> logits(static_cast<size_t>(num_tokens * 64));
  for (float& l : logits) l = normal(rng);
  std::vector<float> bias(64);
  for (float& b : bias) b = normal(rng) * 0.05f;
  Routed grouped = run(dsv3_cfg(64, 6, 8, 8, true, 1.5), logits, &bias);
  Routed flat = run(dsv3_cfg(64, 6, 1, 1, true, 1.5), logits, &bias);
  EXPECT_EQ(grouped.ids, flat.ids);
  EXPECT_EQ(grouped.weights, flat.weights);
}

TEST(Router, Softmax_Random_E64_K6_QuantizedTies) {
  // logits on a 1/8 grid: distinct logits give clearly distinct probabilities, equal ones tie.
  const RouterConfig cfg = softmax_cfg(64, 6, true, 1.0);
  const int64_t num_tokens = 200;
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> grid(-24, 24);
  std::vector<float> logits(static_cast<size_t>(num_tokens * cfg.num_experts));
  for (float& l : logits) l = grid(rng) / 8.f;
  Routed got = run(cfg, logits);
  expect_well_formed(cfg, got, num_tokens);
  expect_matches(got, reference_softmax(cfg, logits, num_tokens), cfg.top_k, 2e-6);
  RouterConfig raw = softmax_cfg(64, 6, false, 3.0);
  Routed got_raw = run(raw, logits);
  expect_well_formed(raw, got_raw, num_tokens);
  expect_matches(got_raw, reference_softmax(raw, logits, num_tokens), raw.top_k, 6e-6);
}

TEST(Router, Deterministic_RepeatedCallsBitwiseEqual) {
  const RouterConfig cfg = dsv3_cfg(256, 8, 8, 4, true, 2.5);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> logits(32 * 256);
  for (float& l : logits) l = normal(rng);
  Routed a = run(cfg, logits);
  Routed b = run(cfg, logits);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.weights, b.weights);
}

// ------------------------------------------------------------------------------------------------
// Validation: each message names the field, its value and the rule.

void expect_invalid(const Status& st, const std::vector<std::string>& fragments) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  for (const std::string& f : fragments) {
    EXPECT_NE(st.message().find(f), std::string::npos) << "message \"" << st.message() << "\" lacks \"" << f << "\"";
  }
}

TEST(Router, Validate_AcceptsDeepSeekV3AndSoftmaxShapes) {
  EXPECT_TRUE(dsv3_cfg(256, 8, 8, 4, true, 2.5).validate().is_ok());
  EXPECT_TRUE(dsv3_cfg(384, 8, 1, 1, true, 2.827).validate().is_ok());  // Kimi-K2: ungrouped
  EXPECT_TRUE(dsv3_cfg(8, 4, 4, 2, false).validate().is_ok());           // k == topk_group * group size
  EXPECT_TRUE(softmax_cfg(8, 2, true).validate().is_ok());               // Mixtral
  EXPECT_TRUE(softmax_cfg(1, 1, false).validate().is_ok());
}

TEST(Router, Validate_RejectsBadFieldsWithFieldValueRule) {
  expect_invalid(softmax_cfg(0, 1, true).validate(), {"router config", "num_experts=0", "[1, 2147483647]"});
  expect_invalid(dsv3_cfg(-4, 1, 1, 1, true).validate(), {"num_experts=-4"});
  expect_invalid(softmax_cfg(8, 0, true).validate(), {"top_k=0", "[1, num_experts=8]"});
  expect_invalid(softmax_cfg(8, 9, true).validate(), {"top_k=9", "[1, num_experts=8]"});
  expect_invalid(dsv3_cfg(8, 2, 0, 1, true).validate(), {"n_group=0", ">= 1"});
  expect_invalid(dsv3_cfg(8, 2, 3, 1, true).validate(), {"n_group=3", "divide num_experts=8"});
  expect_invalid(dsv3_cfg(8, 2, 4, 0, true).validate(), {"topk_group=0", "[1, n_group=4]"});
  expect_invalid(dsv3_cfg(8, 2, 4, 5, true).validate(), {"topk_group=5", "[1, n_group=4]"});
  expect_invalid(dsv3_cfg(8, 5, 4, 2, true).validate(),
                 {"top_k=5", "topk_group * (num_experts / n_group) = 4", "deepseek_v3"});
  expect_invalid(dsv3_cfg(8, 2, 8, 4, true).validate(), {"n_group=8", ">= 2 experts per group", "top-2"});
  expect_invalid(softmax_cfg(8, 2, true, 0.0).validate(), {"routed_scaling_factor=0", "finite and > 0"});
  expect_invalid(softmax_cfg(8, 2, true, -1.5).validate(), {"routed_scaling_factor=-1.5", "> 0"});
  expect_invalid(softmax_cfg(8, 2, true, std::nan("")).validate(), {"routed_scaling_factor=nan", "finite"});
  expect_invalid(softmax_cfg(8, 2, true, HUGE_VAL).validate(), {"routed_scaling_factor=inf", "finite"});
  expect_invalid(softmax_cfg(8, 2, true, 1e300).validate(), {"routed_scaling_factor=1e+300", "fp32"});
  RouterConfig grouped_softmax = softmax_cfg(8, 2, true);
  grouped_softmax.n_group = 4;
  grouped_softmax.topk_group = 2;
  expect_invalid(grouped_softmax.validate(), {"n_group=4", "must be 1 for kind=softmax_topk"});
}

TEST(Router, Route_RejectsBadArgumentsAndLeavesOutputsUntouched) {
  const RouterConfig cfg = dsv3_cfg(4, 2, 2, 1, true);
  std::vector<float> logits = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f};  // 2 tokens
  std::vector<int32_t> ids(4, kPoisonId);
  std::vector<float> weights(4, -3.f);
  auto untouched = [&] {
    EXPECT_EQ(ids, std::vector<int32_t>(4, kPoisonId));
    EXPECT_EQ(weights, std::vector<float>(4, -3.f));
  };
  expect_invalid(route(cfg, logits.data(), nullptr, -1, ids.data(), weights.data()),
                 {"router argument", "num_tokens=-1", ">= 0"});
  expect_invalid(route(cfg, nullptr, nullptr, 2, ids.data(), weights.data()),
                 {"logits=null", "non-null when num_tokens > 0", "num_tokens=2"});
  expect_invalid(route(cfg, logits.data(), nullptr, 2, nullptr, weights.data()), {"topk_ids=null"});
  expect_invalid(route(cfg, logits.data(), nullptr, 2, ids.data(), nullptr), {"topk_weights=null"});
  const std::vector<float> bias(4, 0.f);
  expect_invalid(route(softmax_cfg(4, 2, true), logits.data(), bias.data(), 2, ids.data(), weights.data()),
                 {"correction_bias=non-null", "softmax_topk"});
  // A bad config is reported through route() too.
  expect_invalid(route(dsv3_cfg(4, 5, 1, 1, true), logits.data(), nullptr, 2, ids.data(), weights.data()),
                 {"top_k=5"});
  untouched();

  // Non-finite logits name the token and the expert; the first token is fine, yet nothing is written.
  logits[6] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(route(cfg, logits.data(), nullptr, 2, ids.data(), weights.data()),
                 {"router logits", "logits[token=1, expert=2]=nan", "must be finite"});
  logits[6] = -std::numeric_limits<float>::infinity();
  expect_invalid(route(cfg, logits.data(), nullptr, 2, ids.data(), weights.data()),
                 {"logits[token=1, expert=2]=-inf"});
  logits[6] = 0.7f;
  logits[3] = std::numeric_limits<float>::infinity();
  expect_invalid(route(cfg, logits.data(), nullptr, 2, ids.data(), weights.data()),
                 {"logits[token=0, expert=3]=inf"});
  logits[3] = 0.4f;
  // Non-finite bias names the expert.
  std::vector<float> bad_bias = {0.f, 0.f, 0.f, std::numeric_limits<float>::quiet_NaN()};
  expect_invalid(route(cfg, logits.data(), bad_bias.data(), 2, ids.data(), weights.data()),
                 {"correction_bias[expert=3]=nan", "must be finite"});
  untouched();

  // Fixed inputs route fine afterwards.
  EXPECT_TRUE(route(cfg, logits.data(), nullptr, 2, ids.data(), weights.data()).is_ok());
  // token 0: scores increase with index; groups {0,1} (top-2 sum s0+s1) < {2,3} -> group 1 -> {3, 2}.
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 3);
  EXPECT_EQ(ids[3], 2);
}

TEST(Router, ToString) {
  EXPECT_EQ(dsv3_cfg(256, 8, 8, 4, true, 2.5).to_string(),
            "RouterConfig(kind=deepseek_v3, num_experts=256, top_k=8, n_group=8, topk_group=4, "
            "renormalize=true, routed_scaling_factor=2.5)");
  EXPECT_EQ(softmax_cfg(8, 2, false).to_string(),
            "RouterConfig(kind=softmax_topk, num_experts=8, top_k=2, n_group=1, topk_group=1, "
            "renormalize=false, routed_scaling_factor=1)");
  EXPECT_NE(dsv3_cfg(384, 8, 1, 1, true, 2.827).to_string().find("routed_scaling_factor=2.827)"),
            std::string::npos);
  EXPECT_STREQ(to_string(RouterKind::kSoftmaxTopK), "softmax_topk");
  EXPECT_STREQ(to_string(RouterKind::kDeepSeekV3), "deepseek_v3");
}

}  // namespace
}  // namespace megamoe
