// `megamoe tune`: measured knobs per geometry and token bucket, written to the knob cache
// (megamoe/knobs.h), and the mega/routed crossover (docs/TOOL.md, "megamoe tune").
//
// Per bucket (a --tokens value: max_tokens_per_rank of the layers built for it) and backend: one
// group of layers per owner-reduce setting the search needs, built from the seed's weights (the
// first bucket generates them, the later ones reuse its prepared copy); the staged search of
// src/tune/autotune.h, each stage's candidates timed on every rank in lockstep, interleaved --reps
// times in the same order everywhere, each candidate's score the slowest rank's median; the winner
// checked against the float64 reference on --verify-tokens tokens of every rank before it is
// accepted; the bucket's entry written to the cache at once (atomically). The crossover of mega
// against routed is recorded on every entry of the geometry.
//
// Launched (one process per GPU), every process makes every choice alike, through ProcessAgreement
// (tune_session.h): the plan (flags, geometry, device) must be the same everywhere, a bucket is
// tuned when any process lacks its entry, a backend runs only where every process can run it, a
// candidate is refused when any process refuses it, its score is the largest over the processes and
// the winner passes its check only where it passes everywhere. So each process writes, and applies,
// the same knobs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "presets.h"
#include "tune/autotune.h"

namespace megamoe::tool {

struct TuneOptions {
  LayerOptions layer;  // --preset or --hidden/--intermediate/--experts/--top-k, --ep, formats
  std::string tokens = "1,8,128,1024,4096,8192";
  std::string backends = "routed";
  std::string knobs;             // empty: every knob of the backend
  std::string search = "staged";
  std::string iters, warmup;     // empty: 10 / 2 on a GPU, 3 / 1 on the cpu backend
  std::string reps = "3";
  std::string min_gain = "0.01";
  std::string cache;             // empty: MEGAMOE_KNOB_CACHE's file
  std::string seed = "1", routing = "uniform";
  std::string verify_tokens = "8";
  bool force = false, dry_run = false;
  std::string json, plot;
  MaxHostGbOption max_host_gb;
};

// For the tests (tests/cpu/test_tune.cpp); not on the command line.
struct TuneHooks {
  // The time of timed forward `forward` of `candidate` at `tokens` on `rank`, in place of the
  // measured one (the forward still runs).
  std::function<double(const tune::Candidate& candidate, int64_t tokens, int64_t rank, int64_t forward)> sample_us;
  // Candidates of backend B run on layers of backend stand_in[B] (the cpu backend standing in for
  // routed and mega on a machine without a GPU); the knobs searched stay B's.
  std::map<Backend, Backend> stand_in;
  // Stands in for the all-reduce over the launched processes (ProcessMax): the largest of every
  // process's *value. Set, several run_tune calls of one test (one per simulated process) agree
  // through it as launched processes do.
  std::function<Status(double* value)> max_over_processes;
};

// Runs `megamoe tune` (registered by add_tune_command, commands.h); throws ToolError like the other
// subcommands.
int run_tune(const TuneOptions& o, const TuneHooks& hooks = {});

}  // namespace megamoe::tool
