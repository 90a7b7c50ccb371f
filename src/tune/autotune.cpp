// See autotune.h.
#include "tune/autotune.h"

#include <algorithm>
#include <set>

#include "megamoe/knobs.h"

namespace megamoe::tune {
namespace {

int32_t Knobs::*member_of(const std::string& name) {
  for (const KnobField& f : knob_fields())
    if (name == f.name) return f.member;
  return nullptr;
}

// A Knobs field as a knob of `backends`: get and set through knob_fields().
KnobSpace knob_field(const char* name, std::vector<Backend> backends, int stage,
                     std::function<std::vector<int32_t>(const TuneContext&, const Candidate&)> values) {
  KnobSpace k;
  k.name = name;
  k.backends = std::move(backends);
  k.stage = stage;
  k.values = std::move(values);
  int32_t Knobs::*m = member_of(name);
  k.get = [m](const Candidate& c) { return c.knobs.*m; };
  k.set = [m](Candidate* c, int32_t v) { c->knobs.*m = v; };
  k.value_name = [](int32_t v) { return std::to_string(v); };
  return k;
}

bool routed_fp8(const TuneContext& ctx) { return ctx.config.weight_format == WeightFormat::kFp8Block; }

// The owner reduce a candidate runs with: its own setting, else the config's resolution.
bool uses_owner_reduce(const TuneContext& ctx, const Candidate& c) {
  MoeConfig cfg = ctx.config;
  if (c.owner_reduce != OwnerReduce::kAuto) cfg.owner_reduce = c.owner_reduce;
  return cfg.uses_owner_reduce();
}

std::vector<KnobSpace> make_spaces() {
  const std::vector<Backend> routed = {Backend::kRouted};
  std::vector<KnobSpace> s;
  // Stage 1, the GEMMs' tiles (both GEMMs; FC1's SwiGLU epilogue runs 256-wide tiles whatever
  // block_n says, so block_n moves FC2): 16- and 32-row tiles need fp8 weights; a width that does not
  // divide FC2's N = hidden is left to the heuristic by the layer, so it is no candidate.
  s.push_back(knob_field("block_m", routed, 1, [](const TuneContext& ctx, const Candidate&) {
    return routed_fp8(ctx) ? std::vector<int32_t>{16, 32, 64, 128} : std::vector<int32_t>{64, 128};
  }));
  s.push_back(knob_field("block_n", routed, 1, [](const TuneContext& ctx, const Candidate&) {
    std::vector<int32_t> v;
    for (int32_t bn : {128, 256})
      if (ctx.geometry.hidden % bn == 0) v.push_back(bn);
    return v;
  }));
  // Stage 2, clusters of 2 CTAs multicasting each weight tile: fp8 128 x 256 tiles only (a tile
  // left to the heuristic may be one).
  s.push_back(knob_field("gemm_cluster", routed, 2, [](const TuneContext& ctx, const Candidate& base) {
    const bool tiles = (base.knobs.block_m == 0 || base.knobs.block_m == 128) &&
                       (base.knobs.block_n == 0 || base.knobs.block_n == 256);
    return routed_fp8(ctx) && tiles ? std::vector<int32_t>{1, 2} : std::vector<int32_t>{1};
  }));
  // Stage 3, the order the persistent GEMM's CTAs take their tiles in: counter or round-robin.
  s.push_back(knob_field("gemm_tile_order", routed, 3,
                         [](const TuneContext&, const Candidate&) { return std::vector<int32_t>{1, 2}; }));
  // Stage 4, SMs of the persistent kernels (the GEMMs and the transport's copies).
  s.push_back(knob_field("num_sms", routed, 4, [](const TuneContext& ctx, const Candidate&) {
    std::vector<int32_t> v;
    for (double f : {15.0 / 16, 7.0 / 8, 3.0 / 4, 1.0 / 2}) {
      const int32_t n = static_cast<int32_t>(ctx.num_sms * f);
      if (n >= 1 && n < ctx.num_sms && std::find(v.begin(), v.end(), n) == v.end()) v.push_back(n);
    }
    return v;
  }));
  // Stage 5, the owner reduce (a new layer: it changes the workspace): the value the config's auto
  // does not pick, where the config leaves it to auto and allows it.
  KnobSpace owner;
  owner.name = "owner_reduce";
  owner.backends = routed;
  owner.rebuild = true;
  owner.stage = 5;
  owner.values = [](const TuneContext& ctx, const Candidate&) -> std::vector<int32_t> {
    if (ctx.config.owner_reduce != OwnerReduce::kAuto || ctx.config.in_kernel_fc2_reduce) return {};
    return {ctx.config.uses_owner_reduce() ? static_cast<int32_t>(OwnerReduce::kOff)
                                           : static_cast<int32_t>(OwnerReduce::kOn)};
  };
  owner.get = [](const Candidate& c) { return static_cast<int32_t>(c.owner_reduce); };
  owner.set = [](Candidate* c, int32_t v) { c->owner_reduce = static_cast<OwnerReduce>(v); };
  owner.value_name = [](int32_t v) { return std::string(to_string(static_cast<OwnerReduce>(v))); };
  s.push_back(owner);
  // Stage 6, recv-row groups of the one-kernel combine, where the layer runs it (a quantised wire, or
  // the owner reduce's sums): the reduce of a group overlaps the later groups' sends.
  s.push_back(knob_field("combine_groups", routed, 6, [](const TuneContext& ctx, const Candidate& base) {
    const bool send_and_combine = ctx.config.combine_dtype != CombineDtype::kBf16 || uses_owner_reduce(ctx, base);
    return send_and_combine ? std::vector<int32_t>{1, 2, 4, 8} : std::vector<int32_t>{};
  }));
  // The mega backend's knobs go here, with backends = {Backend::kMega}.
  return s;
}

}  // namespace

std::string Candidate::label() const {
  std::string out;
  for (const KnobSpace& k : knob_spaces()) {
    const int32_t v = k.get(*this);
    if (v == 0) continue;
    if (out.find(k.name + "=") != std::string::npos) continue;  // a knob two backends share
    out += (out.empty() ? "" : " ") + k.name + "=" + k.value_name(v);
  }
  return out.empty() ? "heuristic" : out;
}

Candidate heuristic(Backend backend) {
  Candidate c;
  c.backend = backend;
  return c;
}

const std::vector<KnobSpace>& knob_spaces() {
  static const std::vector<KnobSpace> spaces = make_spaces();
  return spaces;
}

Status spaces_for(Backend backend, const std::vector<std::string>& names, std::vector<const KnobSpace*>* out) {
  out->clear();
  std::string known;
  for (const KnobSpace& k : knob_spaces()) {
    if (std::find(k.backends.begin(), k.backends.end(), backend) == k.backends.end()) continue;
    known += (known.empty() ? "" : ", ") + k.name;
    if (names.empty() || std::find(names.begin(), names.end(), k.name) != names.end()) out->push_back(&k);
  }
  for (const std::string& n : names) {
    bool found = false;
    for (const KnobSpace* k : *out) found = found || k->name == n;
    if (!found)
      return invalid_argument("tune", "knobs", n,
                              std::string("is no knob of the ") + to_string(backend) + " backend (its knobs: " +
                                  (known.empty() ? "none" : known) + ")");
  }
  return Status::ok();
}

Status parse_search(const std::string& text, Search* out) {
  if (text == "staged") *out = Search::kStaged;
  else if (text == "exhaustive") *out = Search::kExhaustive;
  else return invalid_argument("tune", "search", text, "must be staged or exhaustive");
  return Status::ok();
}

std::vector<std::vector<const KnobSpace*>> search_stages(const std::vector<const KnobSpace*>& spaces, Search search) {
  std::vector<std::vector<const KnobSpace*>> stages;
  if (spaces.empty()) return stages;
  if (search == Search::kExhaustive) return {spaces};
  for (const KnobSpace* k : spaces) {
    if (stages.empty() || stages.back().front()->stage != k->stage) stages.emplace_back();
    stages.back().push_back(k);
  }
  return stages;
}

std::vector<Candidate> stage_candidates(const Candidate& base, const std::vector<const KnobSpace*>& stage,
                                        const TuneContext& ctx) {
  std::vector<Candidate> out = {base};
  // Odometer over the stage's knobs, each at the base's value or one of its legal values. A knob's
  // values are those for the partial candidate built so far (the knobs before it in the stage set).
  std::function<void(size_t, Candidate)> expand = [&](size_t i, Candidate c) {
    if (i == stage.size()) {
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
      return;
    }
    const KnobSpace& k = *stage[i];
    expand(i + 1, c);  // at the base's value
    for (int32_t v : k.values(ctx, c)) {
      if (v == k.get(base)) continue;
      Candidate next = c;
      k.set(&next, v);
      expand(i + 1, next);
    }
  };
  expand(0, base);
  return out;
}

double slowest_rank_score(const std::vector<double>& rank_medians) {
  double slowest = -1;
  for (double us : rank_medians)
    if (us >= 0) slowest = std::max(slowest, us);
  return slowest;
}

size_t pick_winner(const std::vector<double>& scores, double min_gain) {
  if (scores.empty()) return 0;
  size_t best = 0;
  for (size_t i = 1; i < scores.size(); ++i)
    if (scores[i] >= 0 && (scores[best] < 0 || scores[i] < scores[best])) best = i;
  if (best == 0 || scores[0] < 0) return best;
  return scores[best] <= scores[0] * (1.0 - min_gain) ? best : 0;
}

Status run_search(const TuneContext& ctx, const std::vector<std::vector<const KnobSpace*>>& stages, double min_gain,
                  const MeasureFn& measure, SearchResult* out) {
  *out = SearchResult();
  out->best.backend = ctx.backend;
  for (const std::vector<const KnobSpace*>& stage : stages) {
    StageResult r;
    r.candidates = stage_candidates(out->best, stage, ctx);
    if (r.candidates.size() == 1 && out->best_us >= 0) continue;  // nothing to try: the base stands
    MEGAMOE_RETURN_IF_ERROR(measure(r.candidates, &r.scores));
    if (r.scores.size() != r.candidates.size())
      return Status(StatusCode::kInternal, "tune: " + std::to_string(r.scores.size()) + " scores for " +
                                               std::to_string(r.candidates.size()) + " candidates");
    r.winner = pick_winner(r.scores, min_gain);
    out->best = r.candidates[r.winner];
    out->best_us = r.scores[r.winner];
    out->stages.push_back(std::move(r));
  }
  // The head-to-head: the stages each compare against their own base, timed in their own runs, so
  // a chain of noise-sized wins can end slower than the heuristic. The winner is kept only if it
  // beats the heuristic by min_gain when both are timed together (interleaved, as a stage).
  const Candidate h = heuristic(ctx.backend);
  if (!out->stages.empty() && !(out->best == h)) {
    StageResult r;
    r.candidates = {h, out->best};
    MEGAMOE_RETURN_IF_ERROR(measure(r.candidates, &r.scores));
    if (r.scores.size() != r.candidates.size())
      return Status(StatusCode::kInternal, "tune: " + std::to_string(r.scores.size()) + " scores for 2 candidates");
    r.winner = pick_winner(r.scores, min_gain);
    out->best = r.candidates[r.winner];
    out->best_us = r.scores[r.winner];
    out->stages.push_back(std::move(r));
  }
  if (stages.empty()) {  // a backend without knobs: the heuristic, timed
    StageResult r;
    r.candidates = {out->best};
    MEGAMOE_RETURN_IF_ERROR(measure(r.candidates, &r.scores));
    out->best_us = r.scores.empty() ? -1 : r.scores[0];
    out->stages.push_back(std::move(r));
  }
  return Status::ok();
}

int64_t mega_crossover(std::vector<BucketTimes> buckets) {
  if (buckets.empty()) return 0;
  std::sort(buckets.begin(), buckets.end(), [](const BucketTimes& a, const BucketTimes& b) { return a.tokens < b.tokens; });
  int64_t threshold = kMegaNever;
  for (const BucketTimes& b : buckets) {
    if (b.routed_us < 0 || b.mega_us < 0) return 0;
  }
  for (const BucketTimes& b : buckets) {
    if (b.mega_us >= b.routed_us) break;
    threshold = b.tokens;
  }
  return threshold;
}

}  // namespace megamoe::tune
