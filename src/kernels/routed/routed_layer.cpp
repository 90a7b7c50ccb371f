// RoutedMoeLayer: the split-kernel GPU backend. Separate kernels on the caller's stream, no host
// synchronisation inside forward(), capturable in a CUDA graph after warmup():
//   dispatch (EpTransport: layout + copy to the experts' ranks + arrival wait, one kernel)
//   -> build_expert_pool (rows grouped by local expert, unpadded; per-row combine targets)
//   -> fp8 only: the pool's activation scales transposed M-major for FC1's TMA loads
//   -> FC1 grouped GEMM with the SwiGLU (+ fp8 1x128 requant) epilogue into the intermediate region
//   -> FC2 grouped GEMM: with a bf16 wire and one row per slot, its epilogue writes the weighted rows
//      into the source ranks' combine regions through the peer pointers; else bf16 rows to expert_out
//   -> combine (the reduce alone) or send_and_combine (owner sums, encode, send, reduce) -> y.
// Formats: fp8-block or mxfp4 weights with fp8-block dispatch (mxfp4: the GEMMs' mxfp4 mode, the
// e2m1 codes expanded to e4m3 in the pipeline; 16- and 32-row tiles only, hidden a multiple of 256),
// or bf16 weights with bf16 dispatch; every combine wire; no in-kernel FC2 reduce. nvfp4 weights with
// bf16 dispatch stay FP4 in HBM (the nvfp4 GEMM's images: e2m1 x e4m3 block scale expanded to bf16
// exactly in the pipeline, 16- and 32-row tiles, hidden a multiple of 256; at prefill expanded into a
// bf16 scratch for the bf16 GEMM, below), each expert's global scales in fp32: w13's on FC1's
// accumulators (the scaled SwiGLU epilogue), w2's folded into FC2's row weights by the pool build; so
// only with the bf16 wire written by FC2 (no owner reduce), where FC2 applies those row weights.
//
// Buffers and who shares them (layer.h states the rules for callers):
// - the symmetric workspace (EpTransport, WorkspacePool): every layer of one WorkspaceKey (geometry,
//   options, rank, group, device, lane);
// - scratch of the same key (KeyScratch below): the M-major copy of the pool's activation scales that
//   FC1 reads, FC2's bf16 rows [pool_rows, H] where the combine reads them (a quantised wire or
//   the owner reduce), and the FP4 prefill expansion (mxfp4 to e4m3, nvfp4 to bf16; a chunk of experts
//   within MEGAMOE_MXFP4_EXPAND_MIB, when T_max reaches the format's threshold). Layers of one key run one after
//   another on one stream, so sharing is safe;
//   forward() refuses two host threads inside it at once for one key (the one misuse cheap to see);
// - per layer: the prepared weights and the GEMMs' tile counters (in the transport's scratch, zeroed
//   by the pool build every forward before the GEMMs run).
//
// The GEMMs' tile bucket comes from this rank's T (host-known) or, with MEGAMOE_TILE_BUCKET=received
// (off by default until measured on a GPU), from the rows this rank actually received, decided on the
// device with no host synchronisation: when this rank's own tokens and the pool's bound would pick different
// tiles, each GEMM is launched twice, once per tile configuration, on two copies of the expert
// offsets that the pool build fills (EpTransport::build_expert_pool's gate): the copy for the larger
// tiles gets the offsets when the received rows reach the switch point, the other zeros (a kernel
// that finds no rows). A rank with T = 0 that receives a full pool runs prefill tiles.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "comm/gpu_comm.h"
#include "core/backends.h"
#include "core/cuda_check.h"
#include "core/env.h"
#include "core/log.h"
#include "kernels/common/layer_buffers.h"
#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/mxfp4_expand.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "kernels/routed/routed_gemm_args.h"
#include "kernels/routed/sm90_routing.h"
#include "kernels/routed/sm90_scale_transpose.h"
#include "kernels/transport/ep_transport.h"

namespace megamoe {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Scratch of the layers of one workspace key (see the top of this file); freed with its last user.
struct KeyScratch {
  std::mutex mutex;
  std::shared_ptr<DeviceBuffer> a_scales, expert_out, routing;
  // mxfp4 prefill: the fp8-block expansion of one chunk of experts' w13 (or w2: smaller),
  // routed_mxfp4_expand_chunk x 2I x H bytes, rewritten before each GEMM launch on the stream
  std::shared_ptr<DeviceBuffer> fp4_expanded;
  int64_t fp4_expanded_bytes = 0;
  std::atomic<int> host_forwards{0};  // threads inside forward() for this key
};

std::shared_ptr<KeyScratch> key_scratch(const WorkspaceKey& key) {
  static std::mutex mutex;
  static auto* entries = new std::map<WorkspaceKey, std::weak_ptr<KeyScratch>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::weak_ptr<KeyScratch>& slot = (*entries)[key];
  if (auto live = slot.lock()) return live;
  auto made = std::make_shared<KeyScratch>();
  slot = made;
  return made;
}

bool same_tiles(const gemm::GemmTileConfig& a, const gemm::GemmTileConfig& b) {
  return a.block_m == b.block_m && a.block_n == b.block_n && a.num_sms == b.num_sms && a.cluster == b.cluster &&
         a.round_robin == b.round_robin && a.fp4_math_wg == b.fp4_math_wg && a.ctas_per_sm == b.ctas_per_sm;
}

class RoutedMoeLayer final : public MoeLayer {
 public:
  RoutedMoeLayer(const MoeGeometry& g, const MoeConfig& c, BackendSelection s, PreparedWeights w)
      : MoeLayer(g, c, std::move(s), std::move(w)) {}

  Status init(std::shared_ptr<Communicator> comm, const MoeWeights* device_weights) {
    if (!comm) {  // EP1 without a communicator: the current device's one-rank NCCL group
      int dev = 0;
      MEGAMOE_CUDA_CHECK(cudaGetDevice(&dev));
      MEGAMOE_RETURN_IF_ERROR(single_rank_group(dev, &comm));
    }
    gpu_ = gpu_rank_of(comm.get());
    if (!gpu_)
      return invalid_argument("argument", "comm", comm->to_string(),
                              "the routed backend needs a GPU group's communicator (create_nccl_group / "
                              "create_nccl_rank / create_shared_gpu_group)");
    device_ = gpu_->device();
    // invariant (shared device): each kernel of this rank launches at most sm_budget() CTAs
    // (GpuRankComm::sm_budget), the GEMMs' persistent grids and a num_sms knob included.
    gemm_sms_ = gpu_->shares_device() ? gpu_->sm_budget() : 0;
    CudaDeviceGuard guard(device_);
    if (!guard.ok()) return Status(StatusCode::kCudaError, "cannot select cuda:" + str(device_));

    EpTransportOptions opt;
    opt.params = workspace_params(geometry_, config_);
    opt.pow2_scales = config_.pow2_scales;
    opt.num_sms = config_.knobs.num_sms;
    opt.combine_groups = config_.knobs.combine_groups;
    opt.workspace_lane = config_.workspace_lane;
    key_.params = opt.params;
    key_.ep_rank = comm->rank();
    key_.group_id = comm->group_id();
    key_.device = Device::cuda(device_);
    key_.lane = config_.workspace_lane;
    MEGAMOE_RETURN_IF_ERROR(EpTransport::create(std::move(comm), opt, &transport_));
    return upload_weights(device_weights);
  }

