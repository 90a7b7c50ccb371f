// Running one MoeLayer per EP rank inside this process: a host-thread group (the cpu backend's
// transport), one thread per rank for every collective call, and host<->device staging of a rank's
// inputs for layers that live on a CUDA device.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/layer.h"
#include "megamoe/status.h"
#include "megamoe/weights.h"

namespace megamoe::tool {

// Runs fn(rank) for rank in [0, n), each in its own thread, and joins them. Returns the most telling
// error: the first (by rank) that is not a timeout or group abort, else the first error, else ok.
// An exception inside fn becomes kInternal naming the rank.
Status run_on_ranks(int64_t n, const std::function<Status(int64_t)>& fn);

// All ranks' layers of one group.
struct RankGroup {
  std::vector<std::shared_ptr<Communicator>> comms;  // empty for ep_size == 1
  std::vector<std::unique_ptr<MoeLayer>> layers;     // [R]
  // Each rank's layer is released on its own thread: releasing a symmetric window is collective.
  ~RankGroup();
};

// Creates every rank's layer (rank r gets weights_of(r) and geometry g.for_rank(r)), each in its own
// thread, then warms them all up (collective), each in its own thread.
Status build_group(const MoeGeometry& g, const MoeConfig& c, const std::function<MoeWeights(int64_t)>& weights_of,
                   RankGroup* out);

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
};

// Stream helpers: a stream on a CUDA device (null for the cpu), synchronisation, and an L2 flush
// (writes a 256 MiB scratch buffer, larger than any Hopper L2) between timed iterations.
Status create_stream(Device device, void** stream);
void destroy_stream(Device device, void* stream);
Status synchronize(Device device, void* stream);
Status flush_l2(Device device, void* stream);

}  // namespace megamoe::tool
