#include "reference/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "core/backends.h"
#include "megamoe/formats.h"

namespace megamoe {

using reference::DispatchPlan;
using reference::DispatchSource;
using reference::ExpertWeightsF32;
using reference::PeerTargets;

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// QuantizedTensor::dequantize with the experts spread over up to num_workers threads (each expert's
// values are written by one thread with dequantize_expert: the same bits).
void dequantize_experts(const QuantizedTensor& w, int num_workers, std::vector<float>* out) {
  const int64_t per_expert = w.rows * w.cols;
  out->assign(static_cast<size_t>(w.num_experts * per_expert), 0.0f);
  std::atomic<int64_t> next_expert{0};
  auto work = [&] {
    for (int64_t e = next_expert++; e < w.num_experts; e = next_expert++)
      w.dequantize_expert(e, out->data() + e * per_expert);
  };
  std::vector<std::thread> helpers;
  for (int64_t i = 1; i < std::min<int64_t>(num_workers, w.num_experts); ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads: the running ones take every expert
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
}

// The routing as the protocol reads it: int32 ids (an int64 id outside int32 saturates, so it is
// still refused as a bad id) and fp32 weights times output_scale (fp32(s * w), as the GPU backends
// compute it); int32 / fp32 views with s = 1 are used in place.
void normalize_routing(const TensorView& ids, const TensorView& weights, float output_scale, int64_t n,
                       std::vector<int32_t>* ids_storage, std::vector<float>* weights_storage, const int32_t** ids_out,
                       const float** weights_out) {
  *ids_out = ids.ptr<const int32_t>();
  if (ids.dtype == DType::kInt64) {
    const int64_t* src = ids.ptr<const int64_t>();
    ids_storage->resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      (*ids_storage)[i] = static_cast<int32_t>(std::clamp<int64_t>(src[i], INT32_MIN, INT32_MAX));
    *ids_out = ids_storage->data();
  }
  *weights_out = weights.ptr<const float>();
  if (weights.dtype == DType::kBFloat16 || output_scale != 1.0f) {
    weights_storage->resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float w = weights.dtype == DType::kBFloat16 ? fmt::bf16_to_float(weights.ptr<const uint16_t>()[i])
                                                         : weights.ptr<const float>()[i];
      (*weights_storage)[i] = output_scale * w;
    }
    *weights_out = weights_storage->data();
  }
}

}  // namespace

int default_expert_workers(int64_t ep_size) {
  const int64_t hw = std::thread::hardware_concurrency();  // 0 when unknown
  return static_cast<int>(std::clamp<int64_t>(hw / std::max<int64_t>(ep_size, 1), 1, kMaxExpertWorkers));
}

Status create_cpu_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                        PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a std::unique_ptr<MoeLayer>");
  MEGAMOE_RETURN_IF_ERROR(config.validate(geometry));
  HostGroup* group = nullptr;
  if (comm) {
    group = host_group_of(comm.get());
    if (!group)
      return Status(StatusCode::kUnavailable, "the cpu backend needs a host-threads communicator "
                                              "(create_host_group); got " + comm->to_string());
    if (comm->size() != geometry.ep_size || comm->rank() != geometry.ep_rank)
      return invalid_argument("argument", "comm", comm->to_string(),
                              "must be rank ep_rank=" + str(geometry.ep_rank) + " of a group of ep_size=" +
                                  str(geometry.ep_size) + " ranks");
  } else if (geometry.ep_size > 1) {
    return invalid_argument("argument", "comm", "null", "ep_size=" + str(geometry.ep_size) + " needs a communicator");
  }
  const int64_t El = geometry.experts_per_rank(), H = geometry.hidden, I = geometry.intermediate;
  if (weights.w13.num_experts != El || weights.w13.rows != 2 * I || weights.w13.cols != H ||
      weights.w2.num_experts != El || weights.w2.rows != H || weights.w2.cols != I)
    return Status(StatusCode::kInternal,
                  "prepared weights do not match the geometry: w13 [" + str(weights.w13.num_experts) + ", " +
                      str(weights.w13.rows) + ", " + str(weights.w13.cols) + "], w2 [" +
                      str(weights.w2.num_experts) + ", " + str(weights.w2.rows) + ", " + str(weights.w2.cols) +
                      "], want [" + str(El) + ", " + str(2 * I) + ", " + str(H) + "] and [" + str(El) + ", " +
                      str(H) + ", " + str(I) + "]");
  // The experts compute with exactly these values (quantisation point 2).
  ExpertWeightsF32 expert_weights;
  expert_weights.num_experts = El;
  expert_weights.hidden = H;
  expert_weights.intermediate = I;
  const int num_workers = default_expert_workers(geometry.ep_size);
  dequantize_experts(weights.w13, num_workers, &expert_weights.w13);
  dequantize_experts(weights.w2, num_workers, &expert_weights.w2);
  out->reset(new CpuMoeLayer(geometry, config, std::move(selection), std::move(weights), std::move(expert_weights),
                             std::move(comm), group));
  return Status::ok();
}