  // Collective; retryable: a failure keeps nothing of the attempt but what the transport kept (the
  // transport commits all or nothing), so calling it again redoes what is missing.
  Status warmup() override {
    if (warmed_up_) return Status::ok();
    if (released_) return Status(StatusCode::kFailedPrecondition, "warmup() after release(): build a new layer");
    CudaDeviceGuard guard(device_);
    MEGAMOE_RETURN_IF_ERROR(transport_->warmup(nullptr));
    const WorkspaceLayout& l = transport_->layout();
    const int64_t P = l.pool_rows, H = geometry_.hidden;
    std::shared_ptr<KeyScratch> scratch = key_scratch(key_);
    {
      std::lock_guard<std::mutex> lock(scratch->mutex);
      if (fp8() && !scratch->a_scales)
        MEGAMOE_RETURN_IF_ERROR(device_alloc(device_, P * (H / 128) * 4, &scratch->a_scales));
      // expert_out only when the combine reads FC2's rows here (a quantised wire to encode, or the
      // owner reduce's sums); else a bf16 wire is FC2's own output.
      // Zeroed once: FC2 fills it with TMA bulk stores, which compute-sanitizer's initcheck does not
      // count as initialising, so without it every read of a row FC2 wrote is reported.
      if (!routed_fc2_writes_combine(config_) && !scratch->expert_out) {
        MEGAMOE_RETURN_IF_ERROR(device_alloc(device_, P * H * 2, &scratch->expert_out));
        MEGAMOE_CUDA_CHECK(zero_device_sync(scratch->expert_out->ptr, static_cast<size_t>(P * H * 2)));
      }
      // int32 ids + fp32 (scaled) weights for forwards whose routing the transport cannot read as given.
      if (!scratch->routing)
        MEGAMOE_RETURN_IF_ERROR(
            device_alloc(device_, geometry_.max_tokens_per_rank * geometry_.top_k * 8, &scratch->routing));
    }
    // mxfp4: the prefill expansion's scratch when a forward of up to T_max tokens may expand
    // (allocated here: forward() allocates nothing, so it can be captured).
    RoutedMxfp4Expansion expansion;
    if (config_.weight_format == WeightFormat::kMxfp4)
      MEGAMOE_RETURN_IF_ERROR(routed_mxfp4_expansion(geometry_, env_knobs().mxfp4_expand_rows,
                                                     env_knobs().mxfp4_expand_mib, &expansion));
    if (config_.weight_format == WeightFormat::kNvfp4)
      MEGAMOE_RETURN_IF_ERROR(routed_nvfp4_expansion(geometry_, env_knobs().nvfp4_expand_rows,
                                                     env_knobs().mxfp4_expand_mib, &expansion));
    expand_rows_ = expansion.expands() && P > 0 ? expansion.threshold_rows : 0;  // 0: no forward expands
    expand_chunk_ = static_cast<int32_t>(expansion.chunk_experts);
    if (expand_rows_ > 0) {
      std::lock_guard<std::mutex> lock(scratch->mutex);
      // Layers of one key may differ in the bound (the knob re-read): the scratch grows to the
      // largest chunk, never shrinks (a captured graph of another layer may hold the old one: it is
      // kept alive by that layer's reference).
      const int64_t bytes = expansion.scratch_bytes;
      if (!scratch->fp4_expanded || scratch->fp4_expanded_bytes < bytes) {
        if (Status st = device_alloc(device_, bytes, &scratch->fp4_expanded); !st.is_ok())
          return Status(st.code(), nvfp4()
                                       ? "the routed nvfp4 layer's prefill expansion scratch (" + str(bytes) +
                                             " bytes: " + str(expansion.chunk_experts) + " experts x 2I x H bf16, from " +
                                             str(expansion.threshold_rows) +
                                             " rows per expert; MEGAMOE_MXFP4_EXPAND_MIB bounds it, "
                                             "MEGAMOE_NVFP4_EXPAND_ROWS=off drops it): " + st.message()
                                       : "the routed mxfp4 layer's prefill expansion scratch (" + str(bytes) +
                                             " bytes: " + str(expansion.chunk_experts) + " experts x 2I x H e4m3, from " +
                                             str(expansion.threshold_rows) +
                                             " rows per expert; MEGAMOE_MXFP4_EXPAND_MIB bounds it, "
                                             "MEGAMOE_MXFP4_EXPAND_ROWS=off drops it): " + st.message());
        scratch->fp4_expanded_bytes = bytes;
      }
      fp4_expanded_ = scratch->fp4_expanded;
    }
    MEGAMOE_RETURN_IF_ERROR(build_gemm_args(*scratch));
    scratch_ = std::move(scratch);
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
    if (released_) return Status(StatusCode::kFailedPrecondition, "forward() after release(): build a new layer");
    if (!warmed_up_)
      return Status(StatusCode::kFailedPrecondition,
                    "forward() before warmup(): call warmup() on every rank first (it allocates the symmetric "
                    "workspace collectively and must run before any CUDA-graph capture)");
    // The layers of one workspace key must not overlap (layer.h); two host threads inside forward()
    // at once for one key is the overlap cheap to see. Nothing is launched yet: refused, not latched.
    if (scratch_->host_forwards.fetch_add(1) != 0) {
      scratch_->host_forwards.fetch_sub(1);
      return Status(StatusCode::kFailedPrecondition,
                    "forward() called from two threads at once on layers that share a workspace (" + key_.to_string() +
                        "): such layers run one after another on one stream; layers that may overlap need "
                        "different MoeConfig::workspace_lane values");
    }
    CudaDeviceGuard guard(device_);
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    TensorView ids = topk_ids, weights = topk_weights;
    if (Status prep = prepare_routing(&ids, &weights, stream); !prep.is_ok()) {  // before dispatch: not latched
      scratch_->host_forwards.fetch_sub(1);
      return prep;
    }
    // invariant: once dispatch is launched every later stage must launch too, or this rank falls an
    // epoch behind its peers; a failure from here on latches the layer as broken.
    const Status st = run_stages(x, x_scale, ids, weights, y, stream);
    scratch_->host_forwards.fetch_sub(1);
    if (!st.is_ok()) latch_broken(st);
    return st;
  }

  Status set_expert_counts(const TensorView& counts) override {
    if (counts.present()) MEGAMOE_RETURN_IF_ERROR(validate_expert_counts(geometry_, device(), counts));
    expert_counts_ = counts;
    return Status::ok();
  }

  Status check_error(void* stream) override {
    if (!warmed_up_) return Status::ok();
    CudaDeviceGuard guard(device_);
    const Status st = transport_->check_error(static_cast<cudaStream_t>(stream));
    if (st.code() == StatusCode::kTimeout) latch_broken(st);  // the group is aborted for good
    return st;
  }

  Status error_pending(bool* pending) override {
    *pending = false;
    if (released_)
      return Status(StatusCode::kFailedPrecondition, "error_pending() after release(): build a new layer");
    if (!warmed_up_) return Status::ok();
    CudaDeviceGuard guard(device_);
    return transport_->error_pending(pending);
  }

  // Collective, bounded: the transport's release (barrier, then the workspace reference: the last one
  // deregisters collectively), then this layer's device memory. Afterwards forward() is refused.
  Status release() override {
    if (released_) return Status::ok();
    released_ = true;
    warmed_up_ = false;
    CudaDeviceGuard guard(device_);
    const Status st = transport_->release(0);
    if (!st.is_ok()) latch_broken(st);
    scratch_.reset();
    fp4_expanded_.reset();
    w13_.reset();
    w13_scales_.reset();
    w2_.reset();
    w2_scales_.reset();
    w13_expert_scale_.reset();
    w2_expert_scale_.reset();
    return st;
  }

