// MoeLayer construction: validation, backend selection (once), weight preparation, dispatch to the
// backend's factory. Also the forward-argument checks every backend shares.
#include "megamoe/layer.h"

#include <cuda_runtime.h>

#include "comm/gpu_comm.h"
#include "core/backends.h"
#include "core/device.h"
#include "core/log.h"
#include "megamoe/knobs.h"

namespace megamoe {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Shared by the GPU backends' gates: the layer's device must be a Hopper GPU. device < 0: the layer
// would have no CUDA device (`why` says why).
Status hopper_device_gate(const char* backend, int device, const std::string& why) {
  if (device < 0) return Status(StatusCode::kUnavailable, std::string(backend) + " cannot run here: " + why);
  std::string reason;
  if (cuda_device_count(&reason) == 0) return Status(StatusCode::kUnavailable, reason);
  auto devices = cuda_devices();
  const CudaDeviceInfo* d = nullptr;
  for (const CudaDeviceInfo& info : devices)
    if (info.ordinal == device) d = &info;
  if (!d)
    return Status(StatusCode::kUnavailable, std::string(backend) + ": the layer's device cuda:" + str(device) +
                                                " is not among the " + str(static_cast<int64_t>(devices.size())) +
                                                " visible CUDA devices");
  if (d->major != 9 || d->minor != 0) {
    return Status(StatusCode::kUnavailable, std::string(backend) + " needs an sm_90 (Hopper) device; the layer's "
                                                "device cuda:" + str(device) + " is " + d->name + " (sm_" +
                                                str(d->major) + str(d->minor) + ")");
  }
  return Status::ok();
}

int current_cuda_device() {
  int dev = 0;
  if (cuda_device_count() == 0 || cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return dev;
}

}  // namespace

int layer_device_of(const Communicator* comm, std::string* why_not) {
  if (!comm) return current_cuda_device();
  if (const GpuRankComm* gpu = gpu_rank_of(comm)) return gpu->device();
  if (why_not)
    *why_not = "its communicator " + comm->to_string() +
               " is not a GPU group's (create_nccl_group / create_nccl_rank / create_shared_gpu_group)";
  return -1;
}

Status weight_dispatch_pairing_gate(const char* backend, const MoeConfig& c) {
  if (c.weight_format == WeightFormat::kFp8Block && c.dispatch_format != DispatchFormat::kFp8Block)
    return Status(StatusCode::kUnavailable, std::string("the ") + backend +
                                                " backend runs fp8-block weights with dispatch_format=fp8-block (got "
                                                "dispatch_format=" + to_string(c.dispatch_format) + ")");
  if (c.weight_format == WeightFormat::kBf16 && c.dispatch_format != DispatchFormat::kBf16)
    return Status(StatusCode::kUnavailable, std::string("the ") + backend +
                                                " backend runs bf16 weights with dispatch_format=bf16 (got "
                                                "dispatch_format=" + to_string(c.dispatch_format) + ")");
  if (c.weight_format == WeightFormat::kMxfp4 && c.dispatch_format != DispatchFormat::kFp8Block)
    return Status(StatusCode::kUnavailable, std::string("the ") + backend +
                                                " backend runs mxfp4 weights with dispatch_format=fp8-block (e4m3 "
                                                "activations; got dispatch_format=" + to_string(c.dispatch_format) +
                                                ")");
  if (c.weight_format == WeightFormat::kNvfp4 && c.dispatch_format != DispatchFormat::kBf16)
    return Status(StatusCode::kUnavailable, std::string("the ") + backend +
                                                " backend runs nvfp4 weights with dispatch_format=bf16 (the codes "
                                                "expanded to bf16 for the bf16 GEMM; got dispatch_format=" +
                                                to_string(c.dispatch_format) + ")");
  return Status::ok();
}

Status mxfp4_shape_gate(const char* backend, const MoeGeometry& g, const MoeConfig& c) {
  if (c.weight_format != WeightFormat::kMxfp4) return Status::ok();
  if (g.hidden % 256 != 0)
    return Status(StatusCode::kUnavailable, std::string("the ") + backend + " backend: geometry.hidden=" +
                                                str(g.hidden) +
                                                " must be a multiple of 256 with weight_format=mxfp4 (FC2's N = "
                                                "hidden runs the mxfp4 GEMM's 256-wide tiles)");
  return Status::ok();
}

Status mega_capability_on(const MoeGeometry& g, const MoeConfig& c, int device, const std::string& why_not) {
  MEGAMOE_RETURN_IF_ERROR(hopper_device_gate("the mega backend", device, why_not));
  return mega_format_gate(g, c);
}

// The weight formats `auto` keeps off mega (backend=mega runs them on request): mxfp4, timed: mega's
// kernel has the 16-row tile only, within 4% of routed at 1-8 tokens/rank and 1.6-2.6x routed's time
// at 128-1024 (deepseek-v3, 32 experts, EP1, one H200; docs/PERF.md "FP4 weights"); nvfp4 wherever
// routed runs it, until timed against routed's (the bf16 wire FC2 writes
// itself, no owner reduce: there mega is bitwise routed's and only its time is open). nvfp4 with a
// quantised wire or the owner reduce runs on mega only, so `auto` takes mega there rather than fall
// to cpu. The fp8-block and bf16 kernels are measured (docs/PERF.md, "Mega backend").
Status mega_auto_format_gate(const MoeConfig& c) {
  if (c.weight_format == WeightFormat::kMxfp4)
    return Status(StatusCode::kUnavailable,
                  "the mega backend's mxfp4 kernel (16-row tiles only) measured within 4% of routed's time at 1-8 "
                  "tokens/rank and 1.6-2.6x it at 128-1024 (docs/PERF.md, \"FP4 weights\"; auto keeps to routed "
                  "with weight_format=mxfp4; backend=mega runs it on request)");
  if (c.weight_format == WeightFormat::kNvfp4 && c.combine_dtype == CombineDtype::kBf16 && !c.uses_owner_reduce())
    return Status(StatusCode::kUnavailable,
                  "the mega backend's nvfp4 kernel has not been measured against routed's beyond qwen3-30b-a3b at "
                  "EP1, where it was faster at 1-512 tokens (docs/PERF.md; auto keeps to routed "
                  "with weight_format=nvfp4 where routed runs it: combine_dtype=bf16, no owner reduce; backend=mega "
                  "runs it on request)");
  return Status::ok();
}

// What `auto` asks of mega: its gate, a weight format whose mega kernel is measured
// (mega_auto_format_gate), and a group of a kind the kernel has run on. Measured on one H200
// (docs/PERF.md, "Mega backend"): EP1 and logical ranks sharing a GPU, bitwise equal to routed and
// faster at every measured size; a group of more than one NCCL rank (one GPU per rank) has not run it
// yet, so `auto` keeps to routed there (backend=mega runs it on request).
static Status mega_auto_capability(const MoeGeometry& g, const MoeConfig& c, int device, const std::string& why_not,
                                   const Communicator* comm) {
  MEGAMOE_RETURN_IF_ERROR(mega_capability_on(g, c, device, why_not));
  MEGAMOE_RETURN_IF_ERROR(mega_auto_format_gate(c));
  if (comm && comm->kind() == CommKind::kNccl && comm->size() > 1)
    return Status(StatusCode::kUnavailable,
                  "the mega backend has not run on a group of one GPU per rank yet (auto keeps to routed there; "
                  "backend=mega runs it on request)");
  return Status::ok();
}

Status routed_capability_on(const MoeGeometry& g, const MoeConfig& c, int device, const std::string& why_not) {
  MEGAMOE_RETURN_IF_ERROR(hopper_device_gate("the routed backend", device, why_not));
  return routed_format_gate(g, c);
}

Status mega_capability(const MoeGeometry& g, const MoeConfig& c) {
  return mega_capability_on(g, c, current_cuda_device(), "");
}

Status routed_capability(const MoeGeometry& g, const MoeConfig& c) {
  return routed_capability_on(g, c, current_cuda_device(), "");
}

Status cpu_capability(const MoeGeometry&, const MoeConfig&) { return Status::ok(); }

BackendSelection select_backend(const MoeGeometry& g, const MoeConfig& c, const Status& mega_gate,
                                const Status& routed_gate) {
  BackendSelection s;
  if (c.backend != Backend::kAuto) {
    s.backend = c.backend;
    s.reason = std::string("backend=") + to_string(c.backend) + " requested";
    return s;
  }
  const int64_t t = g.max_tokens_per_rank, threshold = c.mega_max_tokens_per_rank;
  std::string why_not_mega;
  if (t <= 0) why_not_mega = "max_tokens_per_rank=" + str(t) + " is not positive";
  else if (t > threshold)
    why_not_mega = "max_tokens_per_rank=" + str(t) + " > mega_max_tokens_per_rank=" + str(threshold);
  else if (!mega_gate.is_ok()) why_not_mega = mega_gate.message();
  if (why_not_mega.empty()) {
    s.backend = Backend::kMega;
    s.reason = "auto: mega (max_tokens_per_rank=" + str(t) + " <= mega_max_tokens_per_rank=" + str(threshold) + ")";
    return s;
  }
  s.reason = "auto: mega not chosen: " + why_not_mega;
  if (routed_gate.is_ok()) {
    s.backend = Backend::kRouted;
    s.reason += "; auto: routed";
    return s;
  }
  s.reason += "; auto: routed not chosen: " + routed_gate.message();
  // Only the threshold kept mega out (0 disables mega under auto), and no other GPU backend runs it.
  if (t > 0 && threshold > 0 && mega_gate.is_ok()) {
    s.backend = Backend::kMega;
    s.reason += "; auto: mega (the GPU backend that runs this configuration)";
    return s;
  }
  s.backend = Backend::kCpu;
  s.reason += "; auto: cpu";
  return s;
}

BackendSelection select_backend(const MoeGeometry& g, const MoeConfig& c) { return select_backend_for(g, c, nullptr); }

BackendSelection select_backend_for(const MoeGeometry& g, const MoeConfig& c, const Communicator* comm) {
  std::string why_not;
  const int device = layer_device_of(comm, &why_not);
  MoeConfig effective = c;
  std::string crossover_note;
  // The measured crossover replaces the default threshold (an explicit non-default value wins).
  if (c.backend == Backend::kAuto) {
    auto devices = cuda_devices();
    const MegaThreshold t =
        mega_threshold_in_force(g, c, devices.empty() ? std::string() : devices.front().name, process_knob_cache());
    if (t.from_cache) {
      effective.mega_max_tokens_per_rank = t.value;
      crossover_note = " (threshold " + str(t.value) + " from the knob cache)";
    }
  }
  BackendSelection s = select_backend(g, effective, mega_auto_capability(g, effective, device, why_not, comm),
                                      routed_capability_on(g, effective, device, why_not));
  s.reason += crossover_note;
  return s;
}

namespace {

// MoeLayer::create() once the arguments are checked and the tuned knobs applied: selection, gates,
// weight preparation, the backend's factory.
Status create_layer(const MoeGeometry& g, const MoeConfig& c, const MoeWeights& weights,
                    std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out) {
  const bool device_source = on_device(weights);
  if (device_source) MEGAMOE_RETURN_IF_ERROR(check_device_weights(g, c, weights));
  BackendSelection selection = select_backend_for(g, c, comm.get());
  if (c.backend == Backend::kAuto) {
    if (selection.backend != Backend::kMega) log_info("backend selection: %s", selection.reason.c_str());
  } else {
    std::string why_not;
    const int device = layer_device_of(comm.get(), &why_not);
    Status gate = c.backend == Backend::kMega     ? mega_capability_on(g, c, device, why_not)
                  : c.backend == Backend::kRouted ? routed_capability_on(g, c, device, why_not)
                                                  : cpu_capability(g, c);
    if (!gate.is_ok())
      return Status(StatusCode::kUnavailable,
                    std::string("backend=") + to_string(c.backend) + " is unavailable: " + gate.message());
  }

  PreparedWeights prepared;
  if (device_source) {
    // Prepared on the layer's device by the GPU backend (prepare_device_expert_weights); the host
    // keeps the format and shapes only.
    if (selection.backend != Backend::kRouted && selection.backend != Backend::kMega)
      return invalid_argument("weights", "w13.device", weights.w13.device.to_string(),
                              std::string("the ") + to_string(selection.backend) +
                                  " backend computes from host memory (" + selection.reason +
                                  "); copy the weights to the host first");
    // Before the backend builds anything (prepare_device_expert_weights checks it again).
    const int device = layer_device_of(comm.get(), nullptr);
    if (device >= 0 && weights.w13.device != Device::cuda(device))
      return invalid_argument("weights", "w13.device", weights.w13.device.to_string(),
                              "device-resident weights must be on the layer's device cuda:" + str(device) +
                                  " (its communicator's); else copy the weights to the host first");
    prepared.format = c.weight_format;
    prepared.w13.format = prepared.w2.format = c.weight_format;
    prepared.w13.num_experts = prepared.w2.num_experts = g.experts_per_rank();
    prepared.w13.rows = 2 * g.intermediate;
    prepared.w13.cols = g.hidden;
    prepared.w2.rows = g.hidden;
    prepared.w2.cols = g.intermediate;
    if (selection.backend == Backend::kRouted)
      return create_routed_layer(g, c, std::move(selection), std::move(prepared), std::move(comm), out, &weights);
    return create_mega_layer(g, c, std::move(selection), std::move(prepared), std::move(comm), out, &weights);
  }
  MEGAMOE_RETURN_IF_ERROR(prepare_weights(g, c, weights, &prepared));

  switch (selection.backend) {
    case Backend::kCpu:
      return create_cpu_layer(g, c, std::move(selection), std::move(prepared), std::move(comm), out);
    case Backend::kRouted:
      return create_routed_layer(g, c, std::move(selection), std::move(prepared), std::move(comm), out);
    case Backend::kMega:
      return create_mega_layer(g, c, std::move(selection), std::move(prepared), std::move(comm), out);
    default:
      return Status(StatusCode::kUnavailable,
                    std::string("backend ") + to_string(selection.backend) + " is not built yet");
  }
}

}  // namespace

Status MoeLayer::create(const MoeGeometry& g, const MoeConfig& c, const MoeWeights& weights,
                        std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a std::unique_ptr<MoeLayer>");
  MEGAMOE_RETURN_IF_ERROR(c.validate(g));
  if (g.ep_size > 1 && !comm)
    return invalid_argument("argument", "comm", "null", "ep_size=" + str(g.ep_size) + " needs a communicator");
  if (comm) {
    if (comm->size() != g.ep_size)
      return invalid_argument("argument", "comm.size()", str(comm->size()), "must equal ep_size=" + str(g.ep_size));
    if (comm->rank() != g.ep_rank)
      return invalid_argument("argument", "comm.rank()", str(comm->rank()), "must equal ep_rank=" + str(g.ep_rank));
  }

  // Tuned knobs from the knob cache fill the fields the caller left to the heuristic.
  MoeConfig tuned = c;
  if (auto devices = cuda_devices(); !devices.empty()) {
    std::string note;
    tuned = apply_tuned_knobs(c, g, devices.front().name, process_knob_cache(), &note);
    if (!note.empty()) log_info("%s", note.c_str());
  }
  return create_layer(g, tuned, weights, std::move(comm), out);
}


namespace {

// `dtype2` is a second accepted dtype (or `dtype` again).
Status check_tensor(const char* name, const TensorView& t, Device device, DType dtype, int64_t rows, int64_t cols,
                    const char* rows_rule, const char* cols_rule, DType dtype2) {
  const std::string n(name);
  if (t.ndim != 2) return invalid_argument("forward argument", n + ".ndim", str(t.ndim), "must be 2");
  if (t.dtype != dtype && t.dtype != dtype2)
    return invalid_argument("forward argument", n + ".dtype", to_string(t.dtype),
                            std::string("must be ") + to_string(dtype) +
                                (dtype2 != dtype ? std::string(" or ") + to_string(dtype2) : std::string()));
  if (t.shape[0] != rows)
    return invalid_argument("forward argument", n + ".shape[0]", str(t.shape[0]),
                            "must equal " + std::string(rows_rule) + "=" + str(rows));
  if (t.shape[1] != cols)
    return invalid_argument("forward argument", n + ".shape[1]", str(t.shape[1]),
                            "must equal " + std::string(cols_rule) + "=" + str(cols));
  if (t.device != device)
    return invalid_argument("forward argument", n + ".device", t.device.to_string(),
                            "must be " + device.to_string() + " (the layer's device)");
  if (!t.is_contiguous()) return invalid_argument("forward argument", n + ".strides", "non-contiguous", "must be contiguous");
  if (rows > 0 && t.data == nullptr)
    return invalid_argument("forward argument", n + ".data", "null", "must be set when T > 0");
  return Status::ok();
}

Status check_tensor(const char* name, const TensorView& t, Device device, DType dtype, int64_t rows, int64_t cols,
                    const char* rows_rule, const char* cols_rule) {
  return check_tensor(name, t, device, dtype, rows, cols, rows_rule, cols_rule, dtype);
}

}  // namespace

Status validate_expert_counts(const MoeGeometry& g, Device device, const TensorView& counts) {
  const int64_t el = g.experts_per_rank();
  if (counts.ndim != 1 || counts.shape[0] != el)
    return invalid_argument("expert counts", "counts.shape", counts.to_string(),
                            "must be [experts_per_rank=" + str(el) + "]");
  if (counts.dtype != DType::kInt64 && counts.dtype != DType::kInt32)
    return invalid_argument("expert counts", "counts.dtype", to_string(counts.dtype), "must be int64 or int32");
  if (counts.device != device)
    return invalid_argument("expert counts", "counts.device", counts.device.to_string(),
                            "must be " + device.to_string() + " (the layer's device)");
  if (!counts.is_contiguous() || counts.data == nullptr)
    return invalid_argument("expert counts", "counts", counts.to_string(), "must be contiguous with its data set");
  return Status::ok();
}

Status validate_forward_args(const MoeGeometry& g, const MoeConfig&, Device device, const TensorView& x,
                             const TensorView& x_scale, const TensorView& topk_ids, const TensorView& topk_weights,
                             const TensorView& y) {
  if (x.ndim != 2) return invalid_argument("forward argument", "x.ndim", str(x.ndim), "must be 2 ([T, hidden])");
  const int64_t t = x.shape[0];
  if (t < 0) return invalid_argument("forward argument", "x.shape[0]", str(t), "must be >= 0");
  if (t > g.max_tokens_per_rank)
    return invalid_argument("forward argument", "x.shape[0]", str(t),
                            "T must be at most max_tokens_per_rank=" + str(g.max_tokens_per_rank));
  if (x.dtype != DType::kBFloat16 && x.dtype != DType::kFloat8E4M3)
    return invalid_argument("forward argument", "x.dtype", to_string(x.dtype), "must be bfloat16 or float8_e4m3");
  MEGAMOE_RETURN_IF_ERROR(check_tensor("x", x, device, x.dtype, t, g.hidden, "T", "hidden"));
  if (x.dtype == DType::kFloat8E4M3) {
    if (!x_scale.present())
      return invalid_argument("forward argument", "x_scale", "absent", "a float8_e4m3 x needs x_scale [T, hidden/128] float32");
    MEGAMOE_RETURN_IF_ERROR(
        check_tensor("x_scale", x_scale, device, DType::kFloat32, t, g.hidden / 128, "T", "hidden/128"));
  } else if (x_scale.present()) {
    return invalid_argument("forward argument", "x_scale", x_scale.to_string(), "must be absent for a bfloat16 x");
  }
  MEGAMOE_RETURN_IF_ERROR(
      check_tensor("topk_ids", topk_ids, device, DType::kInt32, t, g.top_k, "T", "top_k", DType::kInt64));
  MEGAMOE_RETURN_IF_ERROR(check_tensor("topk_weights", topk_weights, device, DType::kFloat32, t, g.top_k, "T",
                                       "top_k", DType::kBFloat16));
  MEGAMOE_RETURN_IF_ERROR(check_tensor("y", y, device, DType::kBFloat16, t, g.hidden, "T", "hidden"));
  // The GPU kernels read x and write y 16 bytes at a time (a misaligned access would kill the context).
  if (device.kind == DeviceKind::kCuda && t > 0)
    for (const auto& [name, v] : {std::pair<const char*, const TensorView*>{"x.data", &x}, {"y.data", &y}})
      if (reinterpret_cast<uintptr_t>(v->data) % 16 != 0)
        return invalid_argument("forward argument", name, "an address " + str(static_cast<int64_t>(reinterpret_cast<uintptr_t>(v->data) % 16)) +
                                                              " bytes past a 16-byte boundary",
                                "must be 16-byte aligned on a GPU backend (its kernels move 16 bytes at a time)");
  return Status::ok();
}

}  // namespace megamoe
