// The optional router (megamoe/router.h): softmax top-k and DeepSeek-V3 grouped top-k on the host.
//
// Per token the work is O(E log k) with scratch vectors allocated once per call. Every argument and
// every input value is checked before the first output is written.
#include "megamoe/router.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace megamoe {
namespace {

constexpr const char* kConfigWhat = "router config";
constexpr const char* kArgWhat = "router argument";

// Shortest decimal that reads back as the same double ("2.5", not "2.500000").
std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// Strict total order "a before b" on (value, index): larger value first, then lower index.
// invariant: values are never NaN here (inputs are checked finite; sums of finite values may reach
// +-inf but not NaN), so this is a strict weak ordering and the sort result is unique.
struct Ranked {
  float value;
  int32_t idx;
};
inline bool ranks_before(const Ranked& a, const Ranked& b) {
  return a.value > b.value || (a.value == b.value && a.idx < b.idx);
}

// Puts the `count` best entries of `items` first, in rank order.
void select_best(std::vector<Ranked>* items, size_t count) {
  std::partial_sort(items->begin(), items->begin() + static_cast<std::ptrdiff_t>(count), items->end(),
                    ranks_before);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Per-call scratch, sized once.
struct Scratch {
  std::vector<float> weight_source;  // [E] p (softmax) or unbiased score (DeepSeek-V3)
  std::vector<Ranked> candidates;    // experts still eligible, with their selection value
  std::vector<Ranked> groups;        // [n_group] group scores (DeepSeek-V3, n_group > 1)
  std::vector<Ranked> kept;          // experts of the kept groups (DeepSeek-V3, n_group > 1)
};

// Softmax top-k for one token. Leaves the k picks in candidates[0, k) in slot order.
void pick_softmax(const RouterConfig& cfg, const float* row, Scratch* s) {
  const int64_t num_experts = cfg.num_experts;
  float row_max = row[0];
  for (int64_t e = 1; e < num_experts; ++e) row_max = std::max(row_max, row[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < num_experts; ++e) {
    const float ex = std::exp(row[e] - row_max);  // in [0, 1] (0 on underflow); exactly 1 at the max
    s->weight_source[e] = ex;
    sum += ex;
  }
  // invariant: sum >= 1 (the max contributes exp(0) = 1), so every p is finite.
  s->candidates.resize(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    const float p = s->weight_source[e] / sum;
    s->weight_source[e] = p;
    s->candidates[e] = Ranked{p, static_cast<int32_t>(e)};
  }
  select_best(&s->candidates, static_cast<size_t>(cfg.top_k));
}

// DeepSeek-V3 grouped top-k for one token. Leaves the k picks in candidates[0, k) in slot order.
void pick_deepseek_v3(const RouterConfig& cfg, const float* row, const float* bias, Scratch* s) {
  const int64_t num_experts = cfg.num_experts;
  const int64_t group_size = num_experts / cfg.n_group;
  // choice values live in candidates[e] (index order) until groups are filtered.
  s->candidates.resize(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    const float score = sigmoid(row[e]);
    s->weight_source[e] = score;
    s->candidates[e] = Ranked{bias != nullptr ? score + bias[e] : score, static_cast<int32_t>(e)};
  }
  if (cfg.n_group > 1 && cfg.topk_group < cfg.n_group) {
    s->groups.resize(static_cast<size_t>(cfg.n_group));
    for (int64_t g = 0; g < cfg.n_group; ++g) {
      // invariant (validated): group_size >= 2.
      float top1 = -std::numeric_limits<float>::infinity();
      float top2 = -std::numeric_limits<float>::infinity();
      for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float v = s->candidates[e].value;
        if (v > top1) {
          top2 = top1;
          top1 = v;
        } else if (v > top2) {
          top2 = v;
        }
      }
      s->groups[g] = Ranked{top1 + top2, static_cast<int32_t>(g)};
    }
    select_best(&s->groups, static_cast<size_t>(cfg.topk_group));
    // groups[0, topk_group) are the kept groups; only their experts stay eligible.
    s->kept.clear();
    for (int64_t i = 0; i < cfg.topk_group; ++i) {
      const int64_t g = s->groups[i].idx;
      for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) s->kept.push_back(s->candidates[e]);
    }
    s->candidates.swap(s->kept);
  }
  // invariant (validated): candidates.size() >= top_k.
  select_best(&s->candidates, static_cast<size_t>(cfg.top_k));
}

}  // namespace

const char* to_string(RouterKind kind) {
  switch (kind) {
    case RouterKind::kSoftmaxTopK: return "softmax_topk";
    case RouterKind::kDeepSeekV3: return "deepseek_v3";
  }
  return "unknown";
}

