#include "kernels/transport/ep_transport.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "comm/gpu_comm.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace {

using kernels::InputStatus;
using kernels::TransportArgs;

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

struct ScratchLayout {
  int64_t pool_intra = 0, pool_hist = 0, seg_total = 0, pool_dst = 0, pool_weight = 0, recv_pool_row = 0;
  int64_t input_status = 0;
  int64_t dispatch_accum = 0, token_rows = 0, combine_counters = 0, backend_counters = 0, gated_offsets = 0;
  int64_t total = 0;
  static ScratchLayout make(const WorkspaceParams& p) {
    ScratchLayout s;
    const int64_t R = p.ep_size, T = std::max<int64_t>(p.max_tokens_per_rank, 1), k = p.top_k;
    const int64_t chunks = (T + kernels::kPoolChunkRows - 1) / kernels::kPoolChunkRows;
    int64_t cur = 0;
    auto take = [&cur](int64_t* off, int64_t bytes) {
      *off = cur;
      cur = align256(cur + bytes);
    };
    take(&s.pool_intra, R * T * k * 4);
    take(&s.pool_hist, R * chunks * p.experts_per_rank * 4);
    take(&s.seg_total, p.experts_per_rank * 4);
    const int64_t P = WorkspaceLayout::pool_rows_for(p);
    take(&s.pool_dst, P * 4);
    take(&s.pool_weight, P * 4);
    take(&s.recv_pool_row, p.owner_reduce ? R * T * k * 4 : 0);
    take(&s.input_status, sizeof(InputStatus));
    take(&s.dispatch_accum, sizeof(kernels::DispatchAccum));
    take(&s.token_rows, T * R * 4);
    take(&s.combine_counters, sizeof(kernels::CombineCounters));
    take(&s.backend_counters, kernels::kBackendCounterWords * 4);
    take(&s.gated_offsets, 2 * (p.experts_per_rank + 1) * 4);
    s.total = cur;
    return s;
  }
};

TransportArgs make_args(const EpTransport& t, void* scratch, const EpTransportOptions& o, int64_t num_tokens,
                          bool allow_pdl, int64_t gate_rows = -1);

// Refuses collective work while this stream (or, in global capture mode, any stream) is capturing.
Status refuse_during_capture(cudaStream_t stream, const char* what) {
  bool capturing = false;
  if (stream) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    MEGAMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
    capturing = st != cudaStreamCaptureStatusNone;
  }
  if (!capturing) {
    cudaStreamCaptureStatus legacy = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(cudaStreamLegacy, &legacy);
    if (err != cudaSuccess) cudaGetLastError();
    capturing = err == cudaErrorStreamCaptureImplicit || (err == cudaSuccess && legacy != cudaStreamCaptureStatusNone);
  }
  if (capturing)
    return Status(StatusCode::kFailedPrecondition,
                  std::string(what) +
                      " during CUDA-graph capture: allocation and registration of the symmetric workspace are "
                      "collective and cannot be captured; call warmup() on every rank first, then capture");
  return Status::ok();
}

bool on_device(const TensorView& t, int device) { return t.device.kind == DeviceKind::kCuda && t.device.index == device; }

std::string shape_of(const TensorView& t) { return t.to_string(); }

}  // namespace

const char* transport_stage_name(int32_t stage) {
  switch (stage) {
    case kernels::kStageDispatchDone: return "dispatch-done";
    case kernels::kStageCombineDone: return "combine-done";
    case kernels::kStageMegaGrid: return "mega-grid-barrier";
    case kernels::kStageMegaFc1: return "mega-fc1-rows";
    case kernels::kStageMegaPlaced: return "mega-rows-placed";
    default: return "unknown-stage";
  }
}

