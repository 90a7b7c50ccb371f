// megamoe/router.h — the optional router: router logits in, (topk_ids, topk_weights) out, ready for
// MoeLayer::forward(). Host code (CPU); for users who start from logits rather than from ids.
//
// Contract:
// - route(cfg, logits, correction_bias, num_tokens, topk_ids, topk_weights) reads
//     logits          [T, E] fp32, row-major, every value finite
//     correction_bias [E]    fp32, finite (DeepSeek-V3 e_score_correction_bias); null = zeros;
//                            kDeepSeekV3 only (must be null for kSoftmaxTopK)
//   and writes, for every token t < T = num_tokens,
//     topk_ids        [T, k] int32, k distinct experts in [0, E)
//     topk_weights    [T, k] fp32, finite and >= 0
//   Rows are independent; the result is a pure function of the inputs (bitwise deterministic).
// - kSoftmaxTopK: p = softmax(logits[t]) in fp32 (max-subtracted, exp and sum in fp32, sum in expert
//   order); the k largest p are picked; weight = p, divided by the sum of the k picked p when
//   renormalize; times routed_scaling_factor. Needs n_group == topk_group == 1.
// - kDeepSeekV3 (DeepSeek-V3's reference Gate / SGLang's biased_grouped_topk):
//     score  = sigmoid(logits[t]) = 1 / (1 + exp(-x)) in fp32
//     choice = score + correction_bias
//     the E experts form n_group contiguous groups of E / n_group; a group's score is the sum of the
//     two largest `choice` values in it; the topk_group best groups are kept (all when n_group == 1);
//     the k experts with the largest `choice` among the kept groups' experts are picked (experts of
//     dropped groups are never picked, whatever their value);
//     weight = the unbiased `score` of the picked expert, divided by the sum of the k picked scores
//     when renormalize (a sum of exactly 0, from scores that underflowed, leaves the weights 0);
//     times routed_scaling_factor.
// - Order and ties: slot j = 0..k-1 holds the picks in descending order of their selection value
//   (p, or choice); equal values are ordered by lower expert index, equal group scores by lower group
//   index. So equal logits always resolve to the lower index.
// - Errors: kInvalidArgument naming the field, its value and the rule (config fields; num_tokens < 0;
//   a null pointer while num_tokens > 0; a non-finite logit, naming its token and expert; a
//   non-finite bias, naming its expert; a bias given to kSoftmaxTopK). Every check runs before the
//   first write: on error the outputs are untouched. num_tokens == 0 writes nothing and accepts nulls.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/status.h"

namespace megamoe {

enum class RouterKind : int32_t {
  kSoftmaxTopK = 0,  // softmax over E, top-k (Mixtral, Qwen-MoE style)
  kDeepSeekV3,       // sigmoid + correction bias, grouped top-k (DeepSeek-V3 / R1, Kimi-K2 style)
};

// "softmax_topk", "deepseek_v3".
const char* to_string(RouterKind kind);

struct RouterConfig {
  RouterKind kind = RouterKind::kSoftmaxTopK;
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // k
  int64_t n_group = 1;      // groups of E / n_group contiguous experts (kDeepSeekV3)
  int64_t topk_group = 1;   // groups kept per token (kDeepSeekV3)
  bool renormalize = true;  // divide the k weights by their sum
  double routed_scaling_factor = 1.0;  // multiplies every weight (DeepSeek-V3: 2.5)

  // Rules: num_experts >= 1; top_k in [1, num_experts]; n_group >= 1 and divides num_experts;
  // topk_group in [1, n_group]; routed_scaling_factor finite and > 0 (also as fp32);
  // kSoftmaxTopK: n_group == 1;
  // kDeepSeekV3: num_experts / n_group >= 2 when n_group > 1 (a group scores its top-2), and
  // top_k <= topk_group * (num_experts / n_group) (the kept groups hold enough experts).
  Status validate() const;
  // "RouterConfig(kind=deepseek_v3, num_experts=256, top_k=8, n_group=8, topk_group=4,
  //  renormalize=true, routed_scaling_factor=2.5)".
  std::string to_string() const;
};

Status route(const RouterConfig& cfg, const float* logits, const float* correction_bias,
             int64_t num_tokens, int32_t* topk_ids, float* topk_weights);

}  // namespace megamoe
