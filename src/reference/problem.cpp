#include "reference/problem.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <system_error>
#include <thread>

#include "megamoe/formats.h"

namespace megamoe {
namespace reference {
namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // splitmix64's increment
// Below this many elements per thread a thread costs more than it saves.
constexpr int64_t kMinElemsPerThread = int64_t{1} << 16;

// The splitmix64 finaliser: output n of a splitmix64 generator seeded with s is mix64(s + (n+1) * kGamma),
// so any output can be computed directly from its counter.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint64_t counter_bits(uint64_t key, uint64_t counter) { return mix64(key + (counter + 1) * kGamma); }
// Uniform in (0, 1).
inline double to_uniform(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

// Sequential splitmix64 (the routing draws).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_ += kGamma); }
  double uniform() { return to_uniform(next()); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

// The streams of one seed: a domain and an index within it (an expert, a rank).
enum StreamDomain : uint64_t { kW13 = 0, kW2 = 1, kX = 2, kRouting = 3 };
uint64_t stream_key(uint64_t seed, StreamDomain domain, int64_t index) {
  const uint64_t h = mix64(mix64(seed ^ 0x6A09E667F3BCC909ull) + (static_cast<uint64_t>(domain) + 1) * kGamma);
  return mix64(h + (static_cast<uint64_t>(index) + 1) * 0xD1B54A32D192ED03ull);
}

// Elements [begin, end) of the N(0, scale^2) stream `key` into out[0, end - begin), by Marsaglia's
// polar method on pairs: element i belongs to pair p = i / 2 (even i its first value, odd i its
// second). Attempt a of pair p draws u, v uniform in (-1, 1) from counters 2p and 2p + 1 of key_a
// (key_0 = key, key_a+1 = mix64(key_a ^ kRetry)); it is accepted when s = u^2 + v^2 < 1 (probability
// pi/4), giving (u, v) * sqrt(-2 ln(s) / s). invariant: element i depends only on (key, i).
void fill_normal(uint64_t key, double scale, int64_t begin, int64_t end, float* out) {
  constexpr uint64_t kRetry = 0x5851F42D4C957F2Dull;
  auto pair = [&](int64_t p, double* a, double* b) {
    uint64_t k = key;
    while (true) {
      const double u = 2.0 * to_uniform(counter_bits(k, 2 * p)) - 1.0;  // never 0: an odd multiple of 2^-53
      const double v = 2.0 * to_uniform(counter_bits(k, 2 * p + 1)) - 1.0;
      const double s = u * u + v * v;
      if (s < 1.0) {
        const double f = std::sqrt(-2.0 * std::log(s) / s) * scale;
        *a = u * f;
        *b = v * f;
        return;
      }
      k = mix64(k ^ kRetry);
    }
  };
  double a = 0, b = 0;
  int64_t i = begin;
  if (i < end && (i & 1)) {
    pair(i / 2, &a, &b);
    *out++ = static_cast<float>(b);
    ++i;
  }
  for (; i + 1 < end; i += 2) {
    pair(i / 2, &a, &b);
    *out++ = static_cast<float>(a);
    *out++ = static_cast<float>(b);
  }
  if (i < end) {
    pair(i / 2, &a, &b);
    *out = static_cast<float>(a);
  }
}

int resolve_threads(int requested, int64_t work) {
  const int64_t wanted = requested > 0 ? requested : default_generate_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, work / kMinElemsPerThread)));
}

// fn(begin, end) over [0, n) cut into num_threads contiguous ranges, one thread each; the calling
// thread takes the first range and any range whose thread could not start.
void parallel_ranges(int64_t n, int num_threads, const std::function<void(int64_t, int64_t)>& fn) {
  auto range = [&](int t) { return std::make_pair(n * t / num_threads, n * (t + 1) / num_threads); };
  std::vector<std::thread> threads;
  std::vector<int> inline_ranges = {0};
  for (int t = 1; t < num_threads; ++t) {
    try {
      threads.emplace_back([&fn, r = range(t)] { fn(r.first, r.second); });
    } catch (const std::system_error&) {
      inline_ranges.push_back(t);
    }
  }
  for (int t : inline_ranges) fn(range(t).first, range(t).second);
  for (std::thread& th : threads) th.join();
}

// One stream written to out[0, count).
struct Segment {
  uint64_t key;
  double scale;
  int64_t count;
  float* out;
};

// All segments' elements, as one index space split evenly among the threads.
void fill_segments(const std::vector<Segment>& segments, int num_threads) {
  std::vector<int64_t> start(segments.size() + 1, 0);
  for (size_t i = 0; i < segments.size(); ++i) start[i + 1] = start[i] + segments[i].count;
  const int64_t total = start.back();
  parallel_ranges(total, resolve_threads(num_threads, total), [&](int64_t lo, int64_t hi) {
    size_t s = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; s < segments.size() && start[s] < hi; ++s) {
      const int64_t b = std::max(lo, start[s]) - start[s], e = std::min(hi, start[s + 1]) - start[s];
      if (b < e) fill_normal(segments[s].key, segments[s].scale, b, e, segments[s].out + b);
    }
  });
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

int default_generate_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw, 1, kMaxGenerateThreads));
}

