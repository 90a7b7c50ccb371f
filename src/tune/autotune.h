// The search of `megamoe tune` (tools/megamoe/tune_cmd.cpp): which knobs each backend reads and their
// legal values for a geometry and token bucket, the candidates of each search stage, the score of a
// candidate (the slowest rank's), the winner of a stage, and the mega/routed crossover. Pure host
// code: the tool builds the layers and times the candidates through the `measure` callback.
//
// Contract:
// - A Candidate is one configuration of one backend: its Knobs (changed in place by
//   MoeLayer::set_knobs) and its owner_reduce (a new layer: it changes the workspace). All zero /
//   kAuto is the heuristic, and every search starts from it.
// - knob_spaces() lists every knob of every backend, in search order (stage by stage). It is the
//   extension point: a backend's new knob is one KnobSpace here (plus, for a Knobs field, its line in
//   knob_fields() and its rule in Knobs::validate()); run_search() and the tool need nothing else.
// - A stage's candidates: the stage's base (the best of the stages before) first, then every other
//   combination of the stage's knobs' legal values, each knob also at the base's value; the order
//   depends only on (base, stage, context), so every rank enumerates the same list.
// - pick_winner keeps the base unless a candidate is at least `min_gain` faster (noise does not
//   move the choice), and never picks a failed candidate (score < 0).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/types.h"

namespace megamoe::tune {

// What the search knows of one bucket.
struct TuneContext {
  MoeGeometry geometry;  // max_tokens_per_rank = the bucket
  MoeConfig config;      // the formats and flags; its knobs are not read
  Backend backend = Backend::kRouted;
  int num_sms = 132;     // of the device
};

struct Candidate {
  Backend backend = Backend::kRouted;
  Knobs knobs;
  OwnerReduce owner_reduce = OwnerReduce::kAuto;  // kAuto: the config's resolution

  // "heuristic", or the knobs that differ from it: "block_m=64 block_n=256 owner_reduce=on".
  std::string label() const;
  bool operator==(const Candidate& o) const {
    return backend == o.backend && knobs == o.knobs && owner_reduce == o.owner_reduce;
  }
  bool operator!=(const Candidate& o) const { return !(*this == o); }
};

// The heuristic of `backend`: every knob 0, owner_reduce auto.
Candidate heuristic(Backend backend);

struct KnobSpace {
  std::string name;               // the knob cache's field name
  std::vector<Backend> backends;  // the backends that read it
  bool rebuild = false;           // a new layer (else MoeLayer::set_knobs)
  int stage = 0;                  // knobs of one stage are searched together (Search::kStaged)
  // The legal values other than the heuristic's (0 / auto) for a candidate `base` in `ctx`.
  std::function<std::vector<int32_t>(const TuneContext& ctx, const Candidate& base)> values;
  std::function<int32_t(const Candidate&)> get;
  std::function<void(Candidate*, int32_t)> set;
  // The value as the cache and --dry-run print it (owner_reduce: off / on).
  std::function<std::string(int32_t)> value_name;
};

const std::vector<KnobSpace>& knob_spaces();
// The knobs `backend` reads, in search order; restricted to `names` when not empty (a name that is
// no knob of the backend is an error naming it and the backend's knobs).
Status spaces_for(Backend backend, const std::vector<std::string>& names, std::vector<const KnobSpace*>* out);

enum class Search { kStaged, kExhaustive };
Status parse_search(const std::string& text, Search* out);  // "staged" | "exhaustive"
// Staged: one stage per KnobSpace::stage, in order; exhaustive: one stage of every knob.
std::vector<std::vector<const KnobSpace*>> search_stages(const std::vector<const KnobSpace*>& spaces, Search search);

std::vector<Candidate> stage_candidates(const Candidate& base, const std::vector<const KnobSpace*>& stage,
                                        const TuneContext& ctx);

// The score of a candidate: the slowest rank's median time. Entries < 0 are ranks this process does
// not run and are skipped; -1 when there is none.
double slowest_rank_score(const std::vector<double>& rank_medians);

// Index 0 (the base) unless some candidate scores at least min_gain (a fraction) below it: then the
// smallest score's. A failed candidate (score < 0) never wins; a failed base loses to any success.
size_t pick_winner(const std::vector<double>& scores, double min_gain);

struct StageResult {
  std::vector<Candidate> candidates;
  std::vector<double> scores;  // µs, the slowest rank's; < 0: the candidate failed
  size_t winner = 0;
};
struct SearchResult {
  Candidate best;
  double best_us = -1;
  std::vector<StageResult> stages;
};

// Times the candidates of one stage (all of them, interleaved, in this order on every rank) and
// fills one score per candidate.
using MeasureFn = std::function<Status(const std::vector<Candidate>&, std::vector<double>* scores)>;

// The staged search of one backend at one bucket: each stage's candidates from the previous
// stage's winner, measured, the winner kept. A stage whose knobs have no legal values is skipped.
// Last, a winner other than the heuristic is timed beside it (one more stage of two candidates) and
// kept only if it is min_gain faster there; else the heuristic is the result.
Status run_search(const TuneContext& ctx, const std::vector<std::vector<const KnobSpace*>>& stages, double min_gain,
                  const MeasureFn& measure, SearchResult* out);

// The best time of each backend at one bucket (< 0: not measured).
struct BucketTimes {
  int64_t tokens = 0;
  double routed_us = -1, mega_us = -1;
};
// The crossover over the buckets (any order): the largest bucket at which mega was faster than
// routed there and at every smaller bucket; kMegaNever (megamoe/knobs.h) when routed was faster at
// the smallest; 0 when a bucket lacks either time.
int64_t mega_crossover(std::vector<BucketTimes> buckets);

}  // namespace megamoe::tune
