// MegaMoeLayer: the one-kernel GPU backend. The whole forward (dispatch, expert-pool placement,
// FC1 + SwiGLU, FC2, combine) is one persistent kernel on the caller's stream
// (src/kernels/mega/sm90_mega_kernel.cuh); no host synchronisation inside forward(); a captured
// forward is one kernel node. Formats: fp8-block or mxfp4 weights with fp8-block dispatch (mxfp4:
// the grouped GEMM's mxfp4 mode, 16-row tiles at every T), or bf16 weights with bf16 dispatch, or
// nvfp4 weights with bf16 dispatch (as routed: expanded to bf16 at upload, the bf16 machinery with
// FC1's scaled SwiGLU epilogue for w13's global scales and w2's folded into each slot's weight at
// placement); every combine wire (bf16 rows per slot written by FC2's epilogue; a quantised wire or
// the owner reduce sent after FC2 from FC2's bf16 rows); hidden a multiple of 256.
//
// Buffers: the symmetric workspace (EpTransport, mega layout, shared through WorkspacePool by every
// layer of the same geometry); the prepared weights (per layer); the kernel's local counters
// (MegaScratchLayout), shared by the layers of the group on the device like the workspace (zero at
// rest: every launch leaves them as it found them).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "comm/gpu_comm.h"
#include "core/backends.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "kernels/common/layer_buffers.h"
#include "kernels/mega/mega_schedule.h"
#include "kernels/mega/sm90_mega.h"
#include "kernels/routed/sm90_routing.h"
#include "kernels/transport/ep_transport.h"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

class MegaMoeLayer final : public MoeLayer {
 public:
  MegaMoeLayer(const MoeGeometry& g, const MoeConfig& c, BackendSelection s, PreparedWeights w)
      : MoeLayer(g, c, std::move(s), std::move(w)) {}

  Status init(std::shared_ptr<Communicator> comm, const MoeWeights* device_weights) {
    if (!comm) {  // EP1 without a communicator: the current device's one-rank NCCL group
      int dev = 0;
      MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
      MEGAMOE_RETURN_IF_ERROR(single_rank_group(dev, &comm));
    }
    GpuRankComm* gpu = gpu_rank_of(comm.get());
    if (!gpu)
      return invalid_argument("argument", "comm", comm->to_string(),
                              "the mega backend needs a GPU group's communicator (create_nccl_group / "
                              "create_nccl_rank / create_shared_gpu_group)");
    device_ = gpu->device();
    group_id_ = comm->group_id();
    rank_ = comm->rank();
    // invariant (shared device): the kernel of this rank launches at most sm_budget() CTAs, so every
    // rank's CTAs are resident at once (GpuRankComm::sm_budget).
    sm_budget_ = gpu->shares_device() ? gpu->sm_budget() : 0;
    CudaDeviceGuard guard(device_);
    if (!guard.ok()) return Status(StatusCode::kCudaError, "cannot select cuda:" + str(device_));
    EpTransportOptions opt;
    opt.params = workspace_params(geometry_, config_);
    opt.params.mega = 1;  // also when `auto` chose this backend
    opt.pow2_scales = config_.pow2_scales;
    opt.num_sms = config_.knobs.num_sms;
    MEGAMOE_RETURN_IF_ERROR(EpTransport::create(std::move(comm), opt, &transport_));
    // From the host's prepared weights, or prepared on the device from device-resident views (bit
    // for bit the same buffers).
    ExpertWeightBuffers w;
    if (device_weights)
      MEGAMOE_RETURN_IF_ERROR(prepare_device_expert_weights(device_, geometry_, config_, *device_weights, &w));
    else
      MEGAMOE_RETURN_IF_ERROR(upload_expert_weights(device_, geometry_, weights_, &w));
    weights_dev_ = std::move(w);
    return Status::ok();
  }

  Status expert_weight_views(std::vector<ExpertWeightView>* out) override {
    return expert_weight_views_of(geometry_, config_.weight_format, weights_dev_, out);
  }

