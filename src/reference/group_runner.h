// Runs one MoE problem on a whole EP group inside this process: one MoeLayer per rank (built with
// MoeLayer::create and geometry.for_rank(r)) on a host-thread group, each rank's warmup() and
// forward() on its own thread, as an inference engine drives one layer per GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/host_group.h"
#include "megamoe/layer.h"
#include "reference/problem.h"

namespace megamoe {
namespace reference {

class GroupRunner {
 public:
  // ep_size == 1 builds the layer with a null communicator; otherwise a new host group of ep_size
  // ranks. `problem` must outlive the runner (inputs and weights are read from it).
  static Status create(const MoeProblem& problem, const MoeConfig& config, std::unique_ptr<GroupRunner>* out);

  int size() const { return static_cast<int>(layers_.size()); }
  MoeLayer* layer(int rank) const { return layers_[rank].get(); }
  // Null for ep_size == 1.
  HostGroup* group() const { return comms_.empty() ? nullptr : host_group_of(comms_[0].get()); }

  // warmup() on every rank, each on its own thread. Returns the lowest rank's error.
  Status warmup_all(std::vector<Status>* per_rank = nullptr);
  // One forward on every rank not in `skip`, each on its own thread, with the problem's inputs.
  // y[r] ([T_r, H] bf16) is poisoned with 0xFFFF (a bf16 NaN) before the run, so a row the layer
  // forgot to write shows. Returns the lowest rank's error; per_rank gets every rank's status.
  Status forward_all(std::vector<std::vector<uint16_t>>* y, std::vector<Status>* per_rank = nullptr,
                     const std::vector<bool>& skip = {});

 private:
  GroupRunner() = default;
  const MoeProblem* problem_ = nullptr;
  std::vector<std::shared_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<MoeLayer>> layers_;
};

// create + warmup_all + forward_all once.
Status run_group(const MoeProblem& problem, const MoeConfig& config, std::vector<std::vector<uint16_t>>* y);

}  // namespace reference
}  // namespace megamoe
