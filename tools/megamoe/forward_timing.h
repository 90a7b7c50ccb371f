// Timed forwards of one built group of layers with every rank in lockstep, for `megamoe bench` and
// `megamoe tune`: each rank's input sets staged on its device, then per forward: a barrier, the L2
// flush (bench_harness.h) and a stream synchronisation outside the timed region, a second barrier,
// the forward between CUDA events on the rank's stream (the cpu backend: the host clock), the
// synchronisation and error check after it (outside the number).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "bench_harness.h"
#include "ranks.h"
#include "reference/problem.h"

namespace megamoe::tool {

// Every rank's input sets of one case: [rank][set], empty for ranks another process runs.
using CaseIo = std::vector<std::vector<std::unique_ptr<RankIo>>>;

// Input set s of rank r is tokens [s*T, (s+1)*T) of inputs[r] (which must hold sets * T tokens),
// staged on rank r's layer device. Errors name the rank.
Status stage_case_io(const ProcessRanks& pr, const RankGroup& group, const std::vector<reference::RankInputs>& inputs,
                     int64_t tokens, int64_t sets, CaseIo* io);

struct LockstepOptions {
  int64_t warmup = 0, iters = 1;
  FlushMode flush = FlushMode::kMemset;
  // Called on the first local rank's thread after each forward (forwards done, of warmup + iters).
  std::function<void(int64_t done, int64_t total)> progress;
  // Called on every rank's thread after each checked forward (e.g. to read its stage times).
  std::function<Status(int64_t rank, int64_t forward)> after_forward;
  // Tests: the time of forward `forward` (0-based over warmup + iters) on `rank`, in place of the
  // measured one; the forward still runs.
  std::function<double(int64_t rank, int64_t forward)> sample_us;
  // In place of io's forward of the group's layer (the timed region), on the rank's timing stream:
  // e.g. a CUDA graph of several layers' forwards (`bench --layers N`).
  std::function<Status(int64_t rank, int64_t forward, void* stream)> run_forward;
};

struct LockstepTimes {
  using Clock = std::chrono::steady_clock;
  bool on_gpu = false;
  int64_t warmup = 0;
  // [rank][forward], warmup + iters forwards; ranks this process does not run stay empty.
  std::vector<std::vector<double>> us;  // the rank's time: CUDA events (GPU), host wall (cpu), or sample_us
  std::vector<std::vector<Clock::time_point>> start, end;  // host clock around each forward

  // Per timed forward, the slowest rank: the largest `us` among this process's ranks on a GPU
  // backend (its kernels include the waits for its peers), on the cpu backend the wall time from the
  // first rank's start to the last rank's end (`us` when sample_us replaced it).
  std::vector<double> slowest_per_forward(bool sampled) const;
  // Per rank this process runs, the median of its timed forwards' `us` (-1 for the others).
  std::vector<double> rank_medians() const;
};

// Runs warmup + iters forwards of `group` over `io` (input set it % sets) with all of this process's
// ranks in lockstep. Every rank runs every forward until one fails; then all stop after the same
// barrier and the most telling error (run_on_ranks) is returned, naming the rank.
Status time_lockstep_forwards(const ProcessRanks& pr, RankGroup& group, CaseIo& io, const LockstepOptions& options,
                              LockstepTimes* out);

}  // namespace megamoe::tool