CpuMoeLayer::CpuMoeLayer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                         PreparedWeights weights, ExpertWeightsF32 expert_weights, std::shared_ptr<Communicator> comm,
                         HostGroup* group)
    : MoeLayer(geometry, config, std::move(selection), std::move(weights)),
      rank_(static_cast<int>(geometry.ep_rank)),
      layout_(WorkspaceLayout::make(workspace_params(geometry, config))),
      expert_weights_(std::move(expert_weights)),
      comm_(std::move(comm)),
      group_(group),
      expert_workers_(default_expert_workers(geometry.ep_size)),
      expert_min_fmas_per_worker_(reference::kMinFmasPerWorker) {}

void CpuMoeLayer::set_expert_workers_for_testing(int num_workers) {
  expert_workers_ = num_workers > 0 ? num_workers : default_expert_workers(geometry_.ep_size);
  expert_min_fmas_per_worker_ = num_workers > 0 ? 0 : reference::kMinFmasPerWorker;
}

WaitError CpuMoeLayer::last_wait_error() const {
  WaitError e{};
  if (workspace_) std::memcpy(&e, layout_.at<char>(workspace_->base, layout_.error_cell), sizeof(e));
  return e;
}

Status CpuMoeLayer::fail(const Status& st) {
  if (group_ && group_->size() > 1)
    group_->abort(rank_, "rank " + str(rank_) + " failed: " + st.message(), st.code());
  return st;
}

Status CpuMoeLayer::sync(int32_t stage, void* publish, std::vector<void*>* gathered) {
  if (!group_) {
    gathered->assign(1, publish);
    return Status::ok();
  }
  WaitError err{};
  Status st = group_->all_gather(rank_, reference::stage_name(stage), publish, gathered, &err);
  if (!st.is_ok() && err.flag && workspace_) {
    WaitError* cell = layout_.at<WaitError>(workspace_->base, layout_.error_cell);
    if (cell->flag == 0) {
      err.stage = stage;
      *cell = err;
    }
  }
  return st;
}

Status CpuMoeLayer::warmup() {
  if (workspace_ && !peer_bases_.empty()) return Status::ok();
  if (group_) MEGAMOE_RETURN_IF_ERROR(group_->check(rank_));
  if (!workspace_) {
    WorkspaceKey key;
    key.params = layout_.params;
    key.ep_rank = geometry_.ep_rank;
    key.group_id = comm_ ? comm_->group_id() : 0;
    key.device = Device::cpu();
    key.lane = config_.workspace_lane;
    const WorkspaceLayout layout = layout_;
    auto allocate = [layout](int64_t bytes, void** base, std::function<void(void*)>* release) -> Status {
      const int64_t rounded = WorkspaceLayout::align_up(bytes > 0 ? bytes : 1, WorkspaceLayout::kAlign);
      void* p = std::aligned_alloc(WorkspaceLayout::kAlign, static_cast<size_t>(rounded));
      if (!p)
        return Status(StatusCode::kInternal, "out of host memory: the cpu workspace needs " + str(rounded) + " bytes");
      reference::poison_workspace(layout, p);
      *base = p;
      *release = [](void* q) { std::free(q); };
      return Status::ok();
    };
    Status st = WorkspacePool::global().acquire(key, allocate, &workspace_);
    if (!st.is_ok()) return fail(st);
  }
  std::vector<void*> bases;
  MEGAMOE_RETURN_IF_ERROR(sync(reference::kStageWarmup, workspace_->base, &bases));
  peer_bases_ = std::move(bases);
  return Status::ok();
}

