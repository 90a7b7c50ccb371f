#include "reference/group_runner.h"

#include <string>
#include <thread>

namespace megamoe {
namespace reference {
namespace {

// Runs fn(r) for every rank on its own thread; returns the lowest rank's error.
template <typename Fn>
Status on_every_rank(int size, std::vector<Status>* per_rank, Fn fn) {
  std::vector<Status> statuses(size);
  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int r = 0; r < size; ++r) threads.emplace_back([&statuses, &fn, r] { statuses[r] = fn(r); });
  for (auto& t : threads) t.join();
  Status first;
  for (const Status& s : statuses) {
    if (!s.is_ok()) {
      first = s;
      break;
    }
  }
  if (per_rank) *per_rank = std::move(statuses);
  return first;
}

}  // namespace

Status GroupRunner::create(const MoeProblem& problem, const MoeConfig& config, std::unique_ptr<GroupRunner>* out) {
  const MoeGeometry& g = problem.geometry;
  if (static_cast<int64_t>(problem.ranks.size()) != g.ep_size)
    return invalid_argument("problem", "ranks.size()", std::to_string(problem.ranks.size()),
                            "must equal ep_size=" + std::to_string(g.ep_size));
  std::unique_ptr<GroupRunner> runner(new GroupRunner());
  runner->problem_ = &problem;
  if (g.ep_size > 1) MEGAMOE_RETURN_IF_ERROR(create_host_group(static_cast<int>(g.ep_size), &runner->comms_));
  for (int64_t r = 0; r < g.ep_size; ++r) {
    std::unique_ptr<MoeLayer> layer;
    std::shared_ptr<Communicator> comm = g.ep_size > 1 ? runner->comms_[r] : nullptr;
    MEGAMOE_RETURN_IF_ERROR(MoeLayer::create(g.for_rank(r), config, local_weights(problem, r), comm, &layer));
    runner->layers_.push_back(std::move(layer));
  }
  *out = std::move(runner);
  return Status::ok();
}

Status GroupRunner::warmup_all(std::vector<Status>* per_rank) {
  return on_every_rank(size(), per_rank, [this](int r) { return layers_[r]->warmup(); });
}

Status GroupRunner::forward_all(std::vector<std::vector<uint16_t>>* y, std::vector<Status>* per_rank,
                                const std::vector<bool>& skip) {
  const MoeGeometry& g = problem_->geometry;
  y->assign(size(), {});
  for (int r = 0; r < size(); ++r) (*y)[r].assign(problem_->ranks[r].num_tokens * g.hidden, 0xFFFF);
  return on_every_rank(size(), per_rank, [&](int r) -> Status {
    if (r < static_cast<int>(skip.size()) && skip[r]) return Status::ok();
    const RankInputs& in = problem_->ranks[r];
    const int64_t T = in.num_tokens;
    // The layer only reads its inputs; TensorView has no const form.
    TensorView x(const_cast<uint16_t*>(in.x_bf16.data()), DType::kBFloat16, {T, g.hidden});
    TensorView ids(const_cast<int32_t*>(in.topk_ids.data()), DType::kInt32, {T, g.top_k});
    TensorView weights(const_cast<float*>(in.topk_weights.data()), DType::kFloat32, {T, g.top_k});
    TensorView out((*y)[r].data(), DType::kBFloat16, {T, g.hidden});
    return layers_[r]->forward(x, ids, weights, out);
  });
}

Status run_group(const MoeProblem& problem, const MoeConfig& config, std::vector<std::vector<uint16_t>>* y) {
  std::unique_ptr<GroupRunner> runner;
  MEGAMOE_RETURN_IF_ERROR(GroupRunner::create(problem, config, &runner));
  MEGAMOE_RETURN_IF_ERROR(runner->warmup_all());
  return runner->forward_all(y);
}

}  // namespace reference
}  // namespace megamoe