Status EpTransportOptions::validate() const {
  const WorkspaceParams& p = params;
  static_assert(EpTransport::kMaxCombinePeers == kernels::kMaxTransportRanks, "one rank bound");
  if (p.ep_size < 1 || p.ep_size > kernels::kMaxTransportRanks)
    return invalid_argument("EP transport", "ep_size", std::to_string(p.ep_size),
                            "must be in [1, 8] (one NVLink domain)");
  if (p.experts_per_rank < 1 || p.experts_per_rank * p.ep_size > 65535)
    return invalid_argument("EP transport", "experts_per_rank", std::to_string(p.experts_per_rank),
                            "must be >= 1, with experts_per_rank * ep_size <= 65535");
  if (p.top_k < 1 || p.top_k > kernels::kMaxTopK)
    return invalid_argument("EP transport", "top_k", std::to_string(p.top_k), "must be in [1, 16]");
  if (p.hidden < 128 || p.hidden % 128 != 0)
    return invalid_argument("EP transport", "hidden", std::to_string(p.hidden), "must be a positive multiple of 128");
  if (p.max_tokens_per_rank < 0 || p.max_tokens_per_rank > 65535)
    return invalid_argument("EP transport", "max_tokens_per_rank", std::to_string(p.max_tokens_per_rank),
                            "must be in [0, 65535]");
  if (p.segment_align < 1)
    return invalid_argument("EP transport", "segment_align", std::to_string(p.segment_align), "must be >= 1");
  if (p.dispatch_format != kWsBf16 && p.dispatch_format != kWsFp8Block)
    return invalid_argument("EP transport", "dispatch_format", std::to_string(p.dispatch_format), "bf16 or fp8-block");
  if (p.combine_format != kWsBf16 && p.combine_format != kWsMxfp8 && p.combine_format != kWsNvfp4)
    return invalid_argument("EP transport", "combine_format", std::to_string(p.combine_format),
                            "bf16, mxfp8 or nvfp4");
  if (combine_groups < 0 || combine_groups > kernels::kMaxCombineGroups)
    return invalid_argument("EP transport", "combine_groups", std::to_string(combine_groups),
                            "must be in [0, 8] (0: by the token count)");
  if (p.in_kernel_fc2_reduce && !p.mega)
    return invalid_argument("EP transport", "in_kernel_fc2_reduce", "1",
                            "needs mega=1: the transport's combine reduces staged rows, only the mega kernel "
                            "reduces FC2 into the output itself");
  return Status::ok();
}

Status EpTransport::create(std::shared_ptr<Communicator> comm, const EpTransportOptions& options,
                           std::unique_ptr<EpTransport>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a transport handle");
  GpuRankComm* gpu = gpu_rank_of(comm.get());
  if (!gpu)
    return invalid_argument("EP transport", "comm", comm ? comm->to_string() : "null",
                            "must be a GPU group's communicator (create_nccl_group / create_nccl_rank / "
                            "create_shared_gpu_group)");
  MEGAMOE_RETURN_IF_ERROR(options.validate());
  if (options.params.ep_size != comm->size())
    return invalid_argument("EP transport", "ep_size", std::to_string(options.params.ep_size),
                            "must equal the communicator's size " + std::to_string(comm->size()));
  std::unique_ptr<EpTransport> t(new EpTransport());
  t->comm_ = std::move(comm);
  t->gpu_ = gpu;
  t->options_ = options;
  t->layout_ = WorkspaceLayout::make(options.params);
  t->rank_ = gpu->rank();
  t->size_ = gpu->size();
  t->device_ = gpu->device();
  t->num_experts_ = options.params.ep_size * options.params.experts_per_rank;
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, t->device_));
  // invariant (shared device): every kernel of this rank launches at most sm_budget() CTAs; the
  // launchers make up to 2 CTAs per SM they shape for, so they shape for half the budget, a knob
  // included, and no kernel launches early (PDL) to hold SMs outside it.
  const int shape_sms = gpu->shares_device() ? std::max(1, gpu->sm_budget() / 2) : prop.multiProcessorCount;
  t->shape_sms_ = shape_sms;
  t->num_sms_ = options.num_sms > 0 ? std::min(options.num_sms, shape_sms) : shape_sms;
  t->allow_pdl_ = !gpu->shares_device();
  t->shares_device_ = gpu->shares_device();
  *out = std::move(t);
  return Status::ok();
}

Status EpTransport::set_launch_options(int num_sms, int combine_groups) {
  EpTransportOptions o = options_;
  o.num_sms = num_sms;
  o.combine_groups = combine_groups;
  MEGAMOE_RETURN_IF_ERROR(o.validate());
  if (num_sms < 0)
    return invalid_argument("EP transport", "num_sms", std::to_string(num_sms), "must be >= 0 (0: every SM)");
  options_ = o;
  num_sms_ = num_sms > 0 ? std::min(num_sms, shape_sms_) : shape_sms_;
  return Status::ok();
}

EpTransport::~EpTransport() {
  // Never waits for a peer: the scratch is local (cudaFree waits for this device's work, whose waits
  // are bounded) and the workspace reference goes outside any CollectiveReleaseScope (a collective
  // deregistration is left to the communicator's teardown).
  if (scratch_ || snapshot_) {
    CudaDeviceGuard guard(device_);
    if (scratch_) cudaFree(scratch_);
    free_error_snapshot();
  }
  workspace_.reset();
}