  // The knobs the routed layer reads: the GEMMs' tiles, cluster, tile order and SMs (their arguments
  // are built again), the transport's SMs and combine groups.
  Status set_knobs(const Knobs& knobs) override {
    MEGAMOE_RETURN_IF_ERROR(knobs.validate());
    const Knobs before = config_.knobs;
    config_.knobs = knobs;
    Status st = transport_->set_launch_options(knobs.num_sms, knobs.combine_groups);
    if (st && warmed_up_) st = build_gemm_args(*scratch_);
    if (!st) {  // the old knobs passed these checks once
      config_.knobs = before;
      (void)transport_->set_launch_options(before.num_sms, before.combine_groups);
      if (warmed_up_) (void)build_gemm_args(*scratch_);
    }
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

  // Never waits for a peer (the transport's destructor does no collective step).
  ~RoutedMoeLayer() override {
    if (stage_events_[0]) {
      CudaDeviceGuard guard(device_);
      for (cudaEvent_t e : stage_events_) cudaEventDestroy(e);
    }
  }

  Backend backend() const override { return Backend::kRouted; }
  Device device() const override { return Device::cuda(device_); }

 private:
  // e4m3 activations with 1x128 scales (fp8-block and mxfp4 weights): the pool's scales transposed for FC1.
  bool fp8() const {
    return config_.weight_format == WeightFormat::kFp8Block || config_.weight_format == WeightFormat::kMxfp4;
  }
  bool nvfp4() const { return config_.weight_format == WeightFormat::kNvfp4; }

  // Both GEMMs' arguments (make_routed_gemm_args) for the current config and the plans made from
  // them: built at warmup and again when set_knobs changes the knobs. Keeps the old ones on failure.
  Status build_gemm_args(const KeyScratch& scratch) {
    RoutedGemmBuffers b;
    b.workspace = static_cast<char*>(transport_->base());
    b.w13 = w13_->ptr;
    b.w13_scales = w13_scales_ ? static_cast<const float*>(w13_scales_->ptr) : nullptr;
    b.w2 = w2_->ptr;
    b.w2_scales = w2_scales_ ? static_cast<const float*>(w2_scales_->ptr) : nullptr;
    b.w13_expert_scale = w13_expert_scale_ ? static_cast<const float*>(w13_expert_scale_->ptr) : nullptr;
    b.a_scales = scratch.a_scales ? static_cast<float*>(scratch.a_scales->ptr) : nullptr;
    b.expert_out = scratch.expert_out ? scratch.expert_out->ptr : nullptr;
    b.tile_counters = transport_->backend_counters();
    const EpTransport::CombineTargets& targets = transport_->combine_targets();
    b.pool_dst = targets.pool_dst;
    b.pool_weight = targets.pool_weight;
    b.num_ranks = targets.num_ranks;
    b.rows_per_rank = targets.rows_per_rank;
    for (int r = 0; r < targets.num_ranks; ++r) b.peer_combine[r] = targets.peer_combine[r];
    // mxfp4 weights only: the knobs, validated here (warmup) so a bad value fails there
    int32_t fp4_math_wg = 0, fp4_ctas_per_sm = 0;
    if (config_.weight_format == WeightFormat::kMxfp4) {
      MEGAMOE_RETURN_IF_ERROR(routed_fp4_math_wg(env_knobs().gemm_fp4_math_wg, &fp4_math_wg));
      MEGAMOE_RETURN_IF_ERROR(routed_fp4_ctas_per_sm(env_knobs().gemm_fp4_ctas_per_sm, &fp4_ctas_per_sm));
      // A shared device: one CTA per SM, so the GEMMs' grids stay within sm_budget() CTAs (the
      // invariant above) rather than half-filling twice as many SMs.
      if (gemm_sms_ > 0) fp4_ctas_per_sm = 1;
    }
    gemm::GroupedGemmArgs fc1, fc2;
    MEGAMOE_RETURN_IF_ERROR(
        make_routed_gemm_args(geometry_, config_, transport_->layout(), b, gemm_sms_, fp4_math_wg, &fc1, &fc2));
    if (config_.weight_format == WeightFormat::kMxfp4) {
      fc1.tiles.ctas_per_sm = fc2.tiles.ctas_per_sm = fp4_ctas_per_sm;  // the GEMM applies it to 16-row tiles
      fp4_ctas_per_sm_ = fp4_ctas_per_sm;
      int device_sms = 0;
      MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device_));
      gemm_grid_sms_ = gemm_sms_ > 0 ? std::min(gemm_sms_, device_sms) : device_sms;
    }
    gemm::GroupedGemmArgs fc1x, fc2x;
    if (expand_rows_ > 0)
      MEGAMOE_RETURN_IF_ERROR(make_routed_expanded_gemm_args(geometry_, config_, transport_->layout(), b,
                                                             fp4_expanded_->ptr, gemm_sms_, &fc1x, &fc2x));
    fc1_ = fc1;
    fc2_ = fc2;
    fc1x_ = fc1x;
    fc2x_ = fc2x;
    plans_.clear();  // made from fc1_ / fc2_ (fc1x_ / fc2x_)
    return Status::ok();
  }

  void latch_broken(const Status& st) {
    if (broken_.is_ok()) broken_ = st;
    gpu_->mark_broken(st.message());  // teardown skips every collective step from now on
  }

  // The launches of one forward's GEMMs for this rank's T (see the top of this file).
  struct GemmPlan {
    int64_t gate_rows = -1;               // >= 0: the pool build fills the two gated offset copies
    bool expand = false;                  // mxfp4: the weights expanded before each GEMM (fc1x_ / fc2x_)
    std::vector<gemm::GroupedGemmArgs> fc1, fc2;  // one launch each, or one per gated copy
    // expand: per chunk of experts (routed_mxfp4_expand_chunk), each GEMM's launches on experts
    // [first, first + count), the expansion's scratch holding that chunk's weights
    struct Chunk {
      int32_t first = 0, count = 0;
      std::vector<gemm::GroupedGemmArgs> fc1, fc2;
    };
    std::vector<Chunk> chunks;
  };

  // The plan for T tokens on this rank, made once per distinct T (host only).
  Status plan_for(int64_t T, const GemmPlan** out) {
    auto it = plans_.find(T);
    if (it != plans_.end()) {
      *out = &it->second;
      return Status::ok();
    }
    GemmPlan plan;
    MEGAMOE_RETURN_IF_ERROR(make_plan(T, &plan));
    if (plan.expand) MEGAMOE_RETURN_IF_ERROR(split_into_chunks(&plan));
    *out = &plans_.emplace(T, std::move(plan)).first->second;
    return Status::ok();
  }

  // The expanded plan's launches per chunk of experts: each GEMM argument on experts [e0, e0 + n)
  // (their offsets, their block scales in the image; b is the scratch, which holds exactly them).
  Status split_into_chunks(GemmPlan* plan) const {
    const int32_t El = static_cast<int32_t>(geometry_.experts_per_rank());
    const int32_t chunk = expand_chunk_;
    for (int32_t e0 = 0; e0 < El; e0 += chunk) {
      GemmPlan::Chunk c;
      c.first = e0;
      c.count = std::min(chunk, El - e0);
      for (int f = 0; f < 2; ++f) {
        for (gemm::GroupedGemmArgs a : f == 0 ? plan->fc1 : plan->fc2) {
          a.num_experts = c.count;
          a.expert_offsets += e0;
          if (a.b_scales != nullptr) a.b_scales += static_cast<int64_t>(e0) * (a.n / 128) * (a.k / 128);
          if (a.b_expert_scale != nullptr) a.b_expert_scale += e0;  // nvfp4's bf16 expansion
          MEGAMOE_RETURN_IF_ERROR(gemm::validate_grouped_gemm(a));
          (f == 0 ? c.fc1 : c.fc2).push_back(a);
        }
      }
      plan->chunks.push_back(std::move(c));
    }
    return Status::ok();
  }