Status CpuMoeLayer::set_expert_counts(const TensorView& counts) {
  if (counts.present()) MEGAMOE_RETURN_IF_ERROR(validate_expert_counts(geometry_, Device::cpu(), counts));
  expert_counts_ = counts;
  return Status::ok();
}

Status CpuMoeLayer::error_pending(bool* pending) {
  *pending = false;
  if (released_) return Status(StatusCode::kFailedPrecondition, "error_pending() after release(): build a new layer");
  return Status::ok();
}

Status CpuMoeLayer::forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                            const TensorView& y, void* /*stream: host backend*/, const TensorView& x_scale) {
  if (group_) MEGAMOE_RETURN_IF_ERROR(group_->check(rank_));
  if (released_) return fail(Status(StatusCode::kFailedPrecondition, "forward() after release(): build a new layer"));
  Status st = validate_forward_args(geometry_, config_, Device::cpu(), x, x_scale, topk_ids, topk_weights, y);
  if (!st.is_ok()) return fail(st);
  return run_forward(x, x_scale, topk_ids, topk_weights, y);
}

Status CpuMoeLayer::run_forward(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                                const TensorView& topk_weights, const TensorView& y) {
  const int64_t T = x.shape[0];
  std::vector<int32_t> ids_storage;
  std::vector<float> weights_storage;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  normalize_routing(topk_ids, topk_weights, config_.output_scale, T * geometry_.top_k, &ids_storage,
                    &weights_storage, &ids, &weights);
  DispatchPlan plan;
  Status st = reference::compute_layout(layout_, T, ids, &plan);
  if (!st.is_ok()) return fail(st);
  MEGAMOE_RETURN_IF_ERROR(warmup());

  std::vector<uint8_t> wire_rows;
  std::vector<float> wire_scales;
  reference::encode_dispatch_rows(layout_, config_.pow2_scales, x, x_scale, &wire_rows, &wire_scales);
  uint16_t* y_data = y.ptr<uint16_t>();
  // The in-kernel reduce adds into y: it must be +0 before any peer passes "dispatch-ready".
  if (config_.in_kernel_fc2_reduce) reference::zero_output(T, geometry_.hidden, y_data);

  std::vector<void*> peer_y;
  MEGAMOE_RETURN_IF_ERROR(sync(reference::kStageDispatchReady, y_data, &peer_y));

  DispatchSource source;
  source.num_tokens = T;
  source.rows = wire_rows.data();
  source.scales = wire_scales.empty() ? nullptr : wire_scales.data();
  source.topk_ids = ids;
  source.topk_weights = weights;
  reference::dispatch(layout_, rank_, peer_bases_, plan, source);

  std::vector<void*> unused;
  MEGAMOE_RETURN_IF_ERROR(sync(reference::kStageDispatchDone, nullptr, &unused));

  void* base = workspace_->base;
  st = reference::build_expert_pool(layout_, base);
  if (!st.is_ok()) return fail(st);
  if (expert_counts_.present()) {
    static_assert(kPoolSegmentAlign == 1, "segment sizes are the received rows only without padding");
    const int32_t* offsets = layout_.at<int32_t>(base, layout_.expert_offsets);
    for (int64_t e = 0; e < geometry_.experts_per_rank(); ++e) {
      const int32_t rows = offsets[e + 1] - offsets[e];
      if (expert_counts_.dtype == DType::kInt64) expert_counts_.ptr<int64_t>()[e] += rows;
      else expert_counts_.ptr<int32_t>()[e] += rows;
    }
  }
  std::vector<float> fc2_out;
  reference::run_experts(layout_, base, expert_weights_, config_.pow2_scales, expert_fn_, &fc2_out, expert_workers_,
                         expert_min_fmas_per_worker_);

  PeerTargets peers;
  peers.bases = peer_bases_;
  const int R = static_cast<int>(peer_bases_.size());
  for (int p = 0; p < R; ++p) {
    peers.y.push_back(static_cast<uint16_t*>(peer_y[p]));
    peers.y_locks.push_back(group_ ? &group_->destination_lock(p) : &own_output_lock_);
  }
  reference::combine_send(layout_, base, fc2_out, peers);

  MEGAMOE_RETURN_IF_ERROR(sync(reference::kStageCombineDone, nullptr, &unused));
  if (!config_.in_kernel_fc2_reduce) reference::combine_reduce(layout_, base, T, ids, y_data);
  return Status::ok();
}

}  // namespace megamoe
