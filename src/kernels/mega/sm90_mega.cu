// sm90_mega.cu — host side of the MegaMoE kernel: the plan (both GEMMs planned once per tile
// configuration with the grouped GEMM's own planner, the residency check) and the per-forward launch.
#include "kernels/mega/sm90_mega.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/gemm/sm90_gemm_plan.cuh"
#include "kernels/mega/mega_schedule.h"
#include "kernels/mega/sm90_mega_launch.cuh"

namespace megamoe::mega {

MEGAMOE_MEGA_CONFIGS(MEGAMOE_MEGA_EXTERN)
MEGAMOE_MEGA_CONFIGS_MXFP4(MEGAMOE_MEGA_EXTERN_MXFP4)
MEGAMOE_MEGA_CONFIGS_NVFP4(MEGAMOE_MEGA_EXTERN_NVFP4)

const char* mega_trace_word_name(int i) {
  static const char* const kNames[kMegaTraceWordsPerCta] = {"start",      "dispatched", "placed", "fc1_done",
                                                            "gemm_done", "combine_in", "done",   ""};
  static_assert(kMegaTraceWordsPerCta == kMegaTraceWords, "one layout");
  return i >= 0 && i < kMegaTraceWordsPerCta ? kNames[i] : "";
}

class MegaPlan {
 public:
  MegaPlanArgs args;
  MegaScratchLayout scratch;
  int64_t ld_pool = 0;
  MegaGemms gemms[3];  // by BLOCK_M index (kMegaBlockMs)
  bool built[3] = {};
};

void MegaPlanDeleter::operator()(MegaPlan* p) const { delete p; }

int mega_plan_grid(const MegaPlan& plan) { return plan.args.grid; }

namespace {

int block_m_index(int bm) { return bm == 16 ? 0 : bm == 64 ? 1 : 2; }

Status bad(const std::string& field, const std::string& value, const std::string& rule) {
  return Status(StatusCode::kInvalidArgument, "invalid mega plan: " + field + "=" + value + ", " + rule);
}

// How many CTAs of the configuration at (block_m, fp8, mxfp4 weights, nvfp4 weights) an SM holds
// (raising its shared-memory limit).
cudaError_t occupancy(int bm, bool fp8, bool w4, bool nv4, int* ctas) {
  cudaError_t err = cudaErrorInvalidConfiguration;
#define MEGAMOE_MEGA_OCC(BM, FP8)              \
  if (!w4 && !nv4 && bm == BM && fp8 == FP8) \
    err = mega_config_occupancy<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(ctas);
#define MEGAMOE_MEGA_OCC_FP4(BM) \
  if (w4 && bm == BM) err = mega_config_occupancy<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(ctas);
#define MEGAMOE_MEGA_OCC_NVFP4(BM) \
  if (nv4 && bm == BM) err = mega_config_occupancy<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(ctas);
  MEGAMOE_MEGA_CONFIGS(MEGAMOE_MEGA_OCC)
  MEGAMOE_MEGA_CONFIGS_MXFP4(MEGAMOE_MEGA_OCC_FP4)
  MEGAMOE_MEGA_CONFIGS_NVFP4(MEGAMOE_MEGA_OCC_NVFP4)
#undef MEGAMOE_MEGA_OCC
#undef MEGAMOE_MEGA_OCC_FP4
#undef MEGAMOE_MEGA_OCC_NVFP4
  return err;
}

}  // namespace

Status make_mega_plan(const MegaPlanArgs& args, MegaPlanPtr* out) {
  const kernels::TransportArgs& t = args.transport;
  const WorkspaceLayout& l = t.layout;
  const WorkspaceParams& wp = l.params;
  const int64_t P = l.pool_rows, H = wp.hidden, I = args.intermediate, El = wp.experts_per_rank;
  if (!wp.mega) return bad("workspace.mega", "0", "the workspace must have the mega layout");
  if (P <= 0) return bad("pool_rows", std::to_string(P), "must be > 0 (max_tokens_per_rank >= 1)");
  if (P % 4 != 0) return bad("pool_rows", std::to_string(P), "must be a multiple of 4 (the mega layout's)");
  if (H % kMegaBlockN != 0) return bad("hidden", std::to_string(H), "must be a multiple of 256 (FC2's 256-wide tiles)");
  if (El > kMegaMaxLocalExperts) return bad("experts_per_rank", std::to_string(El), "must be <= 512");
  if (t.num_experts > kMegaMaxExperts) return bad("num_experts", std::to_string(t.num_experts), "must be <= 4096");
  const bool staged = mega_staged_combine(wp.combine_format, wp.owner_reduce != 0);
  if (wp.in_kernel_fc2_reduce && staged)
    return bad("in_kernel_fc2_reduce", "1",
               "adds FC2's bf16 partials one per slot: needs the bf16 combine wire without the owner reduce");
  if (wp.in_kernel_fc2_reduce && l.combine.bytes < wp.max_tokens_per_rank * H * 2)
    return bad("workspace.combine", std::to_string(l.combine.bytes),
               "must hold the in-kernel reduce's T_max x H bf16 accumulation rows (the mega layout's)");
  if (staged && args.expert_out == nullptr)
    return bad("expert_out", "null", "required with a quantised combine wire or the owner reduce (the staged send)");
  if (args.fp8 != (wp.dispatch_format == kWsFp8Block) || args.fp8 != (wp.intermediate_format == kWsFp8Block))
    return bad("dispatch_format", std::to_string(wp.dispatch_format), "must match the weights (fp8-block or bf16)");
  if (args.weight_fp4 && !args.fp8)
    return bad("weight_fp4", "1", "mxfp4 weights run with the fp8 activations, wire and intermediate (fp8 = 1)");
  if (args.weight_nvfp4 && args.fp8)
    return bad("weight_nvfp4", "1", "nvfp4 weights run as bf16 with the bf16 activations, wire and intermediate (fp8 = 0)");
  if (args.weight_nvfp4 && (args.w13_expert_scale == nullptr || args.w2_expert_scale == nullptr))
    return bad("w13_expert_scale / w2_expert_scale", "null", "required with nvfp4 weights (fp32 [experts_per_rank] each)");
  if (!args.weight_nvfp4 && (args.w13_expert_scale != nullptr || args.w2_expert_scale != nullptr))
    return bad("w13_expert_scale / w2_expert_scale", "set", "only nvfp4 weights have global scales");
  if (args.grid < 1) return bad("grid", std::to_string(args.grid), "must be >= 1");
  // Every CTA ranks at most `threads` of this rank's tokens in the dispatch (the smallest is 256).
  if (wp.max_tokens_per_rank > int64_t(args.grid) * mega_threads(64))
    return bad("max_tokens_per_rank", std::to_string(wp.max_tokens_per_rank),
               "must be <= 256 * the kernel's CTAs (" + std::to_string(args.grid) + ")");
  MegaPlanPtr plan(new MegaPlan());
  plan->args = args;
  plan->ld_pool = P;
  plan->scratch = MegaScratchLayout::make(P, El, sizeof(MegaCounters));
  char* base = t.sig.own_base;
  char* scratch = static_cast<char*>(args.scratch);
  auto* counters = reinterpret_cast<MegaCounters*>(scratch + plan->scratch.counters);
  int dev_sms = 0, device = 0;
  cudaGetDevice(&device);
  if (cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return Status(StatusCode::kUnavailable, "mega plan: cannot read the SM count");

  for (int bm : kMegaBlockMs) {
    if (bm == 16 && !args.fp8) continue;  // swapped 16-row tiles are fp8 only
    if (bm != 16 && args.weight_fp4) continue;  // mxfp4: 16-row tiles only (MEGAMOE_MEGA_CONFIGS_MXFP4)
    gemm::GroupedGemmArgs fc1;
    fc1.dtype = args.weight_fp4 ? gemm::GemmDtype::kMxfp4
                : args.fp8      ? gemm::GemmDtype::kFp8Block
                                : gemm::GemmDtype::kBf16;
    fc1.layout = gemm::GroupedLayout::kContiguous;
    fc1.epilogue = args.fp8           ? gemm::GemmEpilogue::kSwigluFp8
                   : args.weight_nvfp4 ? gemm::GemmEpilogue::kSwigluBf16Scaled
                                       : gemm::GemmEpilogue::kSwigluBf16;
    // nvfp4: w13's global scale on FC1's accumulators; w2's is in pool_weight (the placement's fold)
    fc1.b_expert_scale = args.weight_nvfp4 ? args.w13_expert_scale : nullptr;
    fc1.num_experts = static_cast<int32_t>(El);
    fc1.n = static_cast<int32_t>(2 * I);
    fc1.k = static_cast<int32_t>(H);
    fc1.a = base + l.pool_x.offset;
    fc1.m_rows = P;
    fc1.expert_offsets = reinterpret_cast<const int32_t*>(base + l.expert_offsets.offset);
    fc1.b = args.w13;
    fc1.d = base + l.intermediate.offset;
    fc1.ldd = I;
    fc1.pow2_scales = args.pow2_scales;
    fc1.tiles.block_m = bm;
    fc1.tiles.block_n = kMegaBlockN;
    fc1.tiles.cluster = 1;
    fc1.tiles.num_sms = args.grid;
    fc1.tile_counter = counters->tile_counter;
    fc1.tile_order = gemm::GemmTileOrder::kCounter;
    if (args.fp8) {
      fc1.a_scales = reinterpret_cast<const float*>(base + l.pool_x_scales.offset);
      fc1.ld_a_scales = plan->ld_pool;
      fc1.b_scales = args.weight_fp4 ? nullptr : args.w13_scales;  // mxfp4: inside the image
      fc1.d_scales = reinterpret_cast<float*>(base + l.intermediate_scales.offset);
      fc1.ld_d_scales = plan->ld_pool;
    }
    gemm::GroupedGemmArgs fc2 = fc1;
    fc2.epilogue = gemm::GemmEpilogue::kStoreBf16;
    fc2.b_expert_scale = nullptr;
    fc2.n = static_cast<int32_t>(H);
    fc2.k = static_cast<int32_t>(I);
    fc2.a = base + l.intermediate.offset;
    fc2.b = args.w2;
    fc2.d = nullptr;
    fc2.ldd = H;
    fc2.d_scales = nullptr;
    fc2.ld_d_scales = 0;
    if (staged) {  // unweighted bf16 rows of the pool, sent after FC2 in the wire's format
      fc2.d = args.expert_out;
    } else {  // each row's weighted bf16 partial into its source's combine row (the routed FC2's sink)
      fc2.row_map = t.pool_dst;
      fc2.row_weight = t.pool_weight;
      fc2.num_peer_d = t.sig.num_ranks;
      fc2.peer_d_rows = static_cast<int32_t>(wp.max_tokens_per_rank * wp.top_k);
      for (int r = 0; r < t.sig.num_ranks; ++r) fc2.peer_d[r] = args.peer_combine[r];
    }
    if (args.fp8) {
      fc2.a_scales = fc1.d_scales;
      fc2.ld_a_scales = plan->ld_pool;
      fc2.b_scales = args.weight_fp4 ? nullptr : args.w2_scales;
    }
    MegaGemms& g = plan->gemms[block_m_index(bm)];
    MEGAMOE_RETURN_IF_ERROR(gemm::plan_grouped_gemm(fc1, &g.fc1));
    MEGAMOE_RETURN_IF_ERROR(gemm::plan_grouped_gemm(fc2, &g.fc2));
    for (const gemm::GroupedGemmPlan* gp : {&g.fc1, &g.fc2})
      if (gp->tiles.block_m != bm || gp->tiles.block_n != kMegaBlockN || gp->tiles.cluster != 1 ||
          gp->params.tile_counter != counters->tile_counter)
        return Status(StatusCode::kInternal, "mega plan: the GEMM planner chose other tiles (" + gp->tiles.to_string() +
                                                 ") than the kernel's " + std::to_string(bm) + " x 256");
    int ctas = 0;
    const cudaError_t err = occupancy(bm, args.fp8, args.weight_fp4, args.weight_nvfp4, &ctas);
    if (err != cudaSuccess)
      return Status(StatusCode::kCudaError, std::string("mega plan: occupancy query failed: ") + cudaGetErrorString(err));
    // invariant: all CTAs resident (the kernel's CTAs wait for each other): refuse a grid that may not be.
    if (ctas < 1 || args.grid > int64_t(ctas) * dev_sms)
      return Status(StatusCode::kUnavailable, "mega plan: " + std::to_string(args.grid) + " CTAs of " +
                                                  std::to_string(bm) + "-row tiles cannot all be resident (" +
                                                  std::to_string(ctas) + " per SM, " + std::to_string(dev_sms) +
                                                  " SMs); lower Knobs::num_sms");
    plan->built[block_m_index(bm)] = true;
  }
  *out = std::move(plan);
  return Status::ok();
}

Status launch_mega(const MegaPlan& plan, const MegaForwardArgs& f, cudaStream_t stream, int* block_m_out) {
  const MegaPlanArgs& pa = plan.args;
  const WorkspaceParams& wp = pa.transport.layout.params;
  const int64_t T = f.num_tokens;
  if (T < 0 || T > wp.max_tokens_per_rank)
    return Status(StatusCode::kInvalidArgument,
                  "mega forward: T=" + std::to_string(T) + ", must be in [0, max_tokens_per_rank]");
  const int64_t rows = mega_expected_rows_per_expert(wp.ep_size, T, wp.top_k, wp.ep_size * wp.experts_per_rank);
  const int bm = mega_block_m(rows, pa.fp8, pa.block_m_knob, pa.weight_fp4);
  if (!plan.built[block_m_index(bm)])
    return Status(StatusCode::kInternal, "mega forward: no plan for BLOCK_M " + std::to_string(bm));
  if (block_m_out) *block_m_out = bm;
  MegaArgs a{};
  a.tr = pa.transport;
  a.tr.num_tokens = T;
  a.x = f.x;
  a.x_scale = f.x_scale;
  a.topk_ids = f.topk_ids;
  a.topk_weights = f.topk_weights;
  a.y = f.y;
  a.dispatch_mode = pa.fp8 ? (f.x_fp8 ? kernels::kFp8Copy : kernels::kBf16ToFp8)
                           : (f.x_fp8 ? kernels::kFp8ToBf16 : kernels::kBf16Copy);
  const int threads = mega_threads(bm);
  const int64_t chunks = pa.fp8 ? wp.hidden / 16 : wp.hidden / 8;
  const MegaDispatchShape ds = mega_dispatch_shape(T, pa.grid, threads, chunks);
  a.tokens_per_cta = ds.tokens_per_cta;
  a.dispatch_parts = ds.parts;
  a.reduce_parts = mega_reduce_parts(T, int64_t(pa.grid) * mega_math_warps(bm),
                                     kernels::combine_reduce_rounds(wp.combine_format, wp.hidden));
  a.ld_pool = plan.ld_pool;
  a.staged = mega_staged_combine(wp.combine_format, wp.owner_reduce != 0) ? 1 : 0;
  a.fc2_reduce = wp.in_kernel_fc2_reduce ? 1 : 0;
  a.expert_out = static_cast<uint16_t*>(pa.expert_out);
  {
    // (row, part) items of the send: about two per math warp at small T (this rank's T * rows per
    // token as the estimate of the rows it owns), at most the row's rounds.
    const int64_t per_token = wp.owner_reduce ? std::min<int64_t>(wp.top_k, wp.ep_size) : wp.top_k;
    a.send_parts = mega_reduce_parts(T * per_token, 2 * int64_t(pa.grid) * mega_math_warps(bm),
                                     kernels::combine_send_rounds(wp.combine_format, wp.hidden));
  }
  char* scratch = static_cast<char*>(pa.scratch);
  a.ctr = reinterpret_cast<MegaCounters*>(scratch + plan.scratch.counters);
  a.expert_fill = reinterpret_cast<int32_t*>(scratch + plan.scratch.expert_fill);
  a.expert_placed = reinterpret_cast<int32_t*>(scratch + plan.scratch.expert_placed);
  a.fc1_done = reinterpret_cast<int32_t*>(scratch + plan.scratch.fc1_done);
  a.max_m_blocks = static_cast<int32_t>(mega_max_m_blocks(pa.transport.layout.pool_rows, wp.experts_per_rank, bm));
  a.trace = f.trace;
  a.output_scale = pa.output_scale;
  a.expert_counts = f.expert_counts;
  a.counts_int64 = f.counts_int64 ? 1 : 0;
  a.w2_expert_scale = pa.w2_expert_scale;
  const MegaGemms& g = plan.gemms[block_m_index(bm)];
  cudaError_t err = cudaErrorInvalidConfiguration;
#define MEGAMOE_MEGA_LAUNCH(BM, FP8)                                   \
  if (!pa.weight_fp4 && !pa.weight_nvfp4 && bm == BM && pa.fp8 == FP8) \
    err = launch_mega_config<MegaFc2Cfg<BM, FP8>, MegaFc1Cfg<BM, FP8>>(g, a, pa.grid, pa.cooperative, stream);
#define MEGAMOE_MEGA_LAUNCH_FP4(BM)   \
  if (pa.weight_fp4 && bm == BM) \
    err = launch_mega_config<MegaFc2CfgFp4<BM>, MegaFc1CfgFp4<BM>>(g, a, pa.grid, pa.cooperative, stream);
#define MEGAMOE_MEGA_LAUNCH_NVFP4(BM) \
  if (pa.weight_nvfp4 && bm == BM)    \
    err = launch_mega_config<MegaFc2Cfg<BM, false>, MegaFc1CfgNvfp4<BM>>(g, a, pa.grid, pa.cooperative, stream);
  MEGAMOE_MEGA_CONFIGS(MEGAMOE_MEGA_LAUNCH)
  MEGAMOE_MEGA_CONFIGS_MXFP4(MEGAMOE_MEGA_LAUNCH_FP4)
  MEGAMOE_MEGA_CONFIGS_NVFP4(MEGAMOE_MEGA_LAUNCH_NVFP4)
#undef MEGAMOE_MEGA_LAUNCH
#undef MEGAMOE_MEGA_LAUNCH_FP4
#undef MEGAMOE_MEGA_LAUNCH_NVFP4
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError, std::string("mega kernel launch failed: ") + cudaGetErrorString(err) +
                                              " (BLOCK_M " + std::to_string(bm) + ", grid " + std::to_string(pa.grid) +
                                              ", T " + std::to_string(T) + ")");
  return Status::ok();
}

}  // namespace megamoe::mega