  // plan_for's launches (before any split into chunks).
  Status make_plan(int64_t T, GemmPlan* out) {
    const int64_t k = geometry_.top_k, P = transport_->layout().pool_rows;
    GemmPlan& plan = *out;
    // mxfp4 at prefill: fp8-block GEMMs on the expanded weights, by this rank's T.
    plan.expand = expand_rows_ > 0 && routed_rows_per_expert(geometry_, T * k) >= expand_rows_;
    const gemm::GroupedGemmArgs& fc1_base = plan.expand ? fc1x_ : fc1_;
    const gemm::GroupedGemmArgs& fc2_base = plan.expand ? fc2x_ : fc2_;
    // Bucket A: this rank's tokens as the row estimate (decode runs decode tiles); bucket B: the
    // pool's bound (every rank at max_tokens_per_rank).
    gemm::GroupedGemmArgs fc1a = fc1_base, fc2a = fc2_base, fc1b = fc1_base, fc2b = fc2_base;
    fc1a.expected_m_per_expert = fc2a.expected_m_per_expert = routed_rows_per_expert(geometry_, T * k);
    fc1b.expected_m_per_expert = fc2b.expected_m_per_expert =
        routed_rows_per_expert(geometry_, geometry_.max_tokens_per_rank * k);
    if (config_.weight_format == WeightFormat::kMxfp4 && !plan.expand && fp4_ctas_per_sm_ == 0) {
      // mxfp4 decode tiles: two CTAs per SM where the rows make enough tiles (per bucket)
      const int64_t rows_a = T * k, rows_b = geometry_.max_tokens_per_rank * k;
      const int64_t n1 = 2 * geometry_.intermediate, n2 = geometry_.hidden;
      fc1a.tiles.ctas_per_sm = routed_fp4_auto_ctas_per_sm(geometry_, rows_a, n1, gemm_grid_sms_);
      fc2a.tiles.ctas_per_sm = routed_fp4_auto_ctas_per_sm(geometry_, rows_a, n2, gemm_grid_sms_);
      fc1b.tiles.ctas_per_sm = routed_fp4_auto_ctas_per_sm(geometry_, rows_b, n1, gemm_grid_sms_);
      fc2b.tiles.ctas_per_sm = routed_fp4_auto_ctas_per_sm(geometry_, rows_b, n2, gemm_grid_sms_);
    }
    int32_t* counters = transport_->backend_counters();  // [8]: two words per launch
    if (!env_knobs().tile_bucket_received) {  // the bucket from this rank's T: one launch per GEMM
      fc1a.tile_counter = counters;
      fc2a.tile_counter = counters + 2;
      plan.fc1 = {fc1a};
      plan.fc2 = {fc2a};
      return Status::ok();
    }
    gemm::GemmTileConfig t1a, t1b, t2a, t2b;
    MEGAMOE_RETURN_IF_ERROR(gemm::planned_gemm_tiles(fc1a, &t1a));
    MEGAMOE_RETURN_IF_ERROR(gemm::planned_gemm_tiles(fc1b, &t1b));
    MEGAMOE_RETURN_IF_ERROR(gemm::planned_gemm_tiles(fc2a, &t2a));
    MEGAMOE_RETURN_IF_ERROR(gemm::planned_gemm_tiles(fc2b, &t2b));
    const bool fc1_same = same_tiles(t1a, t1b), fc2_same = same_tiles(t2a, t2b);
    if (fc1_same && fc2_same) {
      fc1a.tile_counter = counters;
      fc2a.tile_counter = counters + 2;
      plan.fc1 = {fc1a};
      plan.fc2 = {fc2a};
    } else {
      // The switch point: the fewest received rows at which the GEMM that differs picks bucket B's
      // tiles (the heuristic's tiles grow with the rows).
      const bool by_fc1 = !fc1_same;
      const gemm::GemmTileConfig want = by_fc1 ? t1b : t2b;
      int64_t lo = std::min(T * k, P), hi = P;  // answer in (lo, hi]
      if (lo >= hi) lo = hi - 1;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        gemm::GroupedGemmArgs probe = by_fc1 ? fc1_base : fc2_base;
        probe.expected_m_per_expert = routed_rows_per_expert(geometry_, mid);
        gemm::GemmTileConfig t;
        MEGAMOE_RETURN_IF_ERROR(gemm::planned_gemm_tiles(probe, &t));
        (same_tiles(t, want) ? hi : lo) = mid;
      }
      plan.gate_rows = hi;
      for (int i = 0; i < 2; ++i) {
        gemm::GroupedGemmArgs a1 = i == 0 ? fc1a : fc1b, a2 = i == 0 ? fc2a : fc2b;
        a1.expert_offsets = a2.expert_offsets = transport_->gated_offsets(i);
        a1.tile_counter = counters + 4 * i;
        a2.tile_counter = counters + 4 * i + 2;
        if (!fc1_same || i == 0) plan.fc1.push_back(a1);
        if (!fc2_same || i == 0) plan.fc2.push_back(a2);
      }
      // A GEMM whose tiles agree runs once, on the real offsets.
      if (fc1_same) plan.fc1[0].expert_offsets = fc1_base.expert_offsets;
      if (fc2_same) plan.fc2[0].expert_offsets = fc2_base.expert_offsets;
    }
    return Status::ok();
  }

  // The transport reads int32 ids and fp32 weights: int64 ids, bf16 weights or an output scale go
  // through one conversion kernel into the routing scratch first (int32 / fp32 with scale 1 launch
  // nothing). Before dispatch: a failure here leaves the group in step.
  Status prepare_routing(TensorView* ids, TensorView* weights, cudaStream_t stream) {
    const bool ids64 = ids->dtype == DType::kInt64, weights_bf16 = weights->dtype == DType::kBFloat16;
    if (!ids64 && !weights_bf16 && config_.output_scale == 1.0f) return Status::ok();
    const int64_t T = ids->shape[0], k = geometry_.top_k;
    int32_t* ids32 = static_cast<int32_t*>(scratch_->routing->ptr);
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
    const int64_t T = x.ndim == 2 ? x.shape[0] : 0;
    const GemmPlan* plan = nullptr;
    if (P > 0) MEGAMOE_RETURN_IF_ERROR(plan_for(T, &plan));  // before the dispatch: nothing launched yet
    MEGAMOE_RETURN_IF_ERROR(mark(0, stream));
    MEGAMOE_RETURN_IF_ERROR(transport_->dispatch(x, x_scale, topk_ids, topk_weights, stream));
    MEGAMOE_RETURN_IF_ERROR(mark(1, stream));
    MEGAMOE_RETURN_IF_ERROR(transport_->build_expert_pool(
        stream, plan ? plan->gate_rows : -1,
        w2_expert_scale_ ? static_cast<const float*>(w2_expert_scale_->ptr) : nullptr));
    if (expert_counts_.present()) {
      static_assert(kPoolSegmentAlign == 1, "segment sizes are the received rows only without padding");
      MEGAMOE_CUDA_CHECK(kernels::launch_accumulate_expert_counts(
          reinterpret_cast<const int32_t*>(static_cast<const char*>(transport_->base()) + l.expert_offsets.offset),
          geometry_.experts_per_rank(), expert_counts_.data, expert_counts_.dtype == DType::kInt64, gemm_sms_,
          stream));
    }
    MEGAMOE_RETURN_IF_ERROR(mark(2, stream));
    if (P > 0) {
      if (fp8()) {
        const char* base = static_cast<const char*>(transport_->base());
        MEGAMOE_CUDA_CHECK(kernels::launch_scale_transpose(
            reinterpret_cast<const float*>(base + l.pool_x_scales.offset),
            reinterpret_cast<const int32_t*>(base + l.expert_offsets.offset) + geometry_.experts_per_rank(), P, H / 128,
            static_cast<float*>(scratch_->a_scales->ptr), P, stream));
      }
      if (!plan->expand) {
        for (const gemm::GroupedGemmArgs& a : plan->fc1) MEGAMOE_RETURN_IF_ERROR(gemm::launch_grouped_gemm(a, stream));
        MEGAMOE_RETURN_IF_ERROR(mark(3, stream));
        for (const gemm::GroupedGemmArgs& a : plan->fc2) MEGAMOE_RETURN_IF_ERROR(gemm::launch_grouped_gemm(a, stream));
      } else {
        // mxfp4 prefill: per chunk of experts, its weights expanded into the key's scratch, then the
        // GEMM on them; FC1's chunks, then FC2's (each expansion overwrites what the GEMM before it
        // read: the same stream orders them). Only the experts with rows are expanded.
        const int32_t El = static_cast<int32_t>(geometry_.experts_per_rank());
        const int32_t I = static_cast<int32_t>(geometry_.intermediate);
        const int32_t* offsets = fc1_.expert_offsets;
        void* expanded = fp4_expanded_->ptr;
        for (int f = 0; f < 2; ++f) {
          if (f == 1) MEGAMOE_RETURN_IF_ERROR(mark(3, stream));
          for (const GemmPlan::Chunk& c : plan->chunks) {
            const auto expand = nvfp4() ? gemm::launch_expand_nvfp4 : gemm::launch_expand_mxfp4;
            MEGAMOE_CUDA_CHECK(f == 0 ? expand(w13_->ptr, El, 2 * I, static_cast<int32_t>(H), c.first, c.count,
                                               offsets, expanded, gemm_sms_, stream)
                                      : expand(w2_->ptr, El, static_cast<int32_t>(H), I, c.first, c.count, offsets,
                                               expanded, gemm_sms_, stream));
            for (const gemm::GroupedGemmArgs& a : f == 0 ? c.fc1 : c.fc2)
              MEGAMOE_RETURN_IF_ERROR(gemm::launch_grouped_gemm(a, stream));
          }
        }
      }
    } else {
      MEGAMOE_RETURN_IF_ERROR(mark(3, stream));
    }
    MEGAMOE_RETURN_IF_ERROR(mark(4, stream));
    MEGAMOE_RETURN_IF_ERROR(mark(5, stream));
    if (routed_fc2_writes_combine(config_)) {
      MEGAMOE_RETURN_IF_ERROR(transport_->combine(topk_ids, y, stream));
    } else {  // (owner sums +) encode + send + reduce in one kernel (the combine_send stage reads 0)
      TensorView out(scratch_->expert_out->ptr, DType::kBFloat16, {P, H}, device());
      MEGAMOE_RETURN_IF_ERROR(transport_->send_and_combine(out, topk_ids, y, stream));
    }
    return mark(6, stream);
  }

  // Records stage boundary `i` (0 = start) when stage timing is on.
  Status mark(int i, cudaStream_t stream) {
    if (!stage_timing_) return Status::ok();
    if (i == 0) stage_recorded_ = false;  // until this forward's last mark
    MEGAMOE_CUDA_CHECK(cudaEventRecord(stage_events_[i], stream));
    if (i == kNumStages) stage_recorded_ = true;
    return Status::ok();
  }

  Status expert_weight_views(std::vector<ExpertWeightView>* out) override {
    if (released_) return Status(StatusCode::kFailedPrecondition, "expert_weight_views() after release()");
    ExpertWeightBuffers w{w13_, w13_scales_, w2_, w2_scales_, w13_expert_scale_, w2_expert_scale_};
    return expert_weight_views_of(geometry_, config_.weight_format, w, out);
  }

  // w13 reordered for the SwiGLU epilogue (gemm_weights.h), w2 as prepared; fp32 block scales
  // (mxfp4: the GEMM's device images, block scales inside; nvfp4: bf16 and the global scales). From
  // the host's prepared weights, or prepared on the device from device-resident views (bit for bit
  // the same).
  Status upload_weights(const MoeWeights* device_weights) {
    ExpertWeightBuffers w;
    if (device_weights)
      MEGAMOE_RETURN_IF_ERROR(prepare_device_expert_weights(device_, geometry_, config_, *device_weights, &w));
    else
      MEGAMOE_RETURN_IF_ERROR(upload_expert_weights(device_, geometry_, weights_, &w, Nvfp4Upload::kGemmImages));
    w13_ = std::move(w.w13);
    w13_scales_ = std::move(w.w13_scales);
    w2_ = std::move(w.w2);
    w2_scales_ = std::move(w.w2_scales);
    w13_expert_scale_ = std::move(w.w13_expert_scale);
    w2_expert_scale_ = std::move(w.w2_expert_scale);
    return Status::ok();
  }

  static constexpr int kNumStages = 6;
  static constexpr const char* kStageNames[kNumStages] = {"dispatch", "expert_pool", "fc1_swiglu",
                                                          "fc2",      "combine_send", "combine"};
  GpuRankComm* gpu_ = nullptr;  // the transport's communicator
  int device_ = 0;
  int gemm_sms_ = 0;  // > 0 on a shared device: the GEMMs' grid bound (the rank's SM budget)
  WorkspaceKey key_;
  Status broken_;  // the first failure that left this rank out of step with its group
  gemm::GroupedGemmArgs fc1_, fc2_;  // as build_gemm_args made them (bucket from max_tokens_per_rank)
  // mxfp4: the rows per expert from which a forward expands (0: never; routed_mxfp4_expand_rows at
  // warmup) and the GEMMs on the expansion (make_routed_expanded_gemm_args)
  int64_t expand_rows_ = 0;
  int32_t expand_chunk_ = 1;  // experts per expansion (routed_mxfp4_expand_chunk)
  // mxfp4: MEGAMOE_GEMM_FP4_CTAS_PER_SM (1 or 2), 0 = chosen per forward (routed_fp4_auto_ctas_per_sm)
  // on the SMs the GEMMs' grids span (gemm_grid_sms_).
  int32_t fp4_ctas_per_sm_ = 0;
  int gemm_grid_sms_ = 132;
  std::shared_ptr<DeviceBuffer> fp4_expanded_;  // the key's scratch as this layer's plans use it
  gemm::GroupedGemmArgs fc1x_, fc2x_;
  std::map<int64_t, GemmPlan> plans_;
  bool warmed_up_ = false;  // warmup() completed: workspace, scratch, GEMM arguments
  bool released_ = false;
  bool stage_timing_ = false, stage_recorded_ = false;
  cudaEvent_t stage_events_[kNumStages + 1] = {};
  std::unique_ptr<EpTransport> transport_;
  std::shared_ptr<DeviceBuffer> w13_, w13_scales_, w2_, w2_scales_;
  std::shared_ptr<DeviceBuffer> w13_expert_scale_, w2_expert_scale_;  // nvfp4: the global scales [E_local]
  std::shared_ptr<KeyScratch> scratch_;
  TensorView expert_counts_;  // absent: not counting
};