Status RouterConfig::validate() const {
  const bool known_kind = kind == RouterKind::kSoftmaxTopK || kind == RouterKind::kDeepSeekV3;
  if (!known_kind) {
    return invalid_argument(kConfigWhat, "kind", std::to_string(static_cast<int32_t>(kind)),
                            "must be kSoftmaxTopK or kDeepSeekV3");
  }
  if (num_experts < 1 || num_experts > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(kConfigWhat, "num_experts", std::to_string(num_experts),
                            "must be in [1, 2147483647] (expert ids are int32)");
  }
  if (top_k < 1 || top_k > num_experts) {
    return invalid_argument(kConfigWhat, "top_k", std::to_string(top_k),
                            "must be in [1, num_experts=" + std::to_string(num_experts) + "]");
  }
  if (n_group < 1) {
    return invalid_argument(kConfigWhat, "n_group", std::to_string(n_group), "must be >= 1");
  }
  if (num_experts % n_group != 0) {
    return invalid_argument(kConfigWhat, "n_group", std::to_string(n_group),
                            "must divide num_experts=" + std::to_string(num_experts));
  }
  if (topk_group < 1 || topk_group > n_group) {
    return invalid_argument(kConfigWhat, "topk_group", std::to_string(topk_group),
                            "must be in [1, n_group=" + std::to_string(n_group) + "]");
  }
  const float scale_fp32 = static_cast<float>(routed_scaling_factor);
  if (!std::isfinite(routed_scaling_factor) || !(routed_scaling_factor > 0.0) ||
      !std::isfinite(scale_fp32) || !(scale_fp32 > 0.0f)) {
    return invalid_argument(kConfigWhat, "routed_scaling_factor", format_double(routed_scaling_factor),
                            "must be finite and > 0 (also when rounded to fp32)");
  }
  if (kind == RouterKind::kSoftmaxTopK) {
    if (n_group != 1) {
      return invalid_argument(kConfigWhat, "n_group", std::to_string(n_group),
                              "must be 1 for kind=softmax_topk (grouped selection is deepseek_v3 only)");
    }
    return Status::ok();
  }
  const int64_t group_size = num_experts / n_group;
  if (n_group > 1 && group_size < 2) {
    return invalid_argument(kConfigWhat, "n_group", std::to_string(n_group),
                            "must leave >= 2 experts per group when n_group > 1 (num_experts=" +
                                std::to_string(num_experts) +
                                "; a group scores the sum of its top-2 experts)");
  }
  if (top_k > topk_group * group_size) {
    return invalid_argument(kConfigWhat, "top_k", std::to_string(top_k),
                            "must be <= topk_group * (num_experts / n_group) = " +
                                std::to_string(topk_group * group_size) +
                                " for kind=deepseek_v3 (the kept groups must hold k experts)");
  }
  return Status::ok();
}

std::string RouterConfig::to_string() const {
  return std::string("RouterConfig(kind=") + megamoe::to_string(kind) +
         ", num_experts=" + std::to_string(num_experts) + ", top_k=" + std::to_string(top_k) +
         ", n_group=" + std::to_string(n_group) + ", topk_group=" + std::to_string(topk_group) +
         ", renormalize=" + (renormalize ? "true" : "false") +
         ", routed_scaling_factor=" + format_double(routed_scaling_factor) + ")";
}

Status route(const RouterConfig& cfg, const float* logits, const float* correction_bias,
             int64_t num_tokens, int32_t* topk_ids, float* topk_weights) {
  MEGAMOE_RETURN_IF_ERROR(cfg.validate());
  if (num_tokens < 0) {
    return invalid_argument(kArgWhat, "num_tokens", std::to_string(num_tokens), "must be >= 0");
  }
  if (cfg.kind == RouterKind::kSoftmaxTopK && correction_bias != nullptr) {
    return invalid_argument(kArgWhat, "correction_bias", "non-null",
                            "must be null for kind=softmax_topk (the bias is deepseek_v3 only)");
  }
  if (num_tokens == 0) return Status::ok();
  const std::string null_rule = "must be non-null when num_tokens > 0 (num_tokens=" +
                                std::to_string(num_tokens) + ")";
  if (logits == nullptr) return invalid_argument(kArgWhat, "logits", "null", null_rule);
  if (topk_ids == nullptr) return invalid_argument(kArgWhat, "topk_ids", "null", null_rule);
  if (topk_weights == nullptr) return invalid_argument(kArgWhat, "topk_weights", "null", null_rule);

  const int64_t num_experts = cfg.num_experts;
  const int64_t top_k = cfg.top_k;
  if (correction_bias != nullptr) {
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!std::isfinite(correction_bias[e])) {
        return invalid_argument("router correction_bias", "correction_bias[expert=" + std::to_string(e) + "]",
                                format_double(correction_bias[e]), "must be finite");
      }
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!std::isfinite(row[e])) {
        return invalid_argument("router logits",
                                "logits[token=" + std::to_string(t) + ", expert=" + std::to_string(e) + "]",
                                format_double(row[e]), "must be finite");
      }
    }
  }

  Scratch scratch;
  scratch.weight_source.resize(static_cast<size_t>(num_experts));
  scratch.candidates.reserve(static_cast<size_t>(num_experts));
  scratch.kept.reserve(static_cast<size_t>(num_experts));
  const float scale = static_cast<float>(cfg.routed_scaling_factor);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    if (cfg.kind == RouterKind::kSoftmaxTopK) {
      pick_softmax(cfg, row, &scratch);
    } else {
      pick_deepseek_v3(cfg, row, correction_bias, &scratch);
    }
    int32_t* ids = topk_ids + t * top_k;
    float* weights = topk_weights + t * top_k;
    float sum = 0.0f;  // in slot order
    for (int64_t j = 0; j < top_k; ++j) {
      ids[j] = scratch.candidates[j].idx;
      weights[j] = scratch.weight_source[ids[j]];
      sum += weights[j];
    }
    // invariant: weights are in [0, 1]; sum == 0 only when every picked sigmoid underflowed.
    const bool divide = cfg.renormalize && sum > 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      float w = divide ? weights[j] / sum : weights[j];
      weights[j] = w * scale;
    }
  }
  return Status::ok();
}

}  // namespace megamoe
