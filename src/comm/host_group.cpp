#include "comm/host_group.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>

#include "core/env.h"
#include "core/log.h"

namespace megamoe {
namespace {

std::atomic<uint64_t> g_next_group_id{1};

std::string peer_list(const std::vector<int>& peers) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < peers.size(); ++i) os << (i ? ", " : "") << peers[i];
  os << "]";
  return os.str();
}

}  // namespace

HostGroup::HostGroup(int size, uint64_t id) : size_(size), id_(id), arrived_(size, 0), stage_(size) {
  published_[0].assign(size, nullptr);
  published_[1].assign(size, nullptr);
  destination_locks_.reserve(size);
  for (int r = 0; r < size; ++r) destination_locks_.push_back(std::make_unique<std::mutex>());
}

void HostGroup::set_wait_timeout_ms(int64_t ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_override_ms_ = ms > 0 ? ms : 0;
}

int64_t HostGroup::wait_timeout_ms() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (timeout_override_ms_ > 0) return timeout_override_ms_;
  }
  return env_knobs().wait_timeout_ms;
}

int64_t HostGroup::epoch(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return arrived_[rank];
}

bool HostGroup::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

Status HostGroup::check(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) return Status::ok();
  return abort_status_locked(rank, nullptr);
}

Status HostGroup::abort_status_locked(int rank, const char* stage) const {
  std::ostringstream os;
  os << "rank " << rank;
  if (stage) os << " stopped waiting at stage '" << stage << "'";
  else os << " cannot proceed";
  os << ": host group " << id_ << " was aborted: " << abort_reason_
     << " (the group is unusable now; build a new one)";
  return Status(abort_code_, os.str());
}

void HostGroup::abort_locked(int rank, const std::string& reason, StatusCode code) {
  if (aborted_) return;  // the first reason wins
  aborted_ = true;
  abort_code_ = code == StatusCode::kOk ? StatusCode::kFailedPrecondition : code;
  abort_reason_ = reason.empty() ? "rank " + std::to_string(rank) + " aborted the group" : reason;
  cv_.notify_all();
}

void HostGroup::abort(int rank, const std::string& reason, StatusCode code) {
  std::lock_guard<std::mutex> lock(mutex_);
  abort_locked(rank, reason, code);
}

Status HostGroup::barrier(int rank, const char* stage, WaitError* error, int64_t timeout_ms) {
  return barrier_impl(rank, stage, nullptr, nullptr, error, timeout_ms);
}

Status HostGroup::all_gather(int rank, const char* stage, void* mine, std::vector<void*>* all, WaitError* error,
                             int64_t timeout_ms) {
  return barrier_impl(rank, stage, mine, all, error, timeout_ms);
}

// Published pointers are double-buffered by epoch parity. invariant: while rank p reads
// published_[n & 1] (inside its epoch-n barrier), no rank can write it again: that happens at epoch
// n + 2, which needs every rank — p included — to have entered epoch n + 1 first.
Status HostGroup::barrier_impl(int rank, const char* stage, void* publish, std::vector<void*>* gathered,
                               WaitError* error, int64_t timeout_override_ms) {
  if (rank < 0 || rank >= size_)
    return invalid_argument("host group barrier", "rank", std::to_string(rank),
                            "must be in [0, size=" + std::to_string(size_) + ")");
  const int64_t timeout_ms = timeout_override_ms > 0 ? timeout_override_ms : wait_timeout_ms();
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted_) return abort_status_locked(rank, stage);

  const int64_t epoch = arrived_[rank] + 1;
  for (int p = 0; p < size_; ++p) {
    if (p == rank || arrived_[p] != epoch || stage_[p] == stage) continue;
    std::ostringstream os;
    os << "collective order broken in host group " << id_ << ": rank " << rank << " entered stage '" << stage
       << "' but rank " << p << " entered stage '" << stage_[p] << "' at the same barrier (epoch " << epoch
       << "); every rank must call warmup() and forward() the same number of times, in the same order";
    abort_locked(rank, os.str(), StatusCode::kFailedPrecondition);
    return Status(StatusCode::kFailedPrecondition, os.str());
  }
  arrived_[rank] = epoch;
  stage_[rank] = stage;
  published_[epoch & 1][rank] = publish;

  auto num_arrived = [&] {
    int n = 0;
    for (int p = 0; p < size_; ++p) n += arrived_[p] >= epoch ? 1 : 0;
    return n;
  };
  if (num_arrived() == size_) cv_.notify_all();

  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (aborted_) return abort_status_locked(rank, stage);
    const int seen = num_arrived();
    if (seen == size_) break;
    if (cv_.wait_until(lock, deadline) != std::cv_status::timeout) continue;
    if (aborted_ || num_arrived() == size_) continue;  // re-check before declaring a timeout
    std::vector<int> missing;
    for (int p = 0; p < size_; ++p)
      if (arrived_[p] < epoch) missing.push_back(p);
    const int seen_now = num_arrived();
    std::ostringstream os;
    os << "timeout: rank " << rank << " waited " << timeout_ms << " ms at stage '" << stage << "' (barrier epoch "
       << epoch << " of host group " << id_ << ") for peers " << peer_list(missing)
       << " that did not arrive: expected " << size_ << " ranks, seen " << seen_now;
    for (int p : missing) {
      os << "; rank " << p << " last entered ";
      if (arrived_[p] == 0) os << "no barrier";
      else os << "stage '" << stage_[p] << "' (epoch " << arrived_[p] << ")";
    }
    os << (timeout_override_ms > 0 ? " (the caller's bound)" : " (MEGAMOE_WAIT_TIMEOUT_MS bounds this wait)");
    if (error) {
      error->flag = 1;
      error->rank = rank;
      error->sm = -1;
      error->peer = missing.empty() ? -1 : missing.front();
      error->expected = size_;
      error->seen = seen_now;
    }
    abort_locked(rank, os.str(), StatusCode::kTimeout);
    log_warn("%s", os.str().c_str());
    return Status(StatusCode::kTimeout, os.str());
  }
  if (gathered) *gathered = published_[epoch & 1];
  return Status::ok();
}

std::string HostRankComm::to_string() const {
  std::ostringstream os;
  os << "HostRankComm(group=" << group_->id() << ", rank=" << rank_ << ", size=" << group_->size() << ")";
  return os.str();
}

uint64_t next_in_process_group_id() { return g_next_group_id.fetch_add(1); }

HostGroup* host_group_of(const Communicator* comm) {
  if (!comm || comm->kind() != CommKind::kHostThreads) return nullptr;
  const auto* handle = dynamic_cast<const HostRankComm*>(comm);
  return handle ? &handle->group() : nullptr;
}

Status create_host_group(int size, std::vector<std::shared_ptr<Communicator>>* ranks) {
  if (!ranks) return invalid_argument("argument", "ranks", "null", "must point to a vector to receive the handles");
  if (size < 1 || size > 4096)
    return invalid_argument("host group", "size", std::to_string(size), "must be in [1, 4096]");
  auto group = std::make_shared<HostGroup>(size, next_in_process_group_id());
  ranks->clear();
  ranks->reserve(size);
  for (int r = 0; r < size; ++r) ranks->push_back(std::make_shared<HostRankComm>(group, r));
  return Status::ok();
}

}  // namespace megamoe