// Knobs as GEMM tiles; 0 leaves the field to the GEMM's heuristic for the forward's bucket. A
// BLOCK_N the GEMM cannot run for this N (not 128/256, not dividing N, or not 256 for SwiGLU) is left
// to the heuristic too, and so are mxfp4 tiles the GEMM has no configuration for (BLOCK_M other than
// 16, 32 or 64 — 64 with two math warpgroups only, make_routed_gemm_args —, BLOCK_N other than 256),
// nvfp4 GEMM tiles other than 16 or 32 rows and 256 wide, and bf16 tiles of 16 or 32 rows.
// (The pool is not padded, so any BLOCK_M runs any segment.)
gemm::GemmTileConfig tiles_for(const MoeConfig& c, int32_t n, bool swiglu, int gemm_sms, bool nvfp4_gemm) {
  const bool fp8 = c.weight_format == WeightFormat::kFp8Block;
  const bool mxfp4 = c.weight_format == WeightFormat::kMxfp4;
  gemm::GemmTileConfig t;
  t.block_m = c.knobs.block_m;
  if (mxfp4 && t.block_m != 16 && t.block_m != 32 && t.block_m != 64) t.block_m = 0;
  if (nvfp4_gemm && t.block_m != 16 && t.block_m != 32) t.block_m = 0;
  const bool bf16_gemm = !fp8 && !mxfp4 && !nvfp4_gemm;  // bf16 weights or nvfp4's bf16 expansion: 64 and 128 rows
  if (bf16_gemm && (t.block_m == 16 || t.block_m == 32)) t.block_m = 0;
  const int32_t bn = c.knobs.block_n;
  const bool bn_ok = swiglu || mxfp4 || nvfp4_gemm ? bn == 256 : ((bn == 128 || bn == 256) && n % bn == 0);
  t.block_n = bn_ok ? bn : 0;
  t.num_sms = c.knobs.num_sms;
  if (gemm_sms > 0) t.num_sms = t.num_sms > 0 ? std::min(t.num_sms, gemm_sms) : gemm_sms;
  // clusters of 2 exist for fp8 128 x 256 tiles; a knob that asks for them elsewhere is left to the
  // heuristic (which then runs none)
  const bool cluster_ok = fp8 && (t.block_m == 0 || t.block_m == 128) && (t.block_n == 0 || t.block_n == 256);
  t.cluster = c.knobs.gemm_cluster == 2 && !cluster_ok ? 0 : c.knobs.gemm_cluster;
  return t;
}

}  // namespace