namespace {
// The pinned snapshot error_pending() and check_error() read: [WaitError][signals region]
// [InputStatus], each 8-byte aligned.
constexpr size_t kSnapshotSignals = (sizeof(WaitError) + 7) / 8 * 8;
size_t snapshot_status_offset(const WorkspaceLayout& l) { return kSnapshotSignals + static_cast<size_t>(l.signals.bytes); }

// The snapshot's three copies on `stream`: error cell, signals region, this rank's input status.
cudaError_t copy_snapshot(char* snapshot, const void* base, const WorkspaceLayout& l, const void* input_status,
                          cudaStream_t stream) {
  const char* b = static_cast<const char*>(base);
  cudaError_t err = cudaMemcpyAsync(snapshot, b + l.error_cell.offset, sizeof(WaitError), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(snapshot + kSnapshotSignals, b + l.signals.offset, static_cast<size_t>(l.signals.bytes),
                          cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(snapshot + snapshot_status_offset(l), input_status, sizeof(InputStatus),
                          cudaMemcpyDeviceToHost, stream);
  return err;
}

// Rank s's abort word in a completed snapshot (0: it did not abort; else the stage + 1).
uint64_t snapshot_abort(const char* snapshot, int s) {
  uint64_t abort = 0;
  std::memcpy(&abort,
              snapshot + kSnapshotSignals + (static_cast<size_t>(s) * WorkspaceLayout::kSignalSlots + kernels::kSlotAbort) * 8,
              sizeof(abort));
  return abort;
}
}  // namespace

Status EpTransport::make_error_snapshot() {
  if (snapshot_) return Status::ok();
  const size_t bytes = snapshot_status_offset(layout_) + sizeof(InputStatus);
  void* host = nullptr;
  cudaError_t err = cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
  if (err == cudaSuccess) {
    std::memset(host, 0, bytes);
    snapshot_ = static_cast<char*>(host);
    err = cudaStreamCreateWithFlags(&snapshot_stream_, cudaStreamNonBlocking);
  }
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&snapshot_done_, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    free_error_snapshot();
    return cuda_status(err, "error_pending() snapshot (cudaHostAlloc, cudaStreamCreateWithFlags, cudaEventCreate)",
                       __FILE__, __LINE__);
  }
  return Status::ok();
}

// Bounded: an in-flight snapshot is three copies that wait for no kernel.
void EpTransport::free_error_snapshot() {
  if (snapshot_in_flight_) cudaEventSynchronize(snapshot_done_);
  snapshot_in_flight_ = false;
  error_seen_ = false;
  if (snapshot_done_) cudaEventDestroy(snapshot_done_);
  if (snapshot_stream_) cudaStreamDestroy(snapshot_stream_);
  if (snapshot_) cudaFreeHost(snapshot_);
  snapshot_done_ = nullptr;
  snapshot_stream_ = nullptr;
  snapshot_ = nullptr;
}

// Warmup either completes or leaves the transport as it was before (retryable): nothing is kept from
// a failed attempt (the workspace reference and the scratch are only committed at the end).
Status EpTransport::warmup(cudaStream_t stream) {
  if (warmed_up_) return Status::ok();
  if (released_)
    return Status(StatusCode::kFailedPrecondition, "EpTransport::warmup() after release(): build a new transport");
  MEGAMOE_RETURN_IF_ERROR(refuse_during_capture(stream, "EpTransport::warmup()"));
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  // Collective work below must not be disturbed by another thread's capture (one process driving
  // several ranks): relaxed capture mode for this thread, restored on every path.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  MEGAMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  Status st = [&]() -> Status {
    WorkspaceKey key;
    key.params = options_.params;
    key.ep_rank = rank_;
    key.group_id = comm_->group_id();
    key.device = Device::cuda(device_);
    key.lane = options_.workspace_lane;
    std::shared_ptr<Communicator> keep = comm_;  // the communicator outlives its workspaces
    GpuRankComm* gpu = gpu_;
    auto allocate = [keep, gpu](int64_t bytes, void** base, std::function<void(void*)>* release) {
      return gpu->symmetric_alloc(bytes, base, release);
    };
    std::shared_ptr<Workspace> ws;
    MEGAMOE_RETURN_IF_ERROR(WorkspacePool::global().acquire(key, allocate, &ws));
    std::vector<void*> peers;
    MEGAMOE_RETURN_IF_ERROR(gpu_->peer_bases(ws->base, &peers));
    if (static_cast<int>(peers.size()) != size_)
      return Status(StatusCode::kInternal, "the pooled workspace for " + key.to_string() + " has " +
                                               std::to_string(peers.size()) + " peer bases, not " + std::to_string(size_));
    const ScratchLayout sl = ScratchLayout::make(options_.params);
    std::unique_ptr<void, void (*)(void*)> scratch(nullptr, [](void* p) { cudaFree(p); });
    {
      void* p = nullptr;
      MEGAMOE_CUDA_CHECK(cudaMalloc(&p, sl.total));
      scratch.reset(p);
    }
    MEGAMOE_CUDA_CHECK(zero_device_sync(scratch.get(), sl.total));
    MEGAMOE_RETURN_IF_ERROR(make_error_snapshot());
    // Commit: nothing below fails.
    workspace_ = std::move(ws);
    base_ = workspace_->base;
    scratch_ = scratch.release();
    scratch_bytes_ = sl.total;
    for (int r = 0; r < size_; ++r) peer_base_[r] = peers[r];
    const TransportArgs args = make_args(*this, scratch_, options_, 0, allow_pdl_);
    combine_targets_ = CombineTargets{};
    backend_counters_ = args.backend_counters;
    gated_offsets_ = args.gated_offsets;
    warmed_up_ = true;
    // The owner reduce sums a token's rows here before one row goes out: no per-row targets.
    if (options_.params.owner_reduce) return Status::ok();
    combine_targets_.pool_dst = args.pool_dst;
    combine_targets_.pool_weight = args.pool_weight;
    combine_targets_.num_ranks = size_;
    combine_targets_.rows_per_rank = options_.params.max_tokens_per_rank * options_.params.top_k;
    // Where an FC2 epilogue writes each pool row's partial (the bf16 wire's rows are H bf16).
    for (int r = 0; r < size_; ++r) combine_targets_.peer_combine[r] = static_cast<char*>(peers[r]) + layout_.combine.offset;
    return Status::ok();
  }();
  cudaThreadExchangeStreamCaptureMode(&mode);
  return st;
}