MoeWeights ExpertWeights::view() const {
  const int64_t n = num_experts, H = hidden, I = intermediate;
  MoeWeights w;
  // TensorView has no const form; prepare_weights only reads the views.
  w.w13 = TensorView(const_cast<float*>(w13.data()), DType::kFloat32, {n, 2 * I, H});
  w.w2 = TensorView(const_cast<float*>(w2.data()), DType::kFloat32, {n, H, I});
  return w;
}

ExpertWeights make_expert_weights(const MoeGeometry& g, uint64_t seed, int64_t first_expert, int64_t num_experts,
                                  int num_threads) {
  ExpertWeights w;
  const int64_t H = g.hidden, I = g.intermediate;
  w.first_expert = first_expert;
  w.num_experts = num_experts;
  w.hidden = H;
  w.intermediate = I;
  w.w13.resize(static_cast<size_t>(num_experts * 2 * I * H));
  w.w2.resize(static_cast<size_t>(num_experts * H * I));
  const double w13_scale = 1.0 / std::sqrt(static_cast<double>(H)), w2_scale = 1.0 / std::sqrt(static_cast<double>(I));
  std::vector<Segment> segments;
  for (int64_t e = 0; e < num_experts; ++e)
    segments.push_back({stream_key(seed, kW13, first_expert + e), w13_scale, 2 * I * H, w.w13.data() + e * 2 * I * H});
  for (int64_t e = 0; e < num_experts; ++e)
    segments.push_back({stream_key(seed, kW2, first_expert + e), w2_scale, H * I, w.w2.data() + e * H * I});
  fill_segments(segments, num_threads);
  return w;
}

ExpertWeights make_rank_weights(const MoeGeometry& g, uint64_t seed, int64_t rank, int num_threads) {
  const int64_t El = g.experts_per_rank();
  return make_expert_weights(g, seed, rank * El, El, num_threads);
}

RankInputs make_rank_inputs(const MoeGeometry& g, uint64_t seed, int64_t rank, int64_t num_tokens, Routing routing,
                            int num_threads) {
  const int64_t E = g.num_experts, H = g.hidden, k = g.top_k, T = num_tokens;
  RankInputs in;
  in.num_tokens = T;
  in.x_bf16.resize(static_cast<size_t>(T * H));
  const uint64_t x_key = stream_key(seed, kX, rank);
  parallel_ranges(T * H, resolve_threads(num_threads, T * H), [&](int64_t lo, int64_t hi) {
    float chunk[1024];
    for (int64_t b = lo; b < hi; b += 1024) {
      const int64_t e = std::min<int64_t>(hi, b + 1024);
      fill_normal(x_key, 1.0, b, e, chunk);
      for (int64_t i = b; i < e; ++i) in.x_bf16[i] = fmt::float_to_bf16(chunk[i - b]);
    }
  });

  Rng rng(stream_key(seed, kRouting, rank));
  std::vector<int32_t> scratch;
  in.topk_ids.assign(static_cast<size_t>(T * k), -1);
  in.topk_weights.resize(static_cast<size_t>(T * k));
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
  return in;
}

MoeProblem make_random_problem(const MoeGeometry& g, uint64_t seed, const std::vector<int64_t>& tokens_per_rank,
                               Routing routing) {
  MoeProblem p;
  p.geometry = g;
  ExpertWeights all = make_expert_weights(g, seed, 0, g.num_experts);
  p.w13 = std::move(all.w13);
  p.w2 = std::move(all.w2);
  p.ranks.reserve(tokens_per_rank.size());
  for (size_t r = 0; r < tokens_per_rank.size(); ++r)
    p.ranks.push_back(make_rank_inputs(g, seed, static_cast<int64_t>(r), tokens_per_rank[r], routing));
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