bool routed_fc2_writes_combine(const MoeConfig& c) {
  return c.combine_dtype == CombineDtype::kBf16 && !c.uses_owner_reduce();
}

// deepseek-v3 EP2 at 1024 tokens: mean 64 rows, 64-row tiles run FC1 in 1297 us, 128-row tiles in 1160.
int64_t routed_rows_per_expert(const MoeGeometry& g, int64_t rows) {
  const double mean = static_cast<double>(std::max<int64_t>(rows, 0)) / std::max<int64_t>(g.experts_per_rank(), 1);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(mean + 2.0 * std::sqrt(mean))));
}

namespace {

// An environment knob of "1" or "2" (EnvKnobs keeps it as given): *out = 1 or 2, `unset` when empty;
// anything else is kInvalidArgument naming the variable, the value and "must be 1 or 2 (`what`)".
Status one_or_two_knob(const char* name, const std::string& knob, int32_t unset, const std::string& what,
                       int32_t* out) {
  if (knob.empty() || knob == "1" || knob == "2") {
    *out = knob.empty() ? unset : knob == "1" ? 1 : 2;
    return Status::ok();
  }
  return invalid_argument("environment knob", name, "'" + knob + "'", "must be 1 or 2 (" + what + ")");
}

}  // namespace

Status routed_fp4_ctas_per_sm(const std::string& knob, int32_t* out) {
  return one_or_two_knob("MEGAMOE_GEMM_FP4_CTAS_PER_SM", knob, 0,
                         "CTAs per SM of the routed mxfp4 GEMMs' 16-row tiles; unset: chosen per forward, 2 from " +
                             str(kFp4TwoCtasMinTilesPerSm) + " expected tiles per SM",
                         out);
}

double routed_fp4_expected_tiles(const MoeGeometry& g, int64_t rows, int64_t n) {
  const double E = static_cast<double>(std::max<int64_t>(g.experts_per_rank(), 1));
  const double r = static_cast<double>(std::max<int64_t>(rows, 0));
  const double hit = E * (1.0 - std::pow(1.0 - 1.0 / E, r));
  if (hit <= 0.0) return 0.0;
  return hit * std::ceil(r / hit / 16.0) * static_cast<double>(n / 256);
}

int32_t routed_fp4_auto_ctas_per_sm(const MoeGeometry& g, int64_t rows, int64_t n, int sms) {
  return routed_fp4_expected_tiles(g, rows, n) >= double(kFp4TwoCtasMinTilesPerSm * std::max(sms, 1)) ? 2 : 1;
}

Status routed_fp4_math_wg(const std::string& knob, int32_t* out) {
  return one_or_two_knob("MEGAMOE_GEMM_FP4_MATH_WG", knob, gemm::kDefaultFp4MathWG,
                         "math warpgroups per tile of the routed mxfp4 GEMMs; unset: " + str(gemm::kDefaultFp4MathWG),
                         out);
}

// A positive decimal integer, digits only, within int64 (the knobs below).
bool parse_positive(const std::string& text, int64_t* out) {
  if (text.empty() || text[0] < '0' || text[0] > '9') return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v <= 0) return false;
  *out = v;
  return true;
}

Status routed_mxfp4_expand_rows(const std::string& knob, int64_t* out) {
  if (knob.empty()) {
    *out = kDefaultMxfp4ExpandRows;
    return Status::ok();
  }
  if (knob == "off") {
    *out = 0;
    return Status::ok();
  }
  if (int64_t v = 0; parse_positive(knob, &v)) {
    *out = v;
    return Status::ok();
  }
  return invalid_argument("environment knob", "MEGAMOE_MXFP4_EXPAND_ROWS", "'" + knob + "'",
                          "must be 'off' or a positive integer (rows per expert from which routed mxfp4 layers "
                          "expand their weights to fp8-block for the GEMMs; unset: " +
                              str(kDefaultMxfp4ExpandRows) + ")");
}

Status routed_mxfp4_expand_bytes(const std::string& knob, int64_t* out) {
  if (knob.empty()) {
    *out = kDefaultMxfp4ExpandBytes;
    return Status::ok();
  }
  int64_t mib = 0;
  if (parse_positive(knob, &mib) && mib <= (int64_t(1) << 40)) {
    *out = mib << 20;
    return Status::ok();
  }
  return invalid_argument("environment knob", "MEGAMOE_MXFP4_EXPAND_MIB", "'" + knob + "'",
                          "must be a positive integer of MiB, at most 2^40 (the bound of the routed mxfp4 prefill "
                          "expansion's scratch; unset: " +
                              str(kDefaultMxfp4ExpandBytes >> 20) + ")");
}

int64_t routed_mxfp4_expand_chunk(const MoeGeometry& g, int64_t max_bytes) {
  const int64_t per_expert = std::max<int64_t>(1, 2 * g.intermediate * g.hidden);
  return std::max<int64_t>(1, std::min<int64_t>(g.experts_per_rank(), max_bytes / per_expert));
}