Status EpTransport::release(int64_t timeout_ms) {
  if (released_) return Status::ok();
  released_ = true;
  if (!warmed_up_) return Status::ok();  // never took part in a collective allocation
  CudaDeviceGuard guard(device_);
  // Every rank here before any deregisters (the deregistration is collective); a rank that does not
  // come within the bound leaves the group broken and the window to the communicator's teardown.
  const Status st = gpu_->barrier("release", timeout_ms);
  warmed_up_ = false;
  base_ = nullptr;
  for (void*& p : peer_base_) p = nullptr;
  combine_targets_ = CombineTargets{};
  free_error_snapshot();
  if (scratch_) cudaFree(scratch_);
  scratch_ = nullptr;
  {
    CollectiveReleaseScope scope(st.is_ok() ? gpu_ : nullptr);
    workspace_.reset();
  }
  return st;
}

Status EpTransport::check_ready(cudaStream_t stream, const char* what) const {
  if (warmed_up_) return Status::ok();
  if (released_)
    return Status(StatusCode::kFailedPrecondition, std::string("EpTransport::") + what + " after release()");
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (stream) cudaStreamIsCapturing(stream, &cs);
  return Status(StatusCode::kFailedPrecondition,
                std::string("EpTransport::") + what + " before warmup()" +
                    (cs != cudaStreamCaptureStatusNone ? " inside CUDA-graph capture" : "") +
                    ": the symmetric workspace is allocated collectively in warmup(); call warmup() on every rank "
                    "first (before any capture)");
}

Status EpTransport::check_tokens(const TensorView& ids, const char* what, int64_t* num_tokens) const {
  const int64_t k = options_.params.top_k, T_max = options_.params.max_tokens_per_rank;
  if (ids.dtype != DType::kInt32 || ids.ndim != 2 || ids.shape[1] != k)
    return invalid_argument(what, "topk_ids", shape_of(ids), "must be int32 [T, " + std::to_string(k) + "]");
  if (ids.shape[0] > T_max)
    return invalid_argument(what, "T", std::to_string(ids.shape[0]),
                            "must be <= max_tokens_per_rank=" + std::to_string(T_max) + " (refused before launch)");
  if (ids.shape[0] > 0 && (!on_device(ids, device_) || !ids.is_contiguous()))
    return invalid_argument(what, "topk_ids", shape_of(ids),
                            "must be contiguous on cuda:" + std::to_string(device_));
  *num_tokens = ids.shape[0];
  return Status::ok();
}