  Status warmup() override {
    if (plan_) return Status::ok();
    CudaDeviceGuard guard(device_);
    MEGAMOE_RETURN_IF_ERROR(transport_->warmup(nullptr));
    const WorkspaceLayout& l = transport_->layout();
    const mega::MegaScratchLayout sl =
        mega::MegaScratchLayout::make(l.pool_rows, geometry_.experts_per_rank(), kCountersBytes);
    if (!scratch_)
      MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchMega, sl.total, &scratch_, /*zero=*/true));
    // int32 ids and fp32 weights of a forward given int64 ids or bf16 weights (the kernel reads those).
    if (!routing_)
      MEGAMOE_RETURN_IF_ERROR(
          device_alloc(device_, std::max<int64_t>(1, geometry_.max_tokens_per_rank * geometry_.top_k * 8), &routing_));
    int sms = 0;
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    mega::MegaPlanArgs pa;
    transport_->kernel_params(0, &pa.transport);
    pa.fp8 = fp8();
    pa.weight_fp4 = config_.weight_format == WeightFormat::kMxfp4;
    pa.weight_nvfp4 = config_.weight_format == WeightFormat::kNvfp4;
    pa.intermediate = static_cast<int32_t>(geometry_.intermediate);
    pa.w13 = weights_dev_.w13->ptr;
    pa.w2 = weights_dev_.w2->ptr;
    if (config_.weight_format == WeightFormat::kFp8Block) {
      pa.w13_scales = static_cast<const float*>(weights_dev_.w13_scales->ptr);
      pa.w2_scales = static_cast<const float*>(weights_dev_.w2_scales->ptr);
    }
    if (pa.weight_nvfp4) {
      if (!weights_dev_.w13_expert_scale || !weights_dev_.w2_expert_scale)
        return Status(StatusCode::kInternal, "mega warmup: nvfp4 weights without their global scales on the device");
      pa.w13_expert_scale = static_cast<const float*>(weights_dev_.w13_expert_scale->ptr);
      pa.w2_expert_scale = static_cast<const float*>(weights_dev_.w2_expert_scale->ptr);
    }
    pa.pow2_scales = config_.pow2_scales;
    for (int r = 0; r < transport_->size(); ++r)
      pa.peer_combine[r] = static_cast<char*>(transport_->peer_base(r)) + l.combine.offset;
    pa.scratch = scratch_->ptr;
    if (mega::mega_staged_combine(l.params.combine_format, l.params.owner_reduce != 0)) {
      // FC2's unweighted bf16 rows for the staged send (shared like the routed backend's expert_out).
      if (!expert_out_)
        // Zeroed once (FC2's TMA stores do not count as initialising for compute-sanitizer's initcheck).
        MEGAMOE_RETURN_IF_ERROR(shared_scratch(device_, group_id_, rank_, kScratchExpertOut,
                                               l.pool_rows * geometry_.hidden * 2, &expert_out_, /*zero=*/true));
      pa.expert_out = expert_out_->ptr;
    }
    // One CTA per SM (fewer with Knobs::num_sms, to leave SMs to concurrent work; at most the rank's
    // SM budget on a shared device).
    const int budget = sm_budget_ > 0 ? std::min(sm_budget_, sms) : sms;
    pa.grid = config_.knobs.num_sms > 0 ? std::min(config_.knobs.num_sms, budget) : budget;
    pa.block_m_knob = config_.knobs.block_m;
    pa.cooperative = sm_budget_ == 0 && !env_knobs().mega_plain_launch;
    pa.output_scale = config_.output_scale;
    MEGAMOE_RETURN_IF_ERROR(mega::make_mega_plan(pa, &plan_));
    return Status::ok();
  }

  Status forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& y,
                 void* stream_ptr, const TensorView& x_scale) override {
    MEGAMOE_RETURN_IF_ERROR(
        validate_forward_args(geometry_, config_, device(), x, x_scale, topk_ids, topk_weights, y));
    if (!broken_.is_ok())
      return Status(broken_.code(), "the layer's EP group failed in an earlier forward and cannot run again (" +
                                        broken_.message() + "); rebuild the communicator and the layers");
    if (!plan_)
      return Status(StatusCode::kFailedPrecondition,
                    "forward() before warmup(): call warmup() on every rank first (it allocates the symmetric "
                    "workspace collectively and must run before any CUDA-graph capture)");
    CudaDeviceGuard guard(device_);
    mega::MegaForwardArgs f;
    f.num_tokens = x.shape[0];
    f.x = x.data;
    f.x_fp8 = x.dtype == DType::kFloat8E4M3;
    f.x_scale = f.x_fp8 ? x_scale.ptr<float>() : nullptr;
    f.topk_ids = topk_ids.dtype == DType::kInt32 ? topk_ids.ptr<int32_t>() : nullptr;
    f.topk_weights = topk_weights.dtype == DType::kFloat32 ? topk_weights.ptr<float>() : nullptr;
    if (!f.topk_ids || !f.topk_weights) {
      // The kernel reads int32 ids and fp32 weights: int64 ids or bf16 weights go through the routed
      // backend's conversion kernel first (scale 1: the kernel applies output_scale itself, so the
      // weights it uses are fp32(output_scale * w) as routed's). Before the launch: a failure here
      // leaves this rank's epoch where its peers expect it.
      const int64_t n = topk_ids.shape[0] * geometry_.top_k;
      int32_t* ids32 = static_cast<int32_t*>(routing_->ptr);
      float* weights32 = reinterpret_cast<float*>(ids32 + geometry_.max_tokens_per_rank * geometry_.top_k);
      MEGAMOE_CUDA_CHECK(kernels::launch_routing_prep(
          topk_ids.data, topk_ids.dtype == DType::kInt64, topk_weights.data, topk_weights.dtype == DType::kBFloat16,
          1.0f, n, ids32, weights32, sm_budget_, static_cast<cudaStream_t>(stream_ptr)));
      f.topk_ids = ids32;
      f.topk_weights = weights32;
    }
    f.y = y.ptr<uint16_t>();
    f.trace = trace_;
    if (expert_counts_.present()) {
      f.expert_counts = expert_counts_.data;
      f.counts_int64 = expert_counts_.dtype == DType::kInt64;
    }
    const Status st = mega::launch_mega(*plan_, f, static_cast<cudaStream_t>(stream_ptr), &last_block_m_);
    if (!st.is_ok()) {
      broken_ = st;  // a launch that failed leaves this rank an epoch behind its peers
      return st;
    }
    if (trace_) MEGAMOE_CUDA_CHECK(cudaEventRecord(trace_done_, static_cast<cudaStream_t>(stream_ptr)));
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

  Status error_pending(bool* pending) override {
    CudaDeviceGuard guard(device_);
    return transport_->error_pending(pending);
  }

  // The kernel's timeline (bench): while enabled, every forward stamps each CTA's phases into a device
  // buffer; last_stage_times() reports, per phase, the latest CTA's time from the earliest start.
  Status set_stage_timing(bool enabled) override {
    CudaDeviceGuard guard(device_);
    if (enabled && !trace_buf_) {
      MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&trace_done_, cudaEventDisableTiming));
      int sms = 0;
      MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
      MEGAMOE_RETURN_IF_ERROR(device_alloc(device_, int64_t(sms) * mega::kMegaTraceWordsPerCta * 8, &trace_buf_));
      MEGAMOE_CUDA_CHECK(zero_device_sync(trace_buf_->ptr, size_t(sms) * mega::kMegaTraceWordsPerCta * 8));
    }
    trace_ = enabled ? static_cast<uint64_t*>(trace_buf_->ptr) : nullptr;
    return Status::ok();
  }

  Status last_stage_times(std::vector<StageTime>* out) override {
    if (!trace_ || !plan_)
      return Status(StatusCode::kFailedPrecondition,
                    "no timed forward yet: call set_stage_timing(true), then forward(), then this");
    CudaDeviceGuard guard(device_);
    // This layer's last forward, then a private stream's copy (it waits for nothing else: a peer rank's
    // kernel on a shared GPU may still run).
    MEGAMOE_CUDA_CHECK(cudaEventSynchronize(trace_done_));
    const int grid = mega::mega_plan_grid(*plan_);
    std::vector<uint64_t> words(size_t(grid) * mega::kMegaTraceWordsPerCta);
    MEGAMOE_CUDA_CHECK(upload_sync(words.data(), trace_, words.size() * 8));
    uint64_t start = UINT64_MAX;
    for (int b = 0; b < grid; ++b) start = std::min(start, words[size_t(b) * mega::kMegaTraceWordsPerCta]);
    out->clear();
    uint64_t prev = start;
    // Phases in kernel order, each ending when its last CTA got there (fc1_done: the last FC1 epilogue).
    for (int w = 1; w < mega::kMegaTraceWordsPerCta; ++w) {
      const std::string name = mega::mega_trace_word_name(w);
      if (name.empty()) continue;
      uint64_t last = 0;
      for (int b = 0; b < grid; ++b) last = std::max(last, words[size_t(b) * mega::kMegaTraceWordsPerCta + w]);
      if (last == 0) last = prev;  // no CTA stamped it (no FC1 tile at all)
      out->push_back({"to_" + name, last >= prev ? 1e-3 * double(last - prev) : 0.0});
      prev = std::max(prev, last);
    }
    return Status::ok();
  }

  ~MegaMoeLayer() override {
    if (trace_done_) {
      CudaDeviceGuard guard(device_);
      cudaEventDestroy(trace_done_);
    }
  }

  Backend backend() const override { return Backend::kMega; }
  Device device() const override { return Device::cuda(device_); }

 private:
  static constexpr int64_t kCountersBytes = 64;  // >= sizeof(mega::MegaCounters)
  // e4m3 activations, wire and intermediate (fp8-block and mxfp4 weights); bf16 ones with bf16 and
  // nvfp4 weights (the pairing gate holds nvfp4 to a bf16 dispatch).
  bool fp8() const {
    return config_.weight_format == WeightFormat::kFp8Block || config_.weight_format == WeightFormat::kMxfp4;
  }

  int device_ = 0, rank_ = 0, sm_budget_ = 0;
  uint64_t group_id_ = 0;
  Status broken_;
  int last_block_m_ = 0;
  std::unique_ptr<EpTransport> transport_;
  ExpertWeightBuffers weights_dev_;
  std::shared_ptr<DeviceBuffer> scratch_, expert_out_, trace_buf_, routing_;
  uint64_t* trace_ = nullptr;
  TensorView expert_counts_;  // absent: not counting
  cudaEvent_t trace_done_ = nullptr;  // recorded after each traced forward
  mega::MegaPlanPtr plan_;
};

}  // namespace