Status routed_mxfp4_expansion(const MoeGeometry& g, const std::string& rows_knob, const std::string& mib_knob,
                              RoutedMxfp4Expansion* out) {
  RoutedMxfp4Expansion x;
  int64_t max_bytes = 0;
  MEGAMOE_RETURN_IF_ERROR(routed_mxfp4_expand_rows(rows_knob, &x.threshold_rows));
  MEGAMOE_RETURN_IF_ERROR(routed_mxfp4_expand_bytes(mib_knob, &max_bytes));
  x.t_max_rows = routed_rows_per_expert(g, g.max_tokens_per_rank * g.top_k);
  x.chunk_experts = routed_mxfp4_expand_chunk(g, max_bytes);
  if (x.threshold_rows > 0 && g.max_tokens_per_rank > 0 && x.t_max_rows >= x.threshold_rows)
    x.scratch_bytes = gemm::mxfp4_expanded_bytes(x.chunk_experts, 2 * g.intermediate, g.hidden);
  *out = x;
  return Status::ok();
}

Status routed_nvfp4_expand_rows(const std::string& knob, int64_t* out) {
  if (knob.empty()) {
    *out = kDefaultNvfp4ExpandRows;
    return Status::ok();
  }
  if (knob == "off") {
    *out = 0;
    return Status::ok();
  }
  if (int64_t v = 0; parse_positive(knob, &v)) {
    *out = v;
    return Status::ok();
  }
  return invalid_argument("environment knob", "MEGAMOE_NVFP4_EXPAND_ROWS", "'" + knob + "'",
                          "must be 'off' or a positive integer (rows per expert from which routed nvfp4 layers "
                          "expand their weights to bf16 for the GEMMs; unset: " +
                              str(kDefaultNvfp4ExpandRows) + ")");
}

Status routed_nvfp4_expansion(const MoeGeometry& g, const std::string& rows_knob, const std::string& mib_knob,
                              RoutedMxfp4Expansion* out) {
  RoutedMxfp4Expansion x;
  int64_t max_bytes = 0;
  MEGAMOE_RETURN_IF_ERROR(routed_nvfp4_expand_rows(rows_knob, &x.threshold_rows));
  MEGAMOE_RETURN_IF_ERROR(routed_mxfp4_expand_bytes(mib_knob, &max_bytes));
  x.t_max_rows = routed_rows_per_expert(g, g.max_tokens_per_rank * g.top_k);
  x.chunk_experts = routed_mxfp4_expand_chunk(g, max_bytes / 2);  // bf16: two bytes per weight
  if (x.threshold_rows > 0 && g.max_tokens_per_rank > 0 && x.t_max_rows >= x.threshold_rows)
    x.scratch_bytes = gemm::nvfp4_expanded_bytes(x.chunk_experts, 2 * g.intermediate, g.hidden);
  *out = x;
  return Status::ok();
}

Status make_routed_expanded_gemm_args(const MoeGeometry& g, const MoeConfig& c, const WorkspaceLayout& l,
                                      const RoutedGemmBuffers& b, const void* expanded, int gemm_sms,
                                      gemm::GroupedGemmArgs* fc1, gemm::GroupedGemmArgs* fc2) {
  if (c.weight_format == WeightFormat::kNvfp4) {
    RoutedGemmBuffers bx = b;
    bx.w13 = bx.w2 = expanded;
    bx.nvfp4_bf16 = true;
    return make_routed_gemm_args(g, c, l, bx, gemm_sms, 0, fc1, fc2);
  }
  if (c.weight_format != WeightFormat::kMxfp4)
    return Status(StatusCode::kInternal, std::string("expanded GEMM arguments for weight_format=") +
                                             to_string(c.weight_format) + " (mxfp4 or nvfp4 only)");
  MoeConfig fp8 = c;
  fp8.weight_format = WeightFormat::kFp8Block;
  RoutedGemmBuffers bx = b;
  bx.w13 = bx.w2 = expanded;
  bx.w13_scales = gemm::mxfp4_image_block_scales(b.w13);
  bx.w2_scales = gemm::mxfp4_image_block_scales(b.w2);
  return make_routed_gemm_args(g, fp8, l, bx, gemm_sms, 0, fc1, fc2);
}

Status make_routed_gemm_args(const MoeGeometry& g, const MoeConfig& c, const WorkspaceLayout& l,
                             const RoutedGemmBuffers& b, int gemm_sms, int32_t fp4_math_wg,
                             gemm::GroupedGemmArgs* fc1_out, gemm::GroupedGemmArgs* fc2_out) {
  const bool mxfp4 = c.weight_format == WeightFormat::kMxfp4;
  const bool fp8 = c.weight_format == WeightFormat::kFp8Block || mxfp4;  // e4m3 activations, 1x128 scales
  const bool nvfp4 = c.weight_format == WeightFormat::kNvfp4;
  const bool nvfp4_gemm = nvfp4 && !b.nvfp4_bf16;  // the nvfp4 GEMM on the images (else bf16 on the expansion)
  const int64_t P = l.pool_rows, H = g.hidden, I = g.intermediate;
  const int32_t El = static_cast<int32_t>(g.experts_per_rank());
  // invariant: P is a multiple of 4, the leading dimension of the M-major scale arrays below.
  if (P % 4 != 0)
    return Status(StatusCode::kInternal, "routed GEMMs: pool_rows=" + str(P) + " is not a multiple of 4 (WorkspaceLayout)");
  char* base = b.workspace;
  gemm::GroupedGemmArgs fc1;  // FC1 + SwiGLU (+ fp8 requant): pool_x -> intermediate
  fc1.dtype = mxfp4        ? gemm::GemmDtype::kMxfp4
              : fp8        ? gemm::GemmDtype::kFp8Block
              : nvfp4_gemm ? gemm::GemmDtype::kNvfp4
                           : gemm::GemmDtype::kBf16;
  fc1.layout = gemm::GroupedLayout::kContiguous;
  fc1.epilogue = fp8     ? gemm::GemmEpilogue::kSwigluFp8
                 : nvfp4 ? gemm::GemmEpilogue::kSwigluBf16Scaled
                         : gemm::GemmEpilogue::kSwigluBf16;
  // FC2's global scale: in the pool build's row weights; FC1's: the image's (nvfp4 GEMM) or apart
  if (nvfp4 && !nvfp4_gemm) fc1.b_expert_scale = b.w13_expert_scale;
  fc1.num_experts = El;
  fc1.n = static_cast<int32_t>(2 * I);
  fc1.k = static_cast<int32_t>(H);
  fc1.a = base + l.pool_x.offset;
  fc1.m_rows = P;
  fc1.expert_offsets = reinterpret_cast<const int32_t*>(base + l.expert_offsets.offset);
  fc1.b = b.w13;
  fc1.d = base + l.intermediate.offset;
  fc1.ldd = I;
  fc1.pow2_scales = c.pow2_scales;
  fc1.tiles = tiles_for(c, fc1.n, /*swiglu=*/true, gemm_sms, nvfp4_gemm);
  fc1.expected_m_per_expert = routed_rows_per_expert(g, g.max_tokens_per_rank * g.top_k);
  if (fp8) {
    fc1.a_scales = b.a_scales;
    fc1.ld_a_scales = P;
    fc1.b_scales = mxfp4 ? nullptr : b.w13_scales;  // mxfp4: inside the image
    // invariant: the intermediate_scales region holds P * I/128 fp32, here M-major [I/128][P].
    fc1.d_scales = reinterpret_cast<float*>(base + l.intermediate_scales.offset);
    fc1.ld_d_scales = P;
  }
  // FC2: intermediate -> the source ranks' combine rows (bf16 wire, one row per slot: weighted in
  // fp32, one rounding, written through the peer pointers), else -> expert_out (bf16, unweighted)
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
  fc2.b = b.w2;
  fc2.ldd = H;
  if (!routed_fc2_writes_combine(c)) {
    fc2.d = b.expert_out;
  } else {
    fc2.row_map = b.pool_dst;
    fc2.row_weight = b.pool_weight;
    fc2.num_peer_d = b.num_ranks;
    fc2.peer_d_rows = static_cast<int32_t>(b.rows_per_rank);
    for (int r = 0; r < b.num_ranks; ++r) fc2.peer_d[r] = b.peer_combine[r];
  }
  fc2.tiles = tiles_for(c, fc2.n, /*swiglu=*/false, gemm_sms, nvfp4_gemm);
  if (mxfp4) {
    fc1.tiles.fp4_math_wg = fc2.tiles.fp4_math_wg = fp4_math_wg;
    const bool one_wg = fp4_math_wg == 1 || (fp4_math_wg == 0 && gemm::kDefaultFp4MathWG == 1);
    for (gemm::GemmTileConfig* t : {&fc1.tiles, &fc2.tiles})
      if (one_wg && t->block_m == 64) t->block_m = 0;  // 64-row mxfp4 tiles: two math warpgroups
  }
  fc1.tile_counter = b.tile_counters;
  fc1.tile_order = fc2.tile_order = c.knobs.gemm_tile_order == 1   ? gemm::GemmTileOrder::kCounter
                                    : c.knobs.gemm_tile_order == 2 ? gemm::GemmTileOrder::kRoundRobin
                                                                   : gemm::GemmTileOrder::kAuto;
  fc2.tile_counter = b.tile_counters ? b.tile_counters + 2 : nullptr;
  fc2.expected_m_per_expert = fc1.expected_m_per_expert;
  if (fp8) {
    fc2.a_scales = fc1.d_scales;
    fc2.ld_a_scales = P;
    fc2.b_scales = mxfp4 ? nullptr : b.w2_scales;
  }
  if (P > 0) {
    MEGAMOE_RETURN_IF_ERROR(gemm::validate_grouped_gemm(fc1));
    MEGAMOE_RETURN_IF_ERROR(gemm::validate_grouped_gemm(fc2));
  }
  *fc1_out = fc1;
  *fc2_out = fc2;
  return Status::ok();
}

