// megamoe/layer.h — the MoE layer: built once, warmed up once, then forward() per step.
//
// Contract:
// - MoeLayer::create() validates geometry and config, resolves `auto` to one backend (once; never per
//   call), and prepares this rank's expert weights (from host memory, or on the layer's device from
//   device-resident views: megamoe/weights.h). It allocates nothing collective.
// - warmup() does everything collective or blocking (workspace allocation, registration, tuning, host
//   syncs). Call it on every rank of the group, before any CUDA-graph capture. Idempotent.
// - forward(x, topk_ids, topk_weights, y, stream[, x_scale]) computes, for this rank's T tokens,
//     y[t] = sum_j topk_weights[t, j] * FC2_e(silu(FC1g_e(x_t)) * FC1u_e(x_t)),  e = topk_ids[t, j]
//   summed in fp32 in slot order j = 0..k-1 and written as bf16. topk_ids = -1 skips a slot.
//     x            [T, H] bf16, or e4m3 with x_scale [T, H/128] fp32
//     topk_ids     [T, k] int32 or int64, values in [-1, E) (int64: converted on the layer's device;
//                  a value outside int32 saturates and is reported as a bad id)
//     topk_weights [T, k] fp32 or bf16
//     y            [T, H] bf16 (written; never read)
//   With config.output_scale = s != 1 (SGLang's routed_scaling_factor) the layer computes with the
//   weights fp32(s * topk_weights[t, j]): y = s * (the sum above), rounded once, as bf16.
//   The routed and cpu backends take all of these; the mega backend takes int32 ids and fp32 weights
//   only (it applies output_scale in its kernel).
//   T may be 0 (the rank still takes part). T > max_tokens_per_rank, wrong shapes, dtypes or devices,
//   and expert ids outside [-1, E) are refused with a message naming the argument and the rule.
//   Every rank of the group calls forward() the same number of times.
// - Concurrency rules. Layers of one workspace key (equal geometry and options, one rank of one group,
//   one device, one MoeConfig::workspace_lane) share one workspace and its GPU scratch:
//   (1) run their forwards one after another on one stream, as a model's layers run;
//   (2) two of them must not overlap (two streams, two threads); forward() refuses two host threads
//       inside it at once for one key (the overlap that is cheap to see), and overlap on the device
//       cannot be seen and corrupts both;
//   (3) layers that may overlap (micro-batches on two streams, a draft model beside the target) take
//       different workspace_lane values: they then share nothing mutable, nor do layers of different
//       geometry or options;
//   (4) every rank calls the collective calls (warmup, forward, release) of its layers in the same
//       order, the same number of times, each rank from its own thread or process.
//   A forward that fails on a GPU backend after its dispatch started leaves the group out of step:
//   that layer refuses later forwards, the communicator is marked broken (teardown then skips every
//   collective step), and the group (communicator and layers) must be rebuilt.
// - release() is collective and bounded by MEGAMOE_BARRIER_TIMEOUT_MS: it gives back the layer's
//   share of the workspace (the last layer of a workspace deregisters it, collectively) and its device
//   memory. The destructor gives back the same without any collective step and never waits for a
//   peer (a workspace whose deregistration is collective then goes with the communicator). A warmup()
//   that failed keeps nothing half-built and may be called again.
// - Selection rule for `auto` (TensorRT-LLM's MEGAMOE_AUTO semantics): mega if
//   0 < max_tokens_per_rank <= mega_max_tokens_per_rank and mega's capability gate passes; else
//   routed if its gate passes; else cpu. Each fallback is logged (stderr, and selection_log()).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/tensor.h"
#include "megamoe/weights.h"

