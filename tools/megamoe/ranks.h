// Running one MoeLayer per EP rank inside this process: a host-thread group (the cpu backend's
// transport), one thread per rank for every collective call, and host<->device staging of a rank's
// inputs for layers that live on a CUDA device.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nccl.h>

#include "megamoe/comm.h"
#include "megamoe/layer.h"
#include "megamoe/status.h"
#include "megamoe/weights.h"

namespace megamoe::tool {

// Runs fn(rank) for rank in [0, n), each in its own thread, and joins them. Returns the most telling
// error: the first (by rank) that is not a timeout or group abort, else the first error, else ok.
// An exception inside fn becomes kInternal naming the rank.
Status run_on_ranks(int64_t n, const std::function<Status(int64_t)>& fn);

// The EP ranks this process runs: every rank, a thread each (one process driving all GPUs, or the
// cpu backend's host group), or the single rank `megamoe launch` started it as (MEGAMOE_RANK set:
// one process per GPU over ncclCommInitRank, as inference engines launch).
struct ProcessRanks {
  int64_t ep_size = 1;
  bool launched = false;
  NcclBootstrap bootstrap;  // when launched
  // Launched: this rank's communicator, made once (the id file bootstraps one communicator per
  // launch) and shared by every layer the process builds.
  std::shared_ptr<Communicator> comm;
  // --shared-gpu: every rank on GPU 0, as logical ranks of one shared-GPU group (not launched).
  bool shared_gpu = false;
  bool runs(int64_t r) const { return !launched || r == bootstrap.rank; }
  int64_t first() const { return launched ? bootstrap.rank : 0; }  // the first rank this process runs
  // The CUDA device rank r runs on in this process.
  int device_of(int64_t r) const {
    if (shared_gpu) return 0;
    return launched && bootstrap.device >= 0 ? bootstrap.device : static_cast<int>(r);
  }
  std::string describe() const;
};

// All ranks in this process, or (MEGAMOE_RANK set) the launched rank, checked: the world size must
// equal ep_size and the backend must run on GPUs (the cpu backend's ranks share host memory). A
// launched rank joins its NCCL communicator here (collective over the launched processes).
// shared_gpu: --shared-gpu (refused with megamoe launch and with the cpu backend).
Status process_ranks(int64_t ep_size, bool on_gpu, ProcessRanks* out, bool shared_gpu = false);

// run_on_ranks over the ranks of `pr` that this process runs.
Status run_on_local_ranks(const ProcessRanks& pr, const std::function<Status(int64_t)>& fn);

// All ranks' layers of one group (a launched process holds only its own rank's; the others null).
struct RankGroup {
  std::vector<std::shared_ptr<Communicator>> comms;  // empty for ep_size == 1
  std::vector<std::unique_ptr<MoeLayer>> layers;     // [R]
  // Each rank's layer is released (MoeLayer::release, collective) and destroyed on its own thread.
  ~RankGroup();
};

// A rank's source weights for MoeLayer::create: the views, and the memory behind them when the
// source made it (null when the views point into memory someone else keeps).
struct RankWeights {
  MoeWeights views;
  std::shared_ptr<const void> storage;
};
// Makes rank r's source weights; build_group calls it on rank r's own thread.
using RankWeightsFn = std::function<Status(int64_t rank, RankWeights* out)>;

// The slowest rank's seconds in each step of build_group.
struct BuildTimes {
  double source_s = 0, create_s = 0, warmup_s = 0;
};

// Creates every rank's layer, each on its own thread: rank r makes its source weights with
// weights_of(r), creates its layer (geometry g.for_rank(r); the layer prepares its own copy) and
// releases the source at once, so the source slices of all ranks are alive together only while the
// layers are created. Then warms the layers up (collective), each on its own thread.
Status build_group(const MoeGeometry& g, const MoeConfig& c, const RankWeightsFn& weights_of, RankGroup* out,
                   BuildTimes* times = nullptr, const ProcessRanks* ranks = nullptr);

// The first layer this process holds.
MoeLayer* first_local_layer(const RankGroup& group);

// Rank r's slice of the random problem (reference::make_rank_weights of `seed`), generated on
// rank r's thread with its share of the generator threads (hardware threads / ep_size).
RankWeightsFn generated_weights(const MoeGeometry& g, uint64_t seed);

// Views of a layer's prepared weights as source weights that MoeLayer::create takes back bit for bit
// (reusable_source_format(prepared.format) must hold, presets.h): PreparedWeights::as_source().
MoeWeights source_views(const PreparedWeights& prepared);

// In a rank thread's body that reports through a result struct `res` with a std::string `error`:
// a failing CUDA call is recorded there (the call's text and the CUDA error) and the body returns.
#define MEGAMOE_RANK_CUDA(expr)                                       \
  do {                                                                \
    const cudaError_t _e = (expr);                                    \
    if (_e != cudaSuccess) {                                          \
      res->error = std::string(#expr) + ": " + cudaGetErrorString(_e); \
      return;                                                         \
    }                                                                 \
  } while (0)

// A sense-reversing barrier for R rank threads (lockstep timing in bench).
class ThreadBarrier {
 public:
  explicit ThreadBarrier(int64_t n) : n_(n) {}
  void wait();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t n_, arrived_ = 0, generation_ = 0;
};

// A barrier over the launched processes: an NCCL all-reduce of the one float at `flag` on `stream`,
// then a bounded wait for it (env_knobs().barrier_timeout_ms, MEGAMOE_BARRIER_TIMEOUT_MS). A peer that
// never arrives, or an error NCCL reports on the communicator (a peer process gone), cannot be
// recovered from in-process: the pending all-reduce keeps ncclCommDestroy (and so every destructor
// that releases a symmetric window) from returning. So the rank prints one line naming itself, the
// barrier, the bound and what it saw, aborts the communicator (ncclCommAbort) and exits with
// kBarrierExitCode without running destructors; `megamoe launch` then stops the other ranks.
// Returns only on success or when the all-reduce could not be enqueued.
constexpr int kBarrierExitCode = 5;
Status nccl_barrier(ncclComm_t comm, void* flag, void* stream, int64_t rank, const char* what);
// The all-reduce under nccl_barrier, of any `count` values of `type` with `op`, waited for with the
// same bound and the same exit on a missing peer.
Status nccl_all_reduce_bounded(ncclComm_t comm, void* buf, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               void* stream, int64_t rank, const char* what);

// A barrier over every rank of the group, for lockstep timing: host threads when this process runs
// every rank, nccl_barrier across the launched processes.
class RankBarrier {
 public:
  RankBarrier(const ProcessRanks& pr, const RankGroup& group);
  RankBarrier(const RankBarrier&) = delete;
  RankBarrier& operator=(const RankBarrier&) = delete;
  ~RankBarrier();
  Status wait(int64_t rank);

 private:
  const ProcessRanks& pr_;
  const RankGroup& group_;
  ThreadBarrier threads_;
  void* flag_ = nullptr;    // launched: one float on the rank's device
  void* stream_ = nullptr;  // launched: the stream the all-reduce runs on
};

// The largest of every launched process's value, over the process's own communicator
// (ProcessRanks::comm, so no layers need to exist): an NCCL all-reduce of one double, bounded and
// fatal on a missing peer like nccl_barrier. Every process calls it the same number of times, in the
// same order, between the same collective steps. Not launched: the identity.
class ProcessMax {
 public:
  explicit ProcessMax(const ProcessRanks& pr) : pr_(pr) {}
  ProcessMax(const ProcessMax&) = delete;
  ProcessMax& operator=(const ProcessMax&) = delete;
  ~ProcessMax();
  Status operator()(double* value);

 private:
  const ProcessRanks& pr_;
  void* value_ = nullptr;   // one double on the rank's device
  void* stream_ = nullptr;  // the stream the all-reduce runs on
};

// One rank's forward inputs and output on the layer's device (host memory for the cpu backend).
class RankIo {
 public:
  RankIo() = default;
  RankIo(const RankIo&) = delete;
  RankIo& operator=(const RankIo&) = delete;
  ~RankIo();

  // Copies x [T, H] bf16 bits, ids [T, k], weights [T, k] to `device` and allocates y [T, H].
  Status stage(Device device, int64_t tokens, int64_t hidden, int64_t top_k, const uint16_t* x,
               const int32_t* ids, const float* weights);
  // Fills y with a bf16 NaN pattern (poison: a row the layer does not write shows up as NaN).
  Status poison_output();
  Status forward(MoeLayer* layer, void* stream);
  // The layers in order on this input, as a model's layers run: layer 0 reads x, layer l reads layer
  // l - 1's output, the last writes y (the others alternate between two scratch activations, made by
  // reserve_chain() before any capture).
  Status reserve_chain();
  Status forward_layers(const std::vector<MoeLayer*>& layers, void* stream);
  // Copies y back to the host (tokens * hidden bf16 bits).
  Status read_output(uint16_t* y) const;

 private:
  void release();
  Device device_;
  int64_t tokens_ = 0, hidden_ = 0, top_k_ = 0;
  void* x_ = nullptr;
  void* ids_ = nullptr;
  void* weights_ = nullptr;
  void* y_ = nullptr;
  void* chain_[2] = {nullptr, nullptr};
};

// Stream helpers: rank r's stream on its layer's CUDA device (null for the cpu; a shared-GPU rank's is
// its group's, shared_gpu_stream), given back with destroy_rank_stream, and a stream's
// synchronisation. The L2 flush and the event timer are the bench harness's (bench_harness.h).
Status create_rank_stream(const RankGroup& g, int64_t r, void** stream);
void destroy_rank_stream(const RankGroup& g, int64_t r, void* stream);
Status synchronize(Device device, void* stream);

}  // namespace megamoe::tool