Status routed_format_gate(const MoeGeometry& g, const MoeConfig& c) {
  MEGAMOE_RETURN_IF_ERROR(weight_dispatch_pairing_gate("routed", c));
  if (c.weight_format != WeightFormat::kFp8Block && c.weight_format != WeightFormat::kBf16 &&
      c.weight_format != WeightFormat::kMxfp4 && c.weight_format != WeightFormat::kNvfp4)
    return Status(StatusCode::kUnavailable, std::string("the routed backend has no ") + to_string(c.weight_format) +
                                                " grouped GEMM yet (fp8-block, mxfp4, nvfp4 or bf16 weights)");
  MEGAMOE_RETURN_IF_ERROR(mxfp4_shape_gate("routed", g, c));
  if (c.weight_format == WeightFormat::kNvfp4 && g.hidden % 256 != 0)
    return Status(StatusCode::kUnavailable, "the routed backend: geometry.hidden=" + str(g.hidden) +
                                                " must be a multiple of 256 with weight_format=nvfp4 (FC2's N = "
                                                "hidden runs the nvfp4 GEMM's 256-wide tiles)");
  if (c.weight_format == WeightFormat::kNvfp4 && !routed_fc2_writes_combine(c))
    return Status(StatusCode::kUnavailable,
                  std::string("the routed backend runs weight_format=nvfp4 with combine_dtype=bf16 and no owner "
                              "reduce (got combine_dtype=") +
                      to_string(c.combine_dtype) + ", owner_reduce=" + to_string(c.owner_reduce) +
                      "): w2's per-expert global scale is folded into the row weights FC2's epilogue applies, "
                      "which only the bf16 wire FC2 writes itself uses");
  if (g.experts_per_rank() > 512)
    return Status(StatusCode::kUnavailable, "the routed backend's grouped GEMM takes at most 512 local experts (got " +
                                                std::to_string(g.experts_per_rank()) + " = num_experts / ep_size)");
  if (c.in_kernel_fc2_reduce)
    return Status(StatusCode::kUnavailable,
                  "the routed backend has no in-kernel FC2 reduce yet (its FC2 writes local rows that combine sends)");
  // The EP transport's limits, by its own check (ep_size <= 8, top_k <= 16, T_max <= 65535,
  // E_l * R <= 65535, ...).
  EpTransportOptions transport;
  transport.params = workspace_params(g, c);
  if (Status st = transport.validate(); !st.is_ok())
    return Status(StatusCode::kUnavailable, "the routed backend's EP transport cannot run it: " + st.message());
  // The GEMMs' shape rules, by the GEMM's own check on the arguments warmup() would build (any
  // 16-byte aligned addresses: no device is touched).
  RoutedGemmBuffers fake;
  char* const addr = reinterpret_cast<char*>(uintptr_t(1) << 40);
  fake.workspace = addr;
  fake.w13 = fake.w2 = addr;
  fake.w13_scales = fake.w2_scales = fake.a_scales = reinterpret_cast<float*>(addr);
  fake.w13_expert_scale = reinterpret_cast<float*>(addr);
  fake.expert_out = addr;
  fake.tile_counters = reinterpret_cast<int32_t*>(addr);
  fake.pool_dst = reinterpret_cast<int32_t*>(addr);
  fake.pool_weight = reinterpret_cast<float*>(addr);
  fake.num_ranks = static_cast<int>(g.ep_size);
  fake.rows_per_rank = g.max_tokens_per_rank * g.top_k;
  for (int r = 0; r < fake.num_ranks && r < 8; ++r) fake.peer_combine[r] = addr;
  gemm::GroupedGemmArgs fc1, fc2;
  // fp4_math_wg 0: the GEMM's default (the knob is the layer's warmup's to check: a bad value fails the
  // layer there rather than turning `auto` away from routed).
  if (Status st = make_routed_gemm_args(g, c, WorkspaceLayout::make(transport.params), fake, 0, 0, &fc1, &fc2);
      !st.is_ok())
    return Status(StatusCode::kUnavailable, "the routed backend's grouped GEMM cannot run it: " + st.message());
  if (c.weight_format == WeightFormat::kMxfp4) {  // and the prefill GEMMs on the expansion
    if (Status st = make_routed_expanded_gemm_args(g, c, WorkspaceLayout::make(transport.params), fake, addr, 0,
                                                   &fc1, &fc2);
        !st.is_ok())
      return Status(StatusCode::kUnavailable,
                    "the routed backend's grouped GEMM cannot run the expanded mxfp4 weights: " + st.message());
  }
  return Status::ok();
}

Status create_routed_layer(const MoeGeometry& g, const MoeConfig& c, BackendSelection selection,
                           PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out,
                           const MoeWeights* device_weights) {
  auto layer = std::make_unique<RoutedMoeLayer>(g, c, std::move(selection), std::move(weights));
  MEGAMOE_RETURN_IF_ERROR(layer->init(std::move(comm), device_weights));
  *out = std::move(layer);
  return Status::ok();
}

}  // namespace megamoe