namespace {
TransportArgs make_args(const EpTransport& t, void* scratch, const EpTransportOptions& o, int64_t num_tokens,
                          bool allow_pdl, int64_t gate_rows) {
  TransportArgs a{};
  const WorkspaceLayout& l = t.layout();
  const ScratchLayout sl = ScratchLayout::make(o.params);
  char* s = static_cast<char*>(scratch);
  a.sig.window = nullptr;  // every peer base is resolved (SignalCtx::peer_ptr never needs the window)
  a.sig.own_base = static_cast<char*>(t.base());
  for (int r = 0; r < t.size() && r < kernels::kMaxTransportRanks; ++r) a.sig.peer_base[r] = static_cast<char*>(t.peer_base(r));
  a.sig.signals_offset = l.signals.offset;
  a.sig.error_cell = reinterpret_cast<WaitError*>(static_cast<char*>(t.base()) + l.error_cell.offset);
  a.sig.rank = t.rank();
  a.sig.num_ranks = t.size();
  const int64_t ms = o.wait_timeout_ms > 0 ? o.wait_timeout_ms : env_knobs().wait_timeout_ms;
  a.sig.timeout_ns = ms * 1000000;
  a.layout = l;
  a.num_experts = o.params.ep_size * o.params.experts_per_rank;
  a.num_tokens = num_tokens;
  a.pow2_scales = o.pow2_scales;
  a.pool_intra = reinterpret_cast<int32_t*>(s + sl.pool_intra);
  a.pool_hist = reinterpret_cast<int32_t*>(s + sl.pool_hist);
  a.seg_total = reinterpret_cast<int32_t*>(s + sl.seg_total);
  a.pool_dst = reinterpret_cast<int32_t*>(s + sl.pool_dst);
  a.pool_weight = reinterpret_cast<float*>(s + sl.pool_weight);
  a.recv_pool_row = o.params.owner_reduce ? reinterpret_cast<int32_t*>(s + sl.recv_pool_row) : nullptr;
  a.input_status = reinterpret_cast<InputStatus*>(s + sl.input_status);
  a.dispatch_accum = reinterpret_cast<kernels::DispatchAccum*>(s + sl.dispatch_accum);
  a.token_rows = reinterpret_cast<int32_t*>(s + sl.token_rows);
  a.combine_counters = reinterpret_cast<kernels::CombineCounters*>(s + sl.combine_counters);
  a.allow_pdl = allow_pdl;
  a.backend_counters = reinterpret_cast<int32_t*>(s + sl.backend_counters);
  a.gated_offsets = reinterpret_cast<int32_t*>(s + sl.gated_offsets);
  a.gate_rows = gate_rows;
  a.el_div = kernels::ExactDiv16::make(static_cast<uint32_t>(l.params.experts_per_rank));
  return a;
}
}  // namespace

void EpTransport::kernel_params(int64_t num_tokens, TransportArgs* out) const {
  *out = make_args(*this, scratch_, options_, num_tokens, allow_pdl_);
}