namespace megamoe {

// Static capability checks (arch, formats, alignment); never touch the network.
Status mega_capability(const MoeGeometry& geometry, const MoeConfig& config);
Status routed_capability(const MoeGeometry& geometry, const MoeConfig& config);
Status cpu_capability(const MoeGeometry& geometry, const MoeConfig& config);

struct BackendSelection {
  Backend backend = Backend::kCpu;
  std::string reason;  // one line per decision, fallbacks with their cause
};

// The pure selection rule, given the gates' answers (tests drive it with made-up gates).
BackendSelection select_backend(const MoeGeometry& geometry, const MoeConfig& config,
                                const Status& mega_gate, const Status& routed_gate);
// The same, evaluating the real gates and the knob cache's measured crossover, if any.
BackendSelection select_backend(const MoeGeometry& geometry, const MoeConfig& config);

// One local expert's prepared weights in the layer's device memory: the bytes the GPU backends'
// grouped GEMMs read for that expert, for expert load balancing (EPLB) to permute in place. Each
// region is contiguous and holds that expert only; its layout is the GEMM's, not the source's:
// - w13: [2I, H] with the rows in the SwiGLU epilogue's order (rows [256 j, 256 j + 128) = gate rows
//   [128 j, 128 j + 128), rows [256 j + 128, 256 j + 256) = up rows [I + 128 j, I + 128 j + 128)),
//   e4m3 (fp8-block) or bf16; w13_scale: fp32 [2I/128, H/128] in the same block-row order (fp8-block).
// - w2: [H, I] as the source, e4m3 or bf16; w2_scale: fp32 [H/128, I/128] (fp8-block).
// - mxfp4: w13 / w2 are the expert's fragment-ordered pieces and w13_scale /
//   w2_scale its fp32 128x128 block scales inside the GEMM's image (kernels/gemm/gemm_weights.h).
// - bf16: the scale pointers are null, their bytes 0.
// The layout is the same for every expert of every layer of equal geometry (hidden, intermediate)
// and weight_format, on every rank: moving an expert is copying its four regions into another
// expert's (of this layer, or of such a layer on another rank). The pointers are fixed from create()
// to release() (a captured CUDA graph reads what they hold at replay). Write them stream-ordered
// between forwards, never while a forward of the layer (or a graph replaying it) is in flight;
// MoeLayer::forward's expert e then computes with whatever expert e's regions hold.
struct ExpertWeightView {
  void* w13 = nullptr;
  int64_t w13_bytes = 0;
  void* w13_scale = nullptr;
  int64_t w13_scale_bytes = 0;
  void* w2 = nullptr;
  int64_t w2_bytes = 0;
  void* w2_scale = nullptr;
  int64_t w2_scale_bytes = 0;
};

class MoeLayer {
 public:
  // `comm` may be null when ep_size == 1. For ep_size > 1 it must be this rank's handle of a group
  // of ep_size ranks with rank() == geometry.ep_rank.
  static Status create(const MoeGeometry& geometry, const MoeConfig& config, const MoeWeights& weights,
                       std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

  virtual ~MoeLayer() = default;

  virtual Status warmup() = 0;
  // Collective, bounded (see above). ok, or kTimeout naming the stage when a peer did not arrive (the
  // group is then broken). Later forward() and warmup() calls are refused. Idempotent.
  virtual Status release() { return Status::ok(); }
  virtual Status forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
                         const TensorView& y, void* stream = nullptr,
                         const TensorView& x_scale = TensorView()) = 0;

  // Synchronises `stream` and reports failures of earlier forwards that a GPU backend can only see
  // on the device (a bounded cross-rank wait that expired, naming stage and peer; expert ids outside
  // [-1, E), naming the first bad token). forward() itself never synchronises. The cpu backend reports
  // everything from forward() directly, so this is ok there.
  virtual Status check_error(void* stream = nullptr) {
    (void)stream;
    return Status::ok();
  }

  // Whether check_error() has a failure to report, without a host synchronisation: for an engine to
  // poll between steps (then check_error() says what, and the group is rebuilt). The GPU backends read
  // a snapshot of the device's error state (the error cell, the peers' abort cells, the bad-id
  // counters) that a private non-blocking stream copies into pinned host memory; each call takes the
  // latest snapshot that has arrived and starts the next, so it never waits for the device (a rank
  // still waiting for a dead peer included), never synchronises nor touches the legacy default
  // stream, and may run while another thread captures a CUDA graph. A failure shows at most one call
  // late (a snapshot takes microseconds); *pending then stays true until check_error() reports.
  // false before warmup(), and always on the cpu backend (forward() reports everything itself).
  // After release(): kFailedPrecondition. Call it from the thread that drives the layer.
  virtual Status error_pending(bool* pending) {
    *pending = false;
    return Status::ok();
  }

