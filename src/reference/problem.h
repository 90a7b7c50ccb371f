// Random MoE problems for the reference tests, the GPU tests and the `megamoe` tool.
//
// A problem is the whole EP group's view: all experts' weights (fp32) and every rank's inputs.
// Data is never zero or constant: x ~ N(0, 1) rounded to bf16, weights ~ N(0, 1) / sqrt(K) (K the
// reduction dimension, so FC outputs stay O(1)), routing weights positive and normalised over a
// token's kept slots. The generator is self-contained (splitmix64 + Box-Muller), so a seed gives the
// same problem on every platform, and rank r's inputs depend only on (seed, r, its token count).
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/weights.h"

namespace megamoe {
namespace reference {

enum class Routing {
  kUniform,       // k distinct experts per token, uniformly at random
  kSingleExpert,  // slot 0 = expert E-1 (owned by the last rank) for every token, other slots -1
  kWithDropped,   // kUniform, then each slot dropped (-1) with probability 1/4, and about one
                  // token in 8 with every slot dropped
};
const char* to_string(Routing routing);

struct RankInputs {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x_bf16;      // [T, H]
  std::vector<int32_t> topk_ids;     // [T, k]
  std::vector<float> topk_weights;   // [T, k]; dropped slots hold a positive weight that must be ignored
};

struct MoeProblem {
  MoeGeometry geometry;              // ep_size ranks; ep_rank is meaningless here
  std::vector<float> w13, w2;        // all experts, fp32: [E, 2I, H] and [E, H, I]
  std::vector<RankInputs> ranks;     // [ep_size]
};

// tokens_per_rank: one entry per rank (geometry.ep_size entries), each in [0, max_tokens_per_rank].
MoeProblem make_random_problem(const MoeGeometry& g, uint64_t seed, const std::vector<int64_t>& tokens_per_rank,
                               Routing routing = Routing::kUniform);

// fp32 views of rank `rank`'s expert slice of the problem's weights (the problem must outlive them;
// the views are only read).
MoeWeights local_weights(const MoeProblem& problem, int64_t rank);

}  // namespace reference
}  // namespace megamoe
