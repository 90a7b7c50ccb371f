// megamoe/comm.h — the expert-parallel group a layer belongs to.
//
// Contract: a Communicator is one rank's handle on a group of `size()` ranks. Layers built on handles
// of one group exchange tokens with each other; every rank must call the same collective operations
// (warmup(), forward()) in the same order, each from its own thread or process.
//
// Kinds:
// - host threads: R ranks inside this process, each driven by its own thread, exchanging through host
//   memory (the cpu backend's EP protocol; runs anywhere).
// - NCCL (GPU backends): built by the EP-transport layer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/status.h"

namespace megamoe {

enum class CommKind { kHostThreads = 0, kNccl };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual CommKind kind() const = 0;
  // Identifies the group: equal for all handles of one group, distinct between groups.
  virtual uint64_t group_id() const = 0;
  virtual std::string to_string() const = 0;
};

// R ranks as threads of this process over host memory. `ranks` receives one handle per rank, in rank
// order. Bounded waits inside the group use MEGAMOE_WAIT_TIMEOUT_MS (default 10000).
Status create_host_group(int size, std::vector<std::shared_ptr<Communicator>>* ranks);

}  // namespace megamoe