Status EpTransport::dispatch(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                             const TensorView& topk_weights, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(stream, "dispatch()"));
  int64_t T = 0;
  MEGAMOE_RETURN_IF_ERROR(check_tokens(topk_ids, "dispatch", &T));
  const int64_t H = options_.params.hidden, k = options_.params.top_k;
  const bool x_fp8 = x.dtype == DType::kFloat8E4M3;
  if (!(x.dtype == DType::kBFloat16 || x_fp8) || x.ndim != 2 || x.shape[0] != T || x.shape[1] != H)
    return invalid_argument("dispatch", "x", shape_of(x),
                            "must be bfloat16 or float8_e4m3 [T=" + std::to_string(T) + ", H=" + std::to_string(H) + "]");
  if (T > 0 && (!on_device(x, device_) || !x.is_contiguous() || reinterpret_cast<uintptr_t>(x.data) % 16 != 0))
    return invalid_argument("dispatch", "x", shape_of(x),
                            "must be contiguous and 16-byte aligned on cuda:" + std::to_string(device_));
  if (x_fp8) {
    if (x_scale.dtype != DType::kFloat32 || x_scale.ndim != 2 || x_scale.shape[0] != T || x_scale.shape[1] != H / 128)
      return invalid_argument("dispatch", "x_scale", shape_of(x_scale),
                              "must be float32 [T, H/128] with an e4m3 x");
    if (T > 0 && (!on_device(x_scale, device_) || !x_scale.is_contiguous()))
      return invalid_argument("dispatch", "x_scale", shape_of(x_scale), "must be contiguous on the same device");
  }
  if (topk_weights.dtype != DType::kFloat32 || topk_weights.ndim != 2 || topk_weights.shape[0] != T ||
      topk_weights.shape[1] != k)
    return invalid_argument("dispatch", "topk_weights", shape_of(topk_weights), "must be float32 [T, k]");
  if (T > 0 && (!on_device(topk_weights, device_) || !topk_weights.is_contiguous()))
    return invalid_argument("dispatch", "topk_weights", shape_of(topk_weights), "must be contiguous on the same device");
  const bool fp8_wire = options_.params.dispatch_format == kWsFp8Block;
  const int mode = fp8_wire ? (x_fp8 ? kernels::kFp8Copy : kernels::kBf16ToFp8)
                            : (x_fp8 ? kernels::kFp8ToBf16 : kernels::kBf16Copy);
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  const TransportArgs args = make_args(*this, scratch_, options_, T, allow_pdl_);
  last_num_tokens_ = T;
  return kernels::launch_dispatch(args, mode, x.data, x_fp8 ? x_scale.ptr<float>() : nullptr, topk_ids.ptr<int32_t>(),
                                  topk_weights.ptr<float>(), num_sms_, static_cast<cudaStream_t>(stream));
}

Status EpTransport::build_expert_pool(cudaStream_t stream, int64_t gate_rows, const float* pool_weight_scale) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(stream, "build_expert_pool()"));
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  const TransportArgs args = make_args(*this, scratch_, options_, last_num_tokens_, allow_pdl_, gate_rows);
  return kernels::launch_expert_pool(args, num_sms_, stream, pool_weight_scale);
}

Status EpTransport::check_expert_out(const TensorView& out, const char* what) const {
  const int64_t P = layout_.pool_rows, H = options_.params.hidden;
  if (!(out.dtype == DType::kFloat32 || out.dtype == DType::kBFloat16) || out.ndim != 2 || out.shape[0] != P ||
      out.shape[1] != H)
    return invalid_argument(what, "expert_out", shape_of(out),
                            "must be float32 or bfloat16 [pool_rows=" + std::to_string(P) + ", H=" + std::to_string(H) +
                                "]");
  if (P > 0 && (!on_device(out, device_) || !out.is_contiguous() || reinterpret_cast<uintptr_t>(out.data) % 16 != 0))
    return invalid_argument(what, "expert_out", shape_of(out), "must be contiguous, 16-byte aligned, on the device");
  return Status::ok();
}

Status EpTransport::check_output(const TensorView& topk_ids, const TensorView& y, const char* what,
                                 int64_t* num_tokens) const {
  MEGAMOE_RETURN_IF_ERROR(check_tokens(topk_ids, what, num_tokens));
  const int64_t T = *num_tokens, H = options_.params.hidden;
  if (y.dtype != DType::kBFloat16 || y.ndim != 2 || y.shape[0] != T || y.shape[1] != H)
    return invalid_argument(what, "y", shape_of(y), "must be bfloat16 [T, H]");
  if (T > 0 && (!on_device(y, device_) || !y.is_contiguous() || reinterpret_cast<uintptr_t>(y.data) % 16 != 0))
    return invalid_argument(what, "y", shape_of(y), "must be contiguous, 16-byte aligned, on the device");
  return Status::ok();
}

Status EpTransport::check_staged_combine(const char* what) const {
  if (options_.params.in_kernel_fc2_reduce)
    return Status(StatusCode::kFailedPrecondition,
                  std::string(what) + ": this workspace has no staged combine rows (in_kernel_fc2_reduce=1: the "
                                      "mega kernel reduces FC2 into the output)");
  return Status::ok();
}

Status EpTransport::combine_send(const TensorView& out, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(stream, "combine_send()"));
  MEGAMOE_RETURN_IF_ERROR(check_staged_combine("combine_send()"));
  MEGAMOE_RETURN_IF_ERROR(check_expert_out(out, "combine_send"));
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  const TransportArgs args = make_args(*this, scratch_, options_, last_num_tokens_, allow_pdl_);
  return kernels::launch_combine_send(args, out.data, out.dtype == DType::kFloat32, num_sms_, stream);
}

