// RoutedMoeLayer: the split-kernel GPU backend. Separate kernels on the caller's stream, no host
// synchronisation inside forward(), capturable in a CUDA graph after warmup():
//   dispatch (EpTransport: layout + copy to the experts' ranks + arrival wait, one kernel)
//   -> build_expert_pool (rows grouped by local expert, unpadded; per-row combine targets)
//   -> fp8 only: the pool's activation scales transposed M-major for FC1's TMA loads
//   -> FC1 grouped GEMM with the SwiGLU (+ fp8 1x128 requant) epilogue into the intermediate region
//   -> FC2 grouped GEMM: with a bf16 wire and one row per slot, its epilogue writes the weighted rows
//      into the source ranks' combine regions through the LSA pointers; else bf16 rows to expert_out
//   -> combine (the reduce alone) or send_and_combine (owner sums, encode, send, reduce) -> y.
// Formats: fp8-block weights with fp8-block dispatch, or bf16 weights with bf16 dispatch; every
// combine wire; no in-kernel FC2 reduce.
//
// Buffers: the symmetric workspace (EpTransport, shared through WorkspacePool by every layer of the
// same geometry); the prepared weights (per layer, device); scratch shared by every layer of the
// same sizes on a device (shared_scratch, kernels/common/layer_buffers.h): the M-major copy of the
// pool's activation scales that FC1 reads, FC2's bf16 rows [pool_rows, H] where the combine reads
// them (a quantised wire or the owner reduce), and the GEMMs' tile counter. Sharing is safe for the
// same reason the workspace is: the layers of a model run one after another on a stream.
#include <cuda_runtime.h>

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "comm/gpu_comm.h"
#include "core/backends.h"
#include "core/cuda_check.h"
#include "core/log.h"
#include "kernels/common/layer_buffers.h"
#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "kernels/routed/sm90_routing.h"
#include "kernels/routed/sm90_scale_transpose.h"
#include "kernels/transport/ep_transport.h"

namespace megamoe {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

class RoutedMoeLayer final : public MoeLayer {
 public:
  RoutedMoeLayer(const MoeGeometry& g, const MoeConfig& c, BackendSelection s, PreparedWeights w)
      : MoeLayer(g, c, std::move(s), std::move(w)) {}

  Status init(std::shared_ptr<Communicator> comm) {
    if (!comm) {  // EP1 without a communicator: the current device's one-rank NCCL group
      int dev = 0;
      MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
      MEGAMOE_RETURN_IF_ERROR(single_rank_group(dev, &comm));
    }
    GpuRankComm* gpu = gpu_rank_of(comm.get());
    if (!gpu)
      return invalid_argument("argument", "comm", comm->to_string(),
                              "the routed backend needs a GPU group's communicator (create_nccl_group / "
                              "create_nccl_rank / create_shared_gpu_group)");
    device_ = gpu->device();
    group_id_ = comm->group_id();
    rank_ = comm->rank();
    // invariant (shared device): each kernel of this rank launches at most sm_budget() CTAs
    // (GpuRankComm::sm_budget), the GEMMs' persistent grids and a num_sms knob included.
    gemm_sms_ = gpu->shares_device() ? gpu->sm_budget() : 0;
    CudaDeviceGuard guard(device_);
    if (!guard.ok()) return Status(StatusCode::kCudaError, "cannot select cuda:" + str(device_));

    EpTransportOptions opt;
    opt.params = workspace_params(geometry_, config_);
    opt.pow2_scales = config_.pow2_scales;
    opt.num_sms = config_.knobs.num_sms;
    opt.combine_groups = config_.knobs.combine_groups;
    MEGAMOE_RETURN_IF_ERROR(EpTransport::create(std::move(comm), opt, &transport_));
    return upload_weights();
  }

