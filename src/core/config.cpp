#include "megamoe/config.h"

#include <cmath>
#include <sstream>

namespace megamoe {
namespace {

// Kernels index rows and columns with 32-bit offsets; these bounds keep every product in range.
constexpr int64_t kMaxDim = 65536;
constexpr int64_t kMaxTopK = 32;
constexpr int64_t kMaxExperts = 4096;
// A per-rank bound above this is almost certainly a dp- or ep-multiplied value (TensorRT-LLM found
// both directions of that mistake); it would size a pool of hundreds of GiB.
constexpr int64_t kMaxTokensPerRank = 1 << 20;

std::string str(int64_t v) { return std::to_string(v); }

Status check_dim(const char* field, int64_t v) {
  if (v <= 0) return invalid_argument("geometry", field, str(v), "must be positive");
  if (v > kMaxDim) return invalid_argument("geometry", field, str(v), "must be at most " + str(kMaxDim));
  if (v % kDimAlignment != 0) {
    const int64_t padded = (v + kDimAlignment - 1) / kDimAlignment * kDimAlignment;
    return invalid_argument("geometry", field, str(v),
                            "must be a multiple of " + str(kDimAlignment) + " (pad to " + str(padded) +
                                " with MoeGeometry::padded(), or --pad in the tool)");
  }
  return Status::ok();
}

}  // namespace

Status MoeGeometry::validate() const {
  MEGAMOE_RETURN_IF_ERROR(check_dim("hidden", hidden));
  MEGAMOE_RETURN_IF_ERROR(check_dim("intermediate", intermediate));
  if (num_experts <= 0 || num_experts > kMaxExperts)
    return invalid_argument("geometry", "num_experts", str(num_experts), "must be in [1, " + str(kMaxExperts) + "]");
  if (top_k < 1 || top_k > num_experts)
    return invalid_argument("geometry", "top_k", str(top_k),
                            "must be in [1, num_experts=" + str(num_experts) + "]");
  if (top_k > kMaxTopK) return invalid_argument("geometry", "top_k", str(top_k), "must be at most " + str(kMaxTopK));
  if (ep_size < 1) return invalid_argument("geometry", "ep_size", str(ep_size), "must be at least 1");
  if (num_experts % ep_size != 0)
    return invalid_argument("geometry", "num_experts", str(num_experts),
                            "must be divisible by ep_size=" + str(ep_size));
  if (ep_rank < 0 || ep_rank >= ep_size)
    return invalid_argument("geometry", "ep_rank", str(ep_rank), "must be in [0, ep_size=" + str(ep_size) + ")");
  if (max_tokens_per_rank < 0)
    return invalid_argument("geometry", "max_tokens_per_rank", str(max_tokens_per_rank), "must be >= 0");
  if (max_tokens_per_rank > kMaxTokensPerRank)
    return invalid_argument("geometry", "max_tokens_per_rank", str(max_tokens_per_rank),
                            "must be at most " + str(kMaxTokensPerRank) +
                                " (it is the per-rank bound of one forward; never multiply it by dp or ep size)");
  return Status::ok();
}

std::string MoeGeometry::to_string() const {
  std::ostringstream os;
  os << "MoeGeometry(hidden=" << hidden << ", intermediate=" << intermediate << ", num_experts=" << num_experts
     << ", top_k=" << top_k << ", ep_size=" << ep_size << ", ep_rank=" << ep_rank
     << ", max_tokens_per_rank=" << max_tokens_per_rank << ")";
  return os.str();
}

MoeGeometry MoeGeometry::padded(int64_t multiple) const {
  MoeGeometry g = *this;
  auto up = [multiple](int64_t v) { return v <= 0 ? v : (v + multiple - 1) / multiple * multiple; };
  g.hidden = up(hidden);
  g.intermediate = up(intermediate);
  return g;
}

Status Knobs::validate() const {
  if (block_m != 0 && block_m != 16 && block_m != 32 && block_m != 64 && block_m != 128)
    return invalid_argument("knobs", "block_m", str(block_m), "must be 0 (heuristic), 16, 32, 64 or 128");
  if (block_n != 0 && block_n != 64 && block_n != 128 && block_n != 256)
    return invalid_argument("knobs", "block_n", str(block_n), "must be 0 (heuristic), 64, 128 or 256");
  if (num_sms < 0 || num_sms > 1024)
    return invalid_argument("knobs", "num_sms", str(num_sms), "must be in [0, 1024] (0 = all SMs)");
  if (combine_groups < 0 || combine_groups > 8)
    return invalid_argument("knobs", "combine_groups", str(combine_groups), "must be in [0, 8] (0 = by the token count)");
  if (gemm_cluster < 0 || gemm_cluster > 2)
    return invalid_argument("knobs", "gemm_cluster", str(gemm_cluster), "must be 0 (heuristic), 1 or 2");
  if (gemm_tile_order < 0 || gemm_tile_order > 2)
    return invalid_argument("knobs", "gemm_tile_order", str(gemm_tile_order),
                            "must be 0 (heuristic), 1 (counter) or 2 (round-robin)");
  return Status::ok();
}

std::string Knobs::to_string() const {
  std::ostringstream os;
  os << "Knobs(block_m=" << block_m << ", block_n=" << block_n << ", num_sms=" << num_sms
     << ", combine_groups=" << combine_groups << ", gemm_cluster=" << gemm_cluster
     << ", gemm_tile_order=" << gemm_tile_order << ")";
  return os.str();
}

Status MoeConfig::validate() const {
  if (static_cast<int>(backend) < 0 || static_cast<int>(backend) > static_cast<int>(Backend::kCpu))
    return invalid_argument("config", "backend", str(static_cast<int>(backend)), "must be auto, mega, routed or cpu");
  if (static_cast<int>(weight_format) < 0 || static_cast<int>(weight_format) > static_cast<int>(WeightFormat::kMxfp4))
    return invalid_argument("config", "weight_format", str(static_cast<int>(weight_format)),
                            "must be bf16, fp8-block, mxfp8, nvfp4 or mxfp4");
  if (static_cast<int>(dispatch_format) < 0 ||
      static_cast<int>(dispatch_format) > static_cast<int>(DispatchFormat::kFp8Block))
    return invalid_argument("config", "dispatch_format", str(static_cast<int>(dispatch_format)),
                            "must be bf16 or fp8-block");
  if (static_cast<int>(combine_dtype) < 0 || static_cast<int>(combine_dtype) > static_cast<int>(CombineDtype::kNvfp4))
    return invalid_argument("config", "combine_dtype", str(static_cast<int>(combine_dtype)),
                            "must be bf16, mxfp8 or nvfp4");
  if (in_kernel_fc2_reduce && combine_dtype != CombineDtype::kBf16)
    return invalid_argument("config", "combine_dtype", megamoe::to_string(combine_dtype),
                            "in_kernel_fc2_reduce adds bf16 partials atomically into the owner's output and needs "
                            "combine_dtype=bf16 (a quantized wire needs a staged (data, scale) pair and a "
                            "dequantizing receiver)");
  if (static_cast<int>(owner_reduce) < 0 || static_cast<int>(owner_reduce) > static_cast<int>(OwnerReduce::kOn))
    return invalid_argument("config", "owner_reduce", str(static_cast<int>(owner_reduce)), "must be auto, off or on");
  if (owner_reduce == OwnerReduce::kOn && in_kernel_fc2_reduce)
    return invalid_argument("config", "owner_reduce", "on",
                            "cannot be combined with in_kernel_fc2_reduce=true (the in-kernel reduce adds per-slot "
                            "bf16 partials atomically into the source's output; the owner reduce sends one summed "
                            "row per owner rank; pick one)");
  if (pow2_scales && weight_format != WeightFormat::kFp8Block && dispatch_format != DispatchFormat::kFp8Block)
    return invalid_argument("config", "pow2_scales", "true",
                            "applies to fp8-block scales only; weight_format or dispatch_format must be fp8-block");
  if (!std::isfinite(output_scale)) {
    std::ostringstream v;
    v << output_scale;
    return invalid_argument("config", "output_scale", v.str(), "must be finite (1 = the weighted sum as is)");
  }
  if (workspace_lane < 0 || workspace_lane > 255)
    return invalid_argument("config", "workspace_lane", str(workspace_lane), "must be in [0, 255]");
  if (mega_max_tokens_per_rank < 0)
    return invalid_argument("config", "mega_max_tokens_per_rank", str(mega_max_tokens_per_rank),
                            "must be >= 0 (0 = never pick mega in auto)");
  return knobs.validate();
}

Status MoeConfig::validate(const MoeGeometry& geometry) const {
  MEGAMOE_RETURN_IF_ERROR(geometry.validate());
  MEGAMOE_RETURN_IF_ERROR(validate());
  return Status::ok();
}

std::string MoeConfig::to_string() const {
  std::ostringstream os;
  os << "MoeConfig(backend=" << megamoe::to_string(backend) << ", weight_format=" << megamoe::to_string(weight_format)
     << ", dispatch_format=" << megamoe::to_string(dispatch_format)
     << ", combine_dtype=" << megamoe::to_string(combine_dtype) << ", pow2_scales=" << (pow2_scales ? "true" : "false")
     << ", in_kernel_fc2_reduce=" << (in_kernel_fc2_reduce ? "true" : "false")
     << ", owner_reduce=" << megamoe::to_string(owner_reduce) << ", output_scale=" << output_scale
     << ", mega_max_tokens_per_rank=" << mega_max_tokens_per_rank << ", workspace_lane=" << workspace_lane
     << ", knobs=" << knobs.to_string() << ")";
  return os.str();
}

bool MoeConfig::uses_owner_reduce() const {
  if (owner_reduce == OwnerReduce::kAuto) return combine_dtype != CombineDtype::kBf16 && !in_kernel_fc2_reduce;
  return owner_reduce == OwnerReduce::kOn;
}

DispatchFormat MoeConfig::intermediate_format() const {
  if (weight_format == WeightFormat::kBf16) return DispatchFormat::kBf16;
  // nvfp4 weights with a bf16 dispatch: the GPU backends run them as bf16 (docs/GEMM.md, "nvfp4, the
  // first step"), so the intermediate is bf16 there, and here for every backend (same points).
  if (weight_format == WeightFormat::kNvfp4 && dispatch_format == DispatchFormat::kBf16) return DispatchFormat::kBf16;
  return DispatchFormat::kFp8Block;
}

}  // namespace megamoe