  // Per-local-expert receive counts, for expert load balancing (EPLB). While `counts` is set, each
  // later forward adds to counts[e] the rows local expert e (global expert first_local_expert() + e)
  // received from every rank, on the layer's device in stream order: no host sync, capturable. The
  // caller reads and zeroes it when it wants (the layer only adds). counts: [experts_per_rank] int64
  // or int32, contiguous, on device(); an absent view stops counting. Backends without counters
  // answer kUnavailable.
  virtual Status set_expert_counts(const TensorView& counts) {
    (void)counts;
    return Status(StatusCode::kUnavailable, "this backend has no per-expert receive counts");
  }

  // Per-stage timing, a diagnostic of the GPU backends (`megamoe bench` prints it). While enabled,
  // forward() records a CUDA event after each of its stages; last_stage_times() synchronises and
  // returns the last forward's stages in order with their durations in microseconds. Not for use
  // inside CUDA-graph capture. Backends without stages answer kUnavailable.
  struct StageTime {
    std::string stage;
    double us = 0;
  };
  virtual Status set_stage_timing(bool enabled) {
    (void)enabled;
    return Status(StatusCode::kUnavailable, "this backend has no per-stage timing");
  }
  virtual Status last_stage_times(std::vector<StageTime>* out) {
    (void)out;
    return Status(StatusCode::kUnavailable, "this backend has no per-stage timing");
  }

  // Tuning: replaces the knobs of a built layer (config().knobs) without building it again; the next
  // forward runs with them. Call it between forwards (no forward of this layer in flight or being
  // captured), with the same knobs on every rank of the group before any rank's next forward.
  // Returns the Knobs::validate() error for bad knobs (and keeps the old ones). Knobs the backend
  // does not read are kept and ignored (the cpu backend reads none). Knobs that size buffers or
  // change the workspace are not Knobs (owner_reduce is MoeConfig's: a new layer).
  virtual Status set_knobs(const Knobs& knobs) {
    MEGAMOE_RETURN_IF_ERROR(knobs.validate());
    config_.knobs = knobs;
    return Status::ok();
  }

  // The prepared weights of local expert e (global expert ep_rank * experts_per_rank + e) at
  // (*out)[e], experts_per_rank entries, on device() (see ExpertWeightView). The routed and mega
  // backends answer them (kUnavailable for weight_format=nvfp4, whose per-expert global scales are
  // not in the views); the cpu backend answers kUnavailable (its weights are prepared_weights()); a
  // released layer kFailedPrecondition.
  virtual Status expert_weight_views(std::vector<ExpertWeightView>* out) {
    (void)out;
    return Status(StatusCode::kUnavailable, "this backend has no device expert weights (see prepared_weights())");
  }

  virtual Backend backend() const = 0;
  // The device the layer's tensors live on (cpu for the cpu backend).
  virtual Device device() const = 0;
  const MoeGeometry& geometry() const { return geometry_; }
  const MoeConfig& config() const { return config_; }
  const BackendSelection& selection() const { return selection_; }
  // The weights in host memory as prepare_weights() made them. A layer built from device-resident
  // weights (weights.h) has them only on the device: format and shapes here, data and scales empty
  // (expert_weight_views() has them).
  const PreparedWeights& prepared_weights() const { return weights_; }

 protected:
  MoeLayer(const MoeGeometry& g, const MoeConfig& c, BackendSelection s, PreparedWeights w)
      : geometry_(g), config_(c), selection_(std::move(s)), weights_(std::move(w)) {}

  MoeGeometry geometry_;
  MoeConfig config_;
  BackendSelection selection_;
  PreparedWeights weights_;
};

// Checks set_expert_counts()'s view: [experts_per_rank] int64 or int32, contiguous, on `device`.
Status validate_expert_counts(const MoeGeometry& geometry, Device device, const TensorView& counts);

// Checks forward()'s arguments against the geometry (shapes, dtypes, device, T bound). Does not
// look at the values of topk_ids (backends report out-of-range ids with the first bad token).
// Accepts what forward() accepts: int32 or int64 ids, fp32 or bf16 weights.
Status validate_forward_args(const MoeGeometry& geometry, const MoeConfig& config, Device device,
                             const TensorView& x, const TensorView& x_scale, const TensorView& topk_ids,
                             const TensorView& topk_weights, const TensorView& y);

}  // namespace megamoe