  Status warmup() override {
    CudaDeviceGuard guard(device_);
    MEGAMOE_RETURN_IF_ERROR(transport_->warmup(nullptr));
    const WorkspaceLayout& l = transport_->layout();
    const int64_t P = l.pool_rows, H = geometry_.hidden;
    if (fp8() && !a_scales_)
      MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchAScales, P * (H / 128) * 4, &a_scales_));
    // expert_out only when the combine reads FC2's rows here (a quantised wire to encode, or the owner
    // reduce's sums); else a bf16 wire is FC2's own output.
    if (!fc2_writes_combine() && !expert_out_)
      MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchExpertOut, P * H * 2, &expert_out_));
    // int32 ids + fp32 (scaled) weights for forwards whose routing the transport cannot read as given.
    if (!routing_)
      MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchRouting,
                                             geometry_.max_tokens_per_rank * geometry_.top_k * 8, &routing_));
    // The GEMMs' dynamic tile counter: zero once here, every launch leaves it zero (shared like the
    // workspace: the layers of a group run in stream order).
    if (!tile_counter_) {
      MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchTileCounter, 2 * 4, &tile_counter_));
      MEGAMOE_CUDA_CHECK(zero_device_sync(tile_counter_->ptr, 2 * 4));
    }
    MEGAMOE_RETURN_IF_ERROR(build_gemm_args());
    warmed_up_ = true;
    return Status::ok();
  }

  Status forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& y,
                 void* stream_ptr, const TensorView& x_scale) override {
    MEGAMOE_RETURN_IF_ERROR(
        validate_forward_args(geometry_, config_, device(), x, x_scale, topk_ids, topk_weights, y));
    if (!broken_.is_ok())
      return Status(broken_.code(), "the layer's EP group failed in an earlier forward and cannot run again (" +
                                        broken_.message() + "); rebuild the communicator and the layers");
    if (!warmed_up_)
      return Status(StatusCode::kFailedPrecondition,
                    "forward() before warmup(): call warmup() on every rank first (it allocates the symmetric "
                    "workspace collectively and must run before any CUDA-graph capture)");
    CudaDeviceGuard guard(device_);
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    TensorView ids = topk_ids, weights = topk_weights;
    MEGAMOE_RETURN_IF_ERROR(prepare_routing(&ids, &weights, stream));
    // invariant: once dispatch is launched every later stage must launch too, or this rank falls an
    // epoch behind its peers; a failure from here on latches the layer as broken.
    const Status st = run_stages(x, x_scale, ids, weights, y, stream);
    if (!st.is_ok()) broken_ = st;
    return st;
  }

  Status set_expert_counts(const TensorView& counts) override {
    if (counts.present()) MEGAMOE_RETURN_IF_ERROR(validate_expert_counts(geometry_, device(), counts));
    expert_counts_ = counts;
    return Status::ok();
  }

  Status check_error(void* stream) override {
    CudaDeviceGuard guard(device_);
    const Status st = transport_->check_error(static_cast<cudaStream_t>(stream));
    if (st.code() == StatusCode::kTimeout) broken_ = st;  // the group is aborted for good
    return st;
  }

  Status set_stage_timing(bool enabled) override {
    CudaDeviceGuard guard(device_);
    if (enabled && !stage_events_[0]) {
      for (cudaEvent_t& e : stage_events_) MEGAMOE_CUDA_CHECK(cudaEventCreate(&e));
    }
    stage_timing_ = enabled;
    stage_recorded_ = false;
    return Status::ok();
  }

  Status last_stage_times(std::vector<StageTime>* out) override {
    if (!stage_timing_ || !stage_recorded_)
      return Status(StatusCode::kFailedPrecondition,
                    "no timed forward yet: call set_stage_timing(true), then forward(), then this");
    CudaDeviceGuard guard(device_);
    MEGAMOE_CUDA_CHECK(cudaEventSynchronize(stage_events_[kNumStages]));
    out->clear();
    for (int i = 0; i < kNumStages; ++i) {
      float ms = 0;
      MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, stage_events_[i], stage_events_[i + 1]));
      out->push_back({kStageNames[i], 1000.0 * ms});
    }
    return Status::ok();
  }

  ~RoutedMoeLayer() override {
    if (stage_events_[0]) {
      CudaDeviceGuard guard(device_);
      for (cudaEvent_t e : stage_events_) cudaEventDestroy(e);
    }
  }

  Backend backend() const override { return Backend::kRouted; }
  Device device() const override { return Device::cuda(device_); }

 private:
  bool fp8() const { return config_.weight_format == WeightFormat::kFp8Block; }
  // FC2's epilogue writes the per-slot bf16 combine rows itself (no combine_send); else it writes
  // expert_out, which send_and_combine encodes (a quantised wire) or sums per owner first.
  bool fc2_writes_combine() const { return config_.combine_dtype == CombineDtype::kBf16 && !config_.uses_owner_reduce(); }

  // The transport reads int32 ids and fp32 weights: int64 ids, bf16 weights or an output scale go
  // through one conversion kernel into the routing scratch first (int32 / fp32 with scale 1 launch
  // nothing). Before dispatch: a failure here leaves the group in step.
  Status prepare_routing(TensorView* ids, TensorView* weights, cudaStream_t stream) {
    const bool ids64 = ids->dtype == DType::kInt64, weights_bf16 = weights->dtype == DType::kBFloat16;
    if (!ids64 && !weights_bf16 && config_.output_scale == 1.0f) return Status::ok();
    const int64_t T = ids->shape[0], k = geometry_.top_k;
    int32_t* ids32 = static_cast<int32_t*>(routing_->ptr);
    float* weights32 = reinterpret_cast<float*>(ids32 + geometry_.max_tokens_per_rank * k);
    MEGAMOE_CUDA_CHECK(kernels::launch_routing_prep(ids->data, ids64, weights->data, weights_bf16, config_.output_scale,
                                                    T * k, ids32, weights32, gemm_sms_, stream));
    *ids = TensorView(ids32, DType::kInt32, {T, k}, device());
    *weights = TensorView(weights32, DType::kFloat32, {T, k}, device());
    return Status::ok();
  }

  // dispatch -> pool -> FC1 -> FC2 -> combine_send -> combine, with stage marks.
  Status run_stages(const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                    const TensorView& topk_weights, const TensorView& y, cudaStream_t stream) {
    const WorkspaceLayout& l = transport_->layout();
    const int64_t P = l.pool_rows, H = geometry_.hidden;
    MEGAMOE_RETURN_IF_ERROR(mark(0, stream));
    MEGAMOE_RETURN_IF_ERROR(transport_->dispatch(x, x_scale, topk_ids, topk_weights, stream));
    MEGAMOE_RETURN_IF_ERROR(mark(1, stream));
    MEGAMOE_RETURN_IF_ERROR(transport_->build_expert_pool(stream));
    if (expert_counts_.present()) {
      static_assert(kPoolSegmentAlign == 1, "segment sizes are the received rows only without padding");
      MEGAMOE_CUDA_CHECK(kernels::launch_accumulate_expert_counts(
          reinterpret_cast<const int32_t*>(static_cast<const char*>(transport_->base()) + l.expert_offsets.offset),
          geometry_.experts_per_rank(), expert_counts_.data, expert_counts_.dtype == DType::kInt64, gemm_sms_,
          stream));
    }
    MEGAMOE_RETURN_IF_ERROR(mark(2, stream));
    if (P > 0) {
      const int64_t T = x.ndim == 2 ? x.shape[0] : 0;
      if (fp8()) {
        const char* base = static_cast<const char*>(transport_->base());
        MEGAMOE_CUDA_CHECK(kernels::launch_scale_transpose(
            reinterpret_cast<const float*>(base + l.pool_x_scales.offset),
            reinterpret_cast<const int32_t*>(base + l.expert_offsets.offset) + geometry_.experts_per_rank(), P, H / 128,
            static_cast<float*>(a_scales_->ptr), P, stream));
      }
      // The tile bucket follows this forward's tokens (host-known, no sync): decode runs 64-row tiles.
      gemm::GroupedGemmArgs fc1 = fc1_, fc2 = fc2_;
      fc1.expected_m_per_expert = fc2.expected_m_per_expert = expected_rows_per_expert(T);
      MEGAMOE_RETURN_IF_ERROR(gemm::launch_grouped_gemm(fc1, stream));
      MEGAMOE_RETURN_IF_ERROR(mark(3, stream));
      MEGAMOE_RETURN_IF_ERROR(gemm::launch_grouped_gemm(fc2, stream));
    } else {
      MEGAMOE_RETURN_IF_ERROR(mark(3, stream));
    }
    MEGAMOE_RETURN_IF_ERROR(mark(4, stream));
    MEGAMOE_RETURN_IF_ERROR(mark(5, stream));
    if (fc2_writes_combine()) {
      MEGAMOE_RETURN_IF_ERROR(transport_->combine(topk_ids, y, stream));
    } else {  // (owner sums +) encode + send + reduce in one kernel (the combine_send stage reads 0)
      TensorView out(expert_out_->ptr, DType::kBFloat16, {P, H}, device());
      MEGAMOE_RETURN_IF_ERROR(transport_->send_and_combine(out, topk_ids, y, stream));
    }
    return mark(6, stream);
  }

  // Both GEMMs' arguments depend only on the geometry, the workspace and the weights: built and
  // validated once in warmup(), so a bad knob fails there and never between dispatch and combine.
  Status build_gemm_args() {
    const WorkspaceLayout& l = transport_->layout();
    char* base = static_cast<char*>(transport_->base());
    const int64_t P = l.pool_rows, H = geometry_.hidden, I = geometry_.intermediate;
    const int32_t El = static_cast<int32_t>(geometry_.experts_per_rank());
    gemm::GroupedGemmArgs fc1;  // FC1 + SwiGLU (+ fp8 requant): pool_x -> intermediate
    fc1.dtype = fp8() ? gemm::GemmDtype::kFp8Block : gemm::GemmDtype::kBf16;
    fc1.layout = gemm::GroupedLayout::kContiguous;
    fc1.epilogue = fp8() ? gemm::GemmEpilogue::kSwigluFp8 : gemm::GemmEpilogue::kSwigluBf16;
    fc1.num_experts = El;
    fc1.n = static_cast<int32_t>(2 * I);
    fc1.k = static_cast<int32_t>(H);
    fc1.a = base + l.pool_x.offset;
    fc1.m_rows = P;
    fc1.expert_offsets = reinterpret_cast<const int32_t*>(base + l.expert_offsets.offset);
    fc1.b = w13_->ptr;
    fc1.d = base + l.intermediate.offset;
    fc1.ldd = I;
    fc1.pow2_scales = config_.pow2_scales;
    fc1.tiles = tiles_for(fc1.n, /*swiglu=*/true);
    fc1.expected_m_per_expert = expected_rows_per_expert(geometry_.max_tokens_per_rank);
    if (fp8()) {
      fc1.a_scales = static_cast<const float*>(a_scales_->ptr);
      fc1.ld_a_scales = P;
      fc1.b_scales = static_cast<const float*>(w13_scales_->ptr);
      // invariant: the intermediate_scales region holds P * I/128 fp32, here M-major [I/128][P].
      fc1.d_scales = reinterpret_cast<float*>(base + l.intermediate_scales.offset);
      fc1.ld_d_scales = P;
    }
    // FC2: intermediate -> the source ranks' combine rows (bf16 wire, one row per slot: weighted in
    // fp32, one rounding, written through the LSA pointers), else -> expert_out (bf16, unweighted)
    // for the combine to sum (owner reduce) and encode.
    gemm::GroupedGemmArgs fc2;
    fc2.dtype = fc1.dtype;
    fc2.layout = gemm::GroupedLayout::kContiguous;
    fc2.epilogue = gemm::GemmEpilogue::kStoreBf16;
    fc2.num_experts = El;
    fc2.n = static_cast<int32_t>(H);
    fc2.k = static_cast<int32_t>(I);
    fc2.a = base + l.intermediate.offset;
    fc2.m_rows = P;
    fc2.expert_offsets = fc1.expert_offsets;
    fc2.b = w2_->ptr;
    fc2.ldd = H;
    if (!fc2_writes_combine()) {
      fc2.d = expert_out_->ptr;
    } else {
      const EpTransport::CombineTargets& targets = transport_->combine_targets();
      fc2.row_map = targets.pool_dst;
      fc2.row_weight = targets.pool_weight;
      fc2.num_peer_d = targets.num_ranks;
      fc2.peer_d_rows = static_cast<int32_t>(targets.rows_per_rank);
      for (int r = 0; r < targets.num_ranks; ++r) fc2.peer_d[r] = targets.peer_combine[r];
    }
    fc2.tiles = tiles_for(fc2.n, /*swiglu=*/false);
    fc1.tile_counter = fc2.tile_counter = static_cast<int32_t*>(tile_counter_->ptr);
    fc2.expected_m_per_expert = fc1.expected_m_per_expert;
    if (fp8()) {
      fc2.a_scales = fc1.d_scales;
      fc2.ld_a_scales = P;
      fc2.b_scales = static_cast<const float*>(w2_scales_->ptr);
    }
    if (P > 0) {
      MEGAMOE_RETURN_IF_ERROR(gemm::validate_grouped_gemm(fc1));
      MEGAMOE_RETURN_IF_ERROR(gemm::validate_grouped_gemm(fc2));
    }
    fc1_ = fc1;
    fc2_ = fc2;
    return Status::ok();
  }

  // Records stage boundary `i` (0 = start) when stage timing is on.
  Status mark(int i, cudaStream_t stream) {
    if (!stage_timing_) return Status::ok();
    if (i == 0) stage_recorded_ = false;  // until this forward's last mark
    MEGAMOE_CUDA_CHECK(cudaEventRecord(stage_events_[i], stream));
    if (i == kNumStages) stage_recorded_ = true;
    return Status::ok();
  }

  // Knobs as GEMM tiles; 0 leaves the field to the GEMM's heuristic for the forward's bucket. A
  // BLOCK_N the GEMM cannot run for this N (not 128/256, not dividing N, or not 256 for SwiGLU) is
  // left to the heuristic too. (The pool is not padded, so any BLOCK_M runs any segment.)
  gemm::GemmTileConfig tiles_for(int32_t n, bool swiglu) const {
    gemm::GemmTileConfig t;
    t.block_m = config_.knobs.block_m;
    const int32_t bn = config_.knobs.block_n;
    const bool bn_ok = swiglu ? bn == 256 : ((bn == 128 || bn == 256) && n % bn == 0);
    t.block_n = bn_ok ? bn : 0;
    t.num_sms = config_.knobs.num_sms;
    if (gemm_sms_ > 0) t.num_sms = t.num_sms > 0 ? std::min(t.num_sms, gemm_sms_) : gemm_sms_;
    // clusters of 2 exist for fp8 128 x 256 tiles; a knob that asks for them elsewhere is left to the
    // heuristic (which then runs none)
    const bool cluster_ok = fp8() && (t.block_m == 0 || t.block_m == 128) && (t.block_n == 0 || t.block_n == 256);
    t.cluster = config_.knobs.gemm_cluster == 2 && !cluster_ok ? 0 : config_.knobs.gemm_cluster;
    return t;
  }

  // The GEMM's tile bucket when every rank has `tokens`: the rows a busy expert gets under uniform
  // routing, mean + 2 standard deviations (Poisson), since a tile must hold an expert's rows rather
  // than their mean (deepseek-v3 EP2 at 1024 tokens: mean 64 rows, 64-row tiles ran FC1 in 1297 us,
  // 128-row tiles in 1160).
  int64_t expected_rows_per_expert(int64_t tokens) const {
    const double mean = static_cast<double>(geometry_.ep_size * tokens * geometry_.top_k) / geometry_.num_experts;
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(mean + 2.0 * std::sqrt(mean))));
  }

  // w13 reordered for the SwiGLU epilogue (gemm_weights.h), w2 as prepared; fp32 block scales.
  Status upload_weights() {
    ExpertWeightBuffers w;
    MEGAMOE_RETURN_IF_ERROR(upload_expert_weights(device_, geometry_, fp8(), weights_, &w));
    w13_ = std::move(w.w13);
    w13_scales_ = std::move(w.w13_scales);
    w2_ = std::move(w.w2);
    w2_scales_ = std::move(w.w2_scales);
    return Status::ok();
  }

  static constexpr int kNumStages = 6;
  static constexpr const char* kStageNames[kNumStages] = {"dispatch", "expert_pool", "fc1_swiglu",
                                                          "fc2",      "combine_send", "combine"};
  int device_ = 0, rank_ = 0;
  int gemm_sms_ = 0;  // > 0 on a shared device: the GEMMs' grid bound (the rank's SM budget)
  uint64_t group_id_ = 0;
  Status broken_;  // the first failure that left this rank out of step with its group
  gemm::GroupedGemmArgs fc1_, fc2_;
  bool warmed_up_ = false;           // warmup() completed: workspace, scratch, GEMM arguments
  bool stage_timing_ = false, stage_recorded_ = false;
  cudaEvent_t stage_events_[kNumStages + 1] = {};
  std::unique_ptr<EpTransport> transport_;
  std::shared_ptr<DeviceBuffer> w13_, w13_scales_, w2_, w2_scales_;
  std::shared_ptr<DeviceBuffer> a_scales_, expert_out_, tile_counter_, routing_;
  TensorView expert_counts_;  // absent: not counting
};

}  // namespace

