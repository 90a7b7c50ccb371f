// Random MoE problems for the reference tests, the GPU tests and the `megamoe` tool.
//
// A problem is the whole EP group's view: all experts' weights (fp32) and every rank's inputs.
// Data is never zero or constant: x ~ N(0, 1) rounded to bf16, weights ~ N(0, 1) / sqrt(K) (K the
// reduction dimension, so FC outputs stay O(1)), routing weights positive and normalised over a
// token's kept slots. The generator is self-contained (counter-based splitmix64 + Marsaglia's polar method), so a
// seed gives the same problem on every platform.
//
// Every weight matrix of every expert is its own stream, keyed by (seed, global expert id, matrix),
// and element i of a stream depends only on (key, i): an expert's weights are the same whichever
// slice of experts, EP size or thread count generates them (EP1 and EP2 runs of one seed compare),
// and a rank can generate just its own slice, on many threads. Likewise rank r's x and routing depend
// only on (seed, r), token t's on nothing after it (T tokens are a prefix of T' > T tokens).
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

// fp32 weights of the global experts [first_expert, first_expert + num_experts).
struct ExpertWeights {
  int64_t first_expert = 0, num_experts = 0, hidden = 0, intermediate = 0;
  std::vector<float> w13, w2;  // [num_experts, 2I, H] and [num_experts, H, I]

  // Views of w13 and w2 as MoeWeights (for MoeLayer::create when this is one rank's slice); read
  // only in practice, valid while this object lives.
  MoeWeights view() const;
};

// Generator threads when a call is given num_threads <= 0: std::thread::hardware_concurrency(),
// capped at kMaxGenerateThreads (at least 1).
constexpr int kMaxGenerateThreads = 64;
int default_generate_threads();

// The weights of experts [first_expert, first_expert + num_experts) of geometry g (hidden,
// intermediate and num_experts are used), on up to num_threads threads (fewer for small slices).
ExpertWeights make_expert_weights(const MoeGeometry& g, uint64_t seed, int64_t first_expert, int64_t num_experts,
                                  int num_threads = 0);
// Rank `rank`'s slice: experts [rank * E / R, (rank + 1) * E / R).
ExpertWeights make_rank_weights(const MoeGeometry& g, uint64_t seed, int64_t rank, int num_threads = 0);

// Rank `rank`'s inputs: num_tokens tokens (x on up to num_threads threads).
RankInputs make_rank_inputs(const MoeGeometry& g, uint64_t seed, int64_t rank, int64_t num_tokens,
                            Routing routing = Routing::kUniform, int num_threads = 0);

// tokens_per_rank: one entry per rank (geometry.ep_size entries), each in [0, max_tokens_per_rank].
// The weights are make_expert_weights(g, seed, 0, E), rank r's inputs make_rank_inputs(g, seed, r, ...).
MoeProblem make_random_problem(const MoeGeometry& g, uint64_t seed, const std::vector<int64_t>& tokens_per_rank,
                               Routing routing = Routing::kUniform);

// fp32 views of rank `rank`'s expert slice of the problem's weights (the problem must outlive them;
// the views are only read).
MoeWeights local_weights(const MoeProblem& problem, int64_t rank);

}  // namespace reference
}  // namespace megamoe
