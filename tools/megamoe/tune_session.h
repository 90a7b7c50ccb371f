// The layers behind `megamoe tune` at one bucket: a group per owner-reduce setting its candidates
// need, each candidate timed in lockstep on every rank (MoeLayer::set_knobs between candidates), and
// the winner's output checked against the float64 reference (tune.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "forward_timing.h"
#include "kept_weights.h"
#include "reference_check.h"
#include "tune.h"

namespace megamoe::tool {

// The choices every process of a launched tune makes alike (tune.h). Each goes through `max`, the
// largest of every process's value (ProcessMax, or a test's stand-in), which every process calls the
// same number of times in the same order; empty (one process): every call is the identity.
struct ProcessAgreement {
  std::function<Status(double* value)> max;

  Status largest(double* value) const { return max ? max(value) : Status::ok(); }
  // *flag becomes true everywhere when it is true on any process.
  Status any(bool* flag) const;
  // Every process's `fingerprint` must be the same; an error naming `what` otherwise (processes that
  // went on would pair unrelated collective steps).
  Status same(uint64_t fingerprint, const std::string& what) const;
};

// A 52-bit FNV-1a hash of `text` (a double holds it exactly: ProcessAgreement::same).
uint64_t fingerprint(const std::string& text);

// What every bucket shares: the ranks of this process, the inputs, the kept weights, the timing.
struct TuneShared {
  const TuneHooks* hooks = nullptr;
  ProcessRanks* ranks = nullptr;
  const std::vector<reference::RankInputs>* inputs = nullptr;  // every rank's, max bucket * sets tokens
  int64_t sets = 2;
  uint64_t seed = 1;
  int64_t warmup = 2, iters = 10, reps = 3;
  int64_t verify_tokens = 8;
  KeptWeights kept;
  // Called once per candidate timing (for the progress line).
  std::function<void(const std::string& what)> on_timing;
  ProcessAgreement processes;
};

// The outcome of checking one candidate's output.
struct VerifyResult {
  bool pass = false;
  double rel_l2 = 0, bound = 0;
  int64_t tokens = 0;   // tokens compared, over this process's ranks
  std::string detail;   // a failure's cause
};

class BucketLayers {
 public:
  // backend: the backend whose candidates run (its stand-in's layers where the hooks name one).
  BucketLayers(TuneShared* shared, const MoeGeometry& g, const MoeConfig& c, Backend backend)
      : shared_(shared), geometry_(g), config_(c), backend_(backend) {}
  BucketLayers(const BucketLayers&) = delete;
  BucketLayers& operator=(const BucketLayers&) = delete;

  // Times the candidates, interleaved `reps` times; scores[i] = the slowest rank's median of
  // candidate i's timed forwards (launched: over every process), -1 where its knobs were refused
  // (launched: by any process). Launched, every process must pass the same candidates.
  Status measure(const std::vector<tune::Candidate>& candidates, std::vector<double>* scores);
  // Runs one forward of `candidate` on input set 0 and compares --verify-tokens tokens of every rank
  // with the float64 reference (launched: every process must pass).
  Status verify(const tune::Candidate& candidate, VerifyResult* out);

 private:
  struct Group {
    RankGroup layers;
    CaseIo io;
  };
  Status group_for(const tune::Candidate& candidate, Group** out);
  Status set_knobs(Group& group, const tune::Candidate& candidate);
  Status time_candidate(Group& group, const tune::Candidate& candidate, std::vector<std::vector<double>>* samples);
  Status read_forward(Group& group, std::vector<std::vector<uint16_t>>* y);
  ExpertWeightsFn expert_weights(const Group& group, const MoeConfig& c) const;
  MoeConfig config_of(const tune::Candidate& candidate) const;

  TuneShared* shared_;
  MoeGeometry geometry_;
  MoeConfig config_;
  Backend backend_;
  std::map<OwnerReduce, std::unique_ptr<Group>> groups_;
};

}  // namespace megamoe::tool