Status routed_format_gate(const MoeGeometry& g, const MoeConfig& c) {
  if (c.weight_format == WeightFormat::kFp8Block && c.dispatch_format != DispatchFormat::kFp8Block)
    return Status(StatusCode::kUnavailable,
                  "the routed backend runs fp8-block weights with dispatch_format=fp8-block (got dispatch_format=" +
                      std::string(to_string(c.dispatch_format)) + ")");
  if (c.weight_format == WeightFormat::kBf16 && c.dispatch_format != DispatchFormat::kBf16)
    return Status(StatusCode::kUnavailable,
                  "the routed backend runs bf16 weights with dispatch_format=bf16 (got dispatch_format=" +
                      std::string(to_string(c.dispatch_format)) + ")");
  if (c.weight_format != WeightFormat::kFp8Block && c.weight_format != WeightFormat::kBf16)
    return Status(StatusCode::kUnavailable, std::string("the routed backend has no ") + to_string(c.weight_format) +
                                                " grouped GEMM yet (fp8-block or bf16 weights)");
  if (g.experts_per_rank() > 512)
    return Status(StatusCode::kUnavailable, "the routed backend's grouped GEMM takes at most 512 local experts (got " +
                                                std::to_string(g.experts_per_rank()) + " = num_experts / ep_size)");
  if (c.in_kernel_fc2_reduce)
    return Status(StatusCode::kUnavailable,
                  "the routed backend has no in-kernel FC2 reduce yet (its FC2 writes local rows that combine sends)");
  return Status::ok();
}

Status create_routed_layer(const MoeGeometry& g, const MoeConfig& c, BackendSelection selection,
                           PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out) {
  auto layer = std::make_unique<RoutedMoeLayer>(g, c, std::move(selection), std::move(weights));
  MEGAMOE_RETURN_IF_ERROR(layer->init(std::move(comm)));
  *out = std::move(layer);
  return Status::ok();
}

}  // namespace megamoe
