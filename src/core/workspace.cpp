#include "megamoe/workspace.h"

#include <chrono>
#include <condition_variable>
#include <sstream>
#include <tuple>

#include "core/env.h"

namespace megamoe {

namespace {

int32_t ws_format(DispatchFormat f) { return f == DispatchFormat::kFp8Block ? kWsFp8Block : kWsBf16; }
int32_t ws_format(CombineDtype f) {
  switch (f) {
    case CombineDtype::kMxfp8: return kWsMxfp8;
    case CombineDtype::kNvfp4: return kWsNvfp4;
    default: return kWsBf16;
  }
}

const char* const kRegionNames[WorkspaceLayout::kNumRegions] = {
    "signals",      "error_cell", "recv_token_counts", "recv_expert_counts", "recv_tokens",
    "recv_scales",  "recv_meta",  "expert_offsets",    "pool_src",           "pool_x",
    "pool_x_scales", "intermediate", "intermediate_scales", "combine"};

const char* const kRegionFormulas[WorkspaceLayout::kNumRegions] = {
    "R * 16 * 8",
    "64",
    "R * 4",
    "R * E_l * 4 (x 2 with mega: a bank per launch parity)",
    "R * T_max * H * e_dispatch",
    "R * T_max * H/128 * 4 (fp8 dispatch)",
    "R * T_max * round16((1 + 2k) * 4)",
    "(E_l + 1) * 4",
    "P * 4 (0 with mega)",
    "P * H * e_dispatch",
    "P * H/128 * 4 (fp8 dispatch)",
    "P * I * e_intermediate",
    "P * I/128 * 4 (fp8 intermediate)",
    "T_max * (owner_reduce ? R : k) * wire_row_bytes (in-kernel FC2 reduce: T_max * H * 2 with mega, else 0)"};

}  // namespace

const char* WorkspaceLayout::region_name(int i) { return (i >= 0 && i < kNumRegions) ? kRegionNames[i] : "?"; }
const char* WorkspaceLayout::region_formula(int i) {
  return (i >= 0 && i < kNumRegions) ? kRegionFormulas[i] : "?";
}

WorkspaceParams workspace_params(const MoeGeometry& g, const MoeConfig& c) {
  WorkspaceParams p;
  p.ep_size = g.ep_size;
  p.experts_per_rank = g.experts_per_rank();
  p.top_k = g.top_k;
  p.hidden = g.hidden;
  p.intermediate = g.intermediate;
  p.max_tokens_per_rank = g.max_tokens_per_rank;
  p.segment_align = kPoolSegmentAlign;
  p.dispatch_format = ws_format(c.dispatch_format);
  p.intermediate_format = ws_format(c.intermediate_format());
  p.combine_format = ws_format(c.combine_dtype);
  p.in_kernel_fc2_reduce = c.in_kernel_fc2_reduce ? 1 : 0;
  p.owner_reduce = c.uses_owner_reduce() ? 1 : 0;
  p.mega = c.backend == Backend::kMega ? 1 : 0;
  return p;
}

namespace {
auto key_tuple(const WorkspaceKey& k) {
  const WorkspaceParams& p = k.params;
  return std::make_tuple(p.ep_size, p.experts_per_rank, p.top_k, p.hidden, p.intermediate, p.max_tokens_per_rank,
                         p.segment_align, p.dispatch_format, p.intermediate_format, p.combine_format,
                         p.in_kernel_fc2_reduce, p.owner_reduce, p.mega, k.ep_rank, k.group_id,
                         static_cast<int>(k.device.kind), k.device.index, k.lane);
}
}  // namespace

bool WorkspaceKey::operator<(const WorkspaceKey& o) const { return key_tuple(*this) < key_tuple(o); }

std::string WorkspaceKey::to_string() const {
  std::ostringstream os;
  os << "WorkspaceKey(R=" << params.ep_size << ", E_l=" << params.experts_per_rank << ", k=" << params.top_k
     << ", H=" << params.hidden << ", I=" << params.intermediate << ", T_max=" << params.max_tokens_per_rank
     << ", SA=" << params.segment_align << ", dispatch=" << params.dispatch_format
     << ", intermediate=" << params.intermediate_format << ", combine=" << params.combine_format
     << ", in_kernel_reduce=" << params.in_kernel_fc2_reduce << ", owner_reduce=" << params.owner_reduce
     << ", mega=" << params.mega
     << ", rank=" << ep_rank << ", group=" << group_id << ", device=" << device.to_string() << ", lane=" << lane
     << ")";
  return os.str();
}

WorkspacePool& WorkspacePool::global() {
  static WorkspacePool* pool = new WorkspacePool();  // never destroyed: layers may outlive statics
  return *pool;
}

// One key's slot: the live workspace, or the allocation under way (done once `allocating` clears).
struct WorkspacePool::Entry {
  std::weak_ptr<Workspace> live;
  bool allocating = false;
  Status failed;  // the last allocation's error, for the acquirers that waited for it
  uint64_t attempts = 0;
  std::condition_variable done;
};

Status WorkspacePool::acquire(const WorkspaceKey& key, const Allocator& allocate, std::shared_ptr<Workspace>* out) {
  if (!out) return invalid_argument("workspace pool", "out", "null", "must receive the workspace");
  std::shared_ptr<Entry> entry;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    std::shared_ptr<Entry>& slot = entries_[key];
    if (!slot) slot = std::make_shared<Entry>();
    entry = slot;
    if (entry->allocating) {
      // Another thread of this rank is allocating this key (collectively): wait for its result.
      const uint64_t attempt = entry->attempts;
      const int64_t ms = env_knobs().barrier_timeout_ms;
      const bool finished = entry->done.wait_for(lock, std::chrono::milliseconds(ms),
                                                 [&] { return !entry->allocating || entry->attempts != attempt; });
      if (!finished)
        return Status(StatusCode::kTimeout, "workspace pool: waited " + std::to_string(ms) + " ms for another "
                                            "thread's allocation of " + key.to_string() +
                                            " (MEGAMOE_BARRIER_TIMEOUT_MS)");
      if (auto live = entry->live.lock()) {
        *out = std::move(live);
        return Status::ok();
      }
      return Status(entry->failed.is_ok() ? StatusCode::kInternal : entry->failed.code(),
                    "workspace pool: another thread's allocation of " + key.to_string() + " failed: " +
                        (entry->failed.is_ok() ? std::string("the workspace was released meanwhile")
                                               : entry->failed.message()));
    }
    if (auto live = entry->live.lock()) {
      *out = std::move(live);
      return Status::ok();
    }
    entry->allocating = true;
  }
  // Allocate without holding the lock: an allocation may be collective (other ranks of a
  // host-thread group acquire their own keys from this same pool meanwhile).
  auto ws = std::make_shared<Workspace>();
  ws->layout = WorkspaceLayout::make(key.params);
  ws->device = key.device;
  const Status st = allocate(ws->layout.total_bytes, &ws->base, &ws->release);
  std::lock_guard<std::mutex> lock(mutex_);
  entry->allocating = false;
  ++entry->attempts;
  entry->failed = st;
  if (st.is_ok()) entry->live = ws;
  entry->done.notify_all();
  if (!st.is_ok()) {
    ws->base = nullptr;  // nothing to release: the allocator failed
    return st;
  }
  *out = std::move(ws);
  return Status::ok();
}

int64_t WorkspacePool::num_live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (const auto& e : entries_)
    if (!e.second->live.expired()) ++n;
  return n;
}

int64_t WorkspacePool::live_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (const auto& e : entries_)
    if (auto ws = e.second->live.lock()) n += ws->layout.total_bytes;
  return n;
}

}  // namespace megamoe