Status EpTransport::combine(const TensorView& topk_ids, const TensorView& y, cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(stream, "combine()"));
  MEGAMOE_RETURN_IF_ERROR(check_staged_combine("combine()"));
  int64_t T = 0;
  MEGAMOE_RETURN_IF_ERROR(check_output(topk_ids, y, "combine", &T));
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  const TransportArgs args = make_args(*this, scratch_, options_, T, allow_pdl_);
  return kernels::launch_combine_reduce(args, topk_ids.ptr<int32_t>(), y.ptr<uint16_t>(), num_sms_, stream);
}

Status EpTransport::send_and_combine(const TensorView& expert_out, const TensorView& topk_ids, const TensorView& y,
                                     cudaStream_t stream) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(stream, "send_and_combine()"));
  MEGAMOE_RETURN_IF_ERROR(check_staged_combine("send_and_combine()"));
  MEGAMOE_RETURN_IF_ERROR(check_expert_out(expert_out, "send_and_combine"));
  int64_t T = 0;
  MEGAMOE_RETURN_IF_ERROR(check_output(topk_ids, y, "send_and_combine", &T));
  MEGAMOE_CUDA_CHECK(cudaSetDevice(device_));
  const TransportArgs args = make_args(*this, scratch_, options_, T, allow_pdl_);
  const int groups = options_.combine_groups > 0 ? options_.combine_groups : default_combine_groups(T);
  return kernels::launch_combine(args, expert_out.data, expert_out.dtype == DType::kFloat32, topk_ids.ptr<int32_t>(),
                                 y.ptr<uint16_t>(), groups, num_sms_, /*cooperative=*/!shares_device_, stream);
}

Status EpTransport::seed_epoch_for_test(uint64_t launches) {
  MEGAMOE_RETURN_IF_ERROR(check_ready(nullptr, "seed_epoch_for_test()"));
  CudaDeviceGuard guard(device_);
  std::vector<uint64_t> cells(static_cast<size_t>(layout_.signals.bytes / 8), 0);
  for (int s = 0; s < size_; ++s) {
    uint64_t* row = cells.data() + static_cast<size_t>(s) * WorkspaceLayout::kSignalSlots;
    row[kernels::kSlotDispatch] = kernels::dispatch_progress(launches);
    row[kernels::kSlotCombine] = kernels::combine_progress(launches, kernels::kCombineAllRows);
  }
  cells[static_cast<size_t>(rank_) * WorkspaceLayout::kSignalSlots + kernels::kLocalEpoch] = launches;
  MEGAMOE_CUDA_CHECK(upload_sync(static_cast<char*>(base_) + layout_.signals.offset, cells.data(), cells.size() * 8));
  return Status::ok();
}

Status EpTransport::error_pending(bool* pending) {
  *pending = false;
  if (released_)
    return Status(StatusCode::kFailedPrecondition, "EpTransport::error_pending() after release(): build a new transport");
  if (!warmed_up_) return Status::ok();
  if (!error_seen_) {
    CudaDeviceGuard guard(device_);
    // An event query is refused while another thread captures in global mode: relaxed for this
    // thread (none of the calls below touches a capturing stream), restored on every path.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    MEGAMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const Status st = [&]() -> Status {
      if (snapshot_in_flight_) {
        const cudaError_t q = cudaEventQuery(snapshot_done_);
        if (q == cudaErrorNotReady) {
          (void)cudaGetLastError();  // not an error: the snapshot is still on its way
          return Status::ok();
        }
        MEGAMOE_CUDA_CHECK(q);
        snapshot_in_flight_ = false;
        WaitError err{};
        std::memcpy(&err, snapshot_, sizeof(err));
        bool aborted = false;
        for (int s = 0; s < size_; ++s) aborted = aborted || snapshot_abort(snapshot_, s) != 0;
        InputStatus in{};
        std::memcpy(&in, snapshot_ + snapshot_status_offset(layout_), sizeof(in));
        error_seen_ = err.flag != 0 || aborted || in.bad_count != 0 || in.pool_overflow != 0;
        if (error_seen_) return Status::ok();
      }
      const ScratchLayout sl = ScratchLayout::make(options_.params);
      MEGAMOE_CUDA_CHECK(copy_snapshot(snapshot_, base_, layout_, static_cast<const char*>(scratch_) + sl.input_status,
                                       snapshot_stream_));
      MEGAMOE_CUDA_CHECK(cudaEventRecord(snapshot_done_, snapshot_stream_));
      snapshot_in_flight_ = true;
      return Status::ok();
    }();
    cudaThreadExchangeStreamCaptureMode(&mode);
    MEGAMOE_RETURN_IF_ERROR(st);
  }
  *pending = error_seen_;
  return Status::ok();
}