Status mega_format_gate(const MoeGeometry& g, const MoeConfig& c) {
  MEGAMOE_RETURN_IF_ERROR(weight_dispatch_pairing_gate("mega", c));
  if (c.weight_format != WeightFormat::kFp8Block && c.weight_format != WeightFormat::kBf16 &&
      c.weight_format != WeightFormat::kMxfp4 && c.weight_format != WeightFormat::kNvfp4)
    return Status(StatusCode::kUnavailable, std::string("the mega backend has no ") + to_string(c.weight_format) +
                                                " weights yet (fp8-block, mxfp4, nvfp4 or bf16)");
  MEGAMOE_RETURN_IF_ERROR(mxfp4_shape_gate("mega", g, c));
  if (g.hidden % mega::kMegaBlockN != 0)
    return Status(StatusCode::kUnavailable, "the mega backend needs hidden a multiple of 256 (its FC2 tiles are 256 wide; got hidden=" +
                                                str(g.hidden) + ")");
  if (g.experts_per_rank() > mega::kMegaMaxLocalExperts)
    return Status(StatusCode::kUnavailable, "the mega backend takes at most 512 local experts (got " +
                                                str(g.experts_per_rank()) + " = num_experts / ep_size)");
  if (g.num_experts > mega::kMegaMaxExperts)
    return Status(StatusCode::kUnavailable, "the mega backend takes at most 4096 experts (got num_experts=" +
                                                str(g.num_experts) + ")");
  if (g.max_tokens_per_rank < 1)
    return Status(StatusCode::kUnavailable, "the mega backend needs max_tokens_per_rank >= 1 (got " +
                                                str(g.max_tokens_per_rank) + ")");
  return Status::ok();
}

Status create_mega_layer(const MoeGeometry& g, const MoeConfig& c, BackendSelection selection, PreparedWeights weights,
                         std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out,
                         const MoeWeights* device_weights) {
  auto layer = std::make_unique<MegaMoeLayer>(g, c, std::move(selection), std::move(weights));
  MEGAMOE_RETURN_IF_ERROR(layer->init(std::move(comm), device_weights));
  *out = std::move(layer);
  return Status::ok();
}

}  // namespace megamoe
