#include "reference/problem.h"

#include <cmath>
#include <numeric>

#include "megamoe/formats.h"

namespace megamoe {
namespace reference {
namespace {

// splitmix64: a tiny, well-mixed generator whose output does not depend on the standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(kTwoPi * uniform());
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

uint64_t stream_seed(uint64_t seed, uint64_t stream) {
  Rng mix(seed ^ (0xD1B54A32D192ED03ull * (stream + 1)));
  return mix.next();
}

void fill_normal(Rng& rng, double scale, std::vector<float>* out) {
  for (float& v : *out) v = static_cast<float>(rng.normal() * scale);
}

// k distinct experts out of E (partial Fisher-Yates).
void pick_distinct(Rng& rng, int64_t num_experts, int64_t k, std::vector<int32_t>& scratch, int32_t* out) {
  scratch.resize(num_experts);
  std::iota(scratch.begin(), scratch.end(), 0);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t pick = j + rng.below(num_experts - j);
    std::swap(scratch[j], scratch[pick]);
    out[j] = scratch[j];
  }
}

}  // namespace

const char* to_string(Routing routing) {
  switch (routing) {
    case Routing::kUniform: return "uniform";
    case Routing::kSingleExpert: return "single_expert";
    case Routing::kWithDropped: return "with_dropped";
  }
  return "?";
}

MoeProblem make_random_problem(const MoeGeometry& g, uint64_t seed, const std::vector<int64_t>& tokens_per_rank,
                               Routing routing) {
  MoeProblem p;
  p.geometry = g;
  const int64_t E = g.num_experts, H = g.hidden, I = g.intermediate, k = g.top_k;
  Rng weight_rng(stream_seed(seed, 0));
  p.w13.resize(E * 2 * I * H);
  p.w2.resize(E * H * I);
  fill_normal(weight_rng, 1.0 / std::sqrt(static_cast<double>(H)), &p.w13);
  fill_normal(weight_rng, 1.0 / std::sqrt(static_cast<double>(I)), &p.w2);

  std::vector<int32_t> scratch;
  p.ranks.resize(tokens_per_rank.size());
  for (size_t r = 0; r < tokens_per_rank.size(); ++r) {
    Rng rng(stream_seed(seed, 1 + r));
    RankInputs& in = p.ranks[r];
    const int64_t T = tokens_per_rank[r];
    in.num_tokens = T;
    in.x_bf16.resize(T * H);
    for (uint16_t& v : in.x_bf16) v = fmt::float_to_bf16(static_cast<float>(rng.normal()));
    in.topk_ids.assign(T * k, -1);
    in.topk_weights.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
      int32_t* ids = in.topk_ids.data() + t * k;
      float* w = in.topk_weights.data() + t * k;
      if (routing == Routing::kSingleExpert) {
        ids[0] = static_cast<int32_t>(E - 1);
      } else {
        pick_distinct(rng, E, k, scratch, ids);
        if (routing == Routing::kWithDropped) {
          const bool drop_all = rng.below(8) == 0;
          for (int64_t j = 0; j < k; ++j)
            if (drop_all || rng.below(4) == 0) ids[j] = -1;
        }
      }
      // Positive weights, normalised over the kept slots; dropped slots keep a raw positive value
      // so that a backend that wrongly uses them shows it.
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        w[j] = static_cast<float>(0.25 + 0.75 * rng.uniform());
        if (ids[j] != -1) sum += w[j];
      }
      for (int64_t j = 0; j < k; ++j)
        if (ids[j] != -1) w[j] = static_cast<float>(w[j] / sum);
    }
  }
  return p;
}

MoeWeights local_weights(const MoeProblem& problem, int64_t rank) {
  const MoeGeometry& g = problem.geometry;
  const int64_t El = g.experts_per_rank(), H = g.hidden, I = g.intermediate;
  MoeWeights w;
  // The views are read-only in practice (prepare_weights reads them); TensorView has no const form.
  w.w13 = TensorView(const_cast<float*>(problem.w13.data()) + rank * El * 2 * I * H, DType::kFloat32, {El, 2 * I, H});
  w.w2 = TensorView(const_cast<float*>(problem.w2.data()) + rank * El * H * I, DType::kFloat32, {El, H, I});
  return w;
}

}  // namespace reference
}  // namespace megamoe