Status EpTransport::check_error(cudaStream_t stream) {
  if (!warmed_up_) return Status::ok();
  CudaDeviceGuard guard(device_);
  // error_pending()'s state restarts from what this check reports (it clears the bad-input counters).
  if (snapshot_in_flight_) MEGAMOE_CUDA_CHECK(cudaEventSynchronize(snapshot_done_));
  snapshot_in_flight_ = false;
  error_seen_ = false;
  // Copies on the caller's stream (not the legacy default stream, which would order against, or
  // break the capture of, other threads' work in a one-process multi-rank driver), into the pinned
  // snapshot: a copy to pageable memory is staged by the driver, and on a shared GPU a rank's staged
  // copy waiting for its stream must not be able to hold up a peer's launches.
  const ScratchLayout sl = ScratchLayout::make(options_.params);
  char* status_ptr = static_cast<char*>(scratch_) + sl.input_status;
  MEGAMOE_CUDA_CHECK(copy_snapshot(snapshot_, base_, layout_, status_ptr, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  WaitError err{};
  std::memcpy(&err, snapshot_, sizeof(err));
  if (err.flag != 0) {
    const int64_t ms = options_.wait_timeout_ms > 0 ? options_.wait_timeout_ms : env_knobs().wait_timeout_ms;
    std::ostringstream os;
    if (err.flag == kernels::kWaitTimeout) {
      os << "EP transport wait timed out: rank " << err.rank << " (SM " << err.sm << ") waited at stage "
         << transport_stage_name(err.stage) << " for peer rank " << err.peer << " to publish epoch " << err.expected
         << ", saw " << err.seen << " after " << ms << " ms (MEGAMOE_WAIT_TIMEOUT_MS); did rank " << err.peer
         << " skip a launch or fail? The group is aborted: rebuild it";
    } else if (err.flag == kernels::kWaitDesync) {
      os << "EP transport out of step: rank " << err.rank << " (SM " << err.sm << ") at stage "
         << transport_stage_name(err.stage) << " expected epoch " << err.expected << " but rank " << err.peer
         << " had already published " << err.seen
         << ": the ranks ran different numbers of forwards (a rank skipped or failed one). The group is aborted: "
            "rebuild it";
    } else {
      os << "EP transport aborted: rank " << err.rank << " (SM " << err.sm << ") stopped waiting at stage "
         << transport_stage_name(err.stage) << " (expected epoch " << err.expected << ", saw " << err.seen
         << ") because rank " << err.peer << " aborted the group earlier; rebuild it";
    }
    return Status(StatusCode::kTimeout, os.str());
  }
  // A peer may have aborted while none of this rank's waits noticed (they passed before it).
  for (int s = 0; s < size_; ++s) {
    const uint64_t abort = snapshot_abort(snapshot_, s);
    if (abort != 0)
      return Status(StatusCode::kTimeout, "EP transport aborted: rank " + std::to_string(s) +
                                              " gave up waiting at stage " +
                                              transport_stage_name(static_cast<int32_t>(abort - 1)) +
                                              " and aborted the group; rebuild it");
  }
  InputStatus in{};
  std::memcpy(&in, snapshot_ + snapshot_status_offset(layout_), sizeof(in));
  if (in.bad_count != 0 || in.pool_overflow != 0) {
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(status_ptr, 0, sizeof(in), stream));
    // Cleared before any later error_pending() snapshot (another stream) can read the counters.
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::ostringstream os;
    if (in.bad_count != 0) {
      os << "invalid topk_ids: topk_ids[" << in.first_token << ", " << in.first_slot << "]=" << in.first_value
         << ", must be -1 or a global expert id in [0, " << num_experts_
         << ") not repeated within the token (rank " << rank_ << ", " << in.bad_count
         << " bad slot(s) since the last check, each treated as -1)";
    } else {
      os << "EP transport: received counts exceed the expert pool on rank " << rank_ << " (" << in.pool_overflow
         << " time(s)); peers disagree on the geometry";
    }
    return Status(in.bad_count != 0 ? StatusCode::kInvalidArgument : StatusCode::kInternal, os.str());
  }
  return Status::ok();
}

}  // namespace megamoe
