// sm90_fp8_grouped_gemm.cu — host launcher of the grouped GEMM: argument checks, tile choice,
// tensor maps, grid, launch. Device code: sm90_fp8_grouped_gemm.cuh.
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "kernels/gemm/gemm_heuristic.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.cuh"
#include "kernels/gemm/sm90_gemm_plan.cuh"

namespace megamoe::gemm {

MEGAMOE_GROUPED_GEMM_CONFIGS_FP8(MEGAMOE_GROUPED_GEMM_EXTERN)
MEGAMOE_GROUPED_GEMM_CONFIGS_BF16(MEGAMOE_GROUPED_GEMM_EXTERN)
MEGAMOE_GROUPED_GEMM_CONFIGS_BF16_SCALED(MEGAMOE_GROUPED_GEMM_EXTERN)
MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4(MEGAMOE_GROUPED_GEMM_EXTERN_FP4)
MEGAMOE_GROUPED_GEMM_CONFIGS_NVFP4(MEGAMOE_GROUPED_GEMM_EXTERN_FP4)

const char* to_string(GemmDtype d) {
  switch (d) {
    case GemmDtype::kFp8Block: return "fp8-block";
    case GemmDtype::kMxfp4: return "mxfp4";
    case GemmDtype::kNvfp4: return "nvfp4";
    default: return "bf16";
  }
}
const char* to_string(GroupedLayout l) { return l == GroupedLayout::kContiguous ? "contiguous" : "masked"; }
const char* to_string(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kSwigluFp8: return "swiglu-fp8";
    case GemmEpilogue::kSwigluBf16: return "swiglu-bf16";
    case GemmEpilogue::kSwigluBf16Scaled: return "swiglu-bf16-scaled";
    default: return "store-bf16";
  }
}

std::string GemmTileConfig::to_string() const {
  std::ostringstream s;
  s << "GemmTileConfig(block_m=" << block_m << ", block_n=" << block_n << ", num_sms=" << num_sms
    << ", order=" << (round_robin ? "round-robin" : "counter") << ", cluster=" << cluster
    << ", fp4_math_wg=" << fp4_math_wg << ", ctas_per_sm=" << ctas_per_sm << ", grid=" << grid << ")";
  return s.str();
}

std::string GroupedGemmArgs::to_string() const {
  std::ostringstream s;
  s << "GroupedGemmArgs(dtype=" << gemm::to_string(dtype) << ", layout=" << gemm::to_string(layout)
    << ", epilogue=" << gemm::to_string(epilogue) << ", num_experts=" << num_experts << ", n=" << n << ", k=" << k
    << ", m_rows=" << m_rows << ", tiles=" << tiles.to_string() << ")";
  return s.str();
}

namespace {

constexpr int kMaxExperts = 512;

Status bad(const std::string& field, const std::string& value, const std::string& rule) {
  // Same message form as megamoe::invalid_argument (not called: that lives in the host library).
  return Status(StatusCode::kInvalidArgument, "invalid grouped GEMM argument: " + field + "=" + value + ", " + rule);
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// 2-D tensor map: dims {inner, outer}, outer stride in bytes, box {box_inner, box_outer}.
Status make_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, uint64_t inner, uint64_t outer,
                uint64_t stride_bytes, uint32_t box_inner, uint32_t box_outer, bool swizzle128, const char* what) {
  auto fn = encode_fn();
  if (fn == nullptr) return Status(StatusCode::kUnavailable, "grouped GEMM: cuTensorMapEncodeTiled not available");
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {stride_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::ostringstream s;
    s << "grouped GEMM: cuTensorMapEncodeTiled failed for " << what << " (CUresult " << int(r) << ", dims {" << inner
      << ", " << outer << "}, stride " << stride_bytes << ", box {" << box_inner << ", " << box_outer << "})";
    return Status(StatusCode::kInternal, s.str());
  }
  return Status::ok();
}

struct DeviceInfo {
  int major = 0, sms = 0;
};

Status current_device(DeviceInfo* info) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&info->major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return Status(StatusCode::kUnavailable, std::string("grouped GEMM: no CUDA device: ") + cudaGetErrorString(e));
  if (info->major != 9)
    return Status(StatusCode::kUnavailable, "grouped GEMM: needs an sm_90 (Hopper) device, compute capability major=" +
                                                std::to_string(info->major));
  return Status::ok();
}

}  // namespace

Status validate_grouped_gemm(const GroupedGemmArgs& a) {
  const bool mxfp4 = a.dtype == GemmDtype::kMxfp4;
  const bool nvfp4 = a.dtype == GemmDtype::kNvfp4;  // bf16 A; FP4 weights like mxfp4's
  const bool fp4 = mxfp4 || nvfp4;
  const bool fp8 = a.dtype == GemmDtype::kFp8Block || mxfp4;  // the A side and the scale handling
  const bool swiglu = a.epilogue != GemmEpilogue::kStoreBf16;
  const int64_t eb = fp8 ? 1 : 2;
  if (a.num_experts < 1 || a.num_experts > kMaxExperts)
    return bad("num_experts", std::to_string(a.num_experts), "must be in [1, 512]");
  if (a.k <= 0 || a.k % 128 != 0) return bad("k", std::to_string(a.k), "must be a positive multiple of 128");
  if (a.n <= 0 || a.n % (swiglu ? 256 : 128) != 0)
    return bad("n", std::to_string(a.n), swiglu ? "must be a positive multiple of 256 (2I, I a multiple of 128)"
                                                : "must be a positive multiple of 128");
  if (a.epilogue == GemmEpilogue::kSwigluFp8 && !fp8) return bad("epilogue", "swiglu-fp8", "needs dtype fp8-block");
  if (a.epilogue == GemmEpilogue::kSwigluBf16 && fp8) return bad("epilogue", "swiglu-bf16", "needs dtype bf16");
  if (int32_t(a.epilogue) < 0 || int32_t(a.epilogue) > int32_t(GemmEpilogue::kSwigluBf16Scaled))
    return bad("epilogue", std::to_string(int(a.epilogue)), "must be one of GemmEpilogue's values (0-3)");
  if (a.epilogue == GemmEpilogue::kSwigluBf16 && nvfp4)
    return bad("epilogue", "swiglu-bf16", "dtype nvfp4 runs swiglu-bf16-scaled (the image's global scales)");
  if (a.epilogue == GemmEpilogue::kSwigluBf16Scaled && nvfp4) {
    if (a.b_expert_scale != nullptr)
      return bad("b_expert_scale", "set", "must be null with dtype nvfp4 (the global scales are the image's first region)");
  } else if (a.epilogue == GemmEpilogue::kSwigluBf16Scaled) {
    if (fp8) return bad("epilogue", "swiglu-bf16-scaled", "needs dtype bf16 or nvfp4");
    if (a.b_expert_scale == nullptr)
      return bad("b_expert_scale", "null", "required for swiglu-bf16-scaled (fp32 [num_experts])");
  } else if (a.b_expert_scale != nullptr) {
    return bad("b_expert_scale", "set", std::string("must be null with epilogue ") + to_string(a.epilogue) +
                                            " (only swiglu-bf16-scaled reads it)");
  }
  if (a.m_rows < 0 || a.m_rows > (int64_t(1) << 30)) return bad("m_rows", std::to_string(a.m_rows), "must be in [0, 2^30]");
  if (int64_t(a.num_experts) * a.n >= (int64_t(1) << 31)) return bad("num_experts*n", std::to_string(int64_t(a.num_experts) * a.n), "must be < 2^31");
  if (a.layout == GroupedLayout::kMasked && int64_t(a.num_experts) * a.m_rows >= (int64_t(1) << 31))
    return bad("num_experts*max_m", std::to_string(int64_t(a.num_experts) * a.m_rows), "must be < 2^31");
  if (a.num_peer_d < 0 || a.num_peer_d > GroupedGemmArgs::kMaxPeerD)
    return bad("num_peer_d", std::to_string(a.num_peer_d), "must be in [0, 8]");
  const bool peers = a.num_peer_d > 0;
  if (peers) {
    if (a.epilogue != GemmEpilogue::kStoreBf16) return bad("num_peer_d", std::to_string(a.num_peer_d), "needs the store-bf16 epilogue");
    if (a.row_map == nullptr) return bad("row_map", "null", "required with peer_d (it names the peer of each row)");
    if (a.peer_d_rows <= 0) return bad("peer_d_rows", std::to_string(a.peer_d_rows), "must be > 0 with peer_d");
    for (int i = 0; i < a.num_peer_d; ++i)
      if (a.peer_d[i] == nullptr || !aligned(a.peer_d[i], 16))
        return bad("peer_d[" + std::to_string(i) + "]", a.peer_d[i] ? "unaligned" : "null", "must be a 16-byte aligned device pointer");
  }
  if (a.a == nullptr || a.b == nullptr || (a.d == nullptr && !peers)) return bad("a/b/d", "null", "device pointers required");
  if (!aligned(a.a, 16) || !aligned(a.b, 16)) return bad("a/b", "unaligned", "must be 16-byte aligned (TMA)");
  const int64_t lda = a.lda ? a.lda : a.k;
  if (lda < a.k || (lda * eb) % 16 != 0) return bad("lda", std::to_string(lda), "must be >= k with a row stride multiple of 16 bytes");
  if (a.layout == GroupedLayout::kContiguous && a.expert_offsets == nullptr) return bad("expert_offsets", "null", "required for the contiguous layout");
  if (a.layout == GroupedLayout::kMasked && a.masked_counts == nullptr) return bad("masked_counts", "null", "required for the masked layout");
  if (nvfp4 && (a.b_scales != nullptr || a.a_scales != nullptr))
    return bad(a.b_scales != nullptr ? "b_scales" : "a_scales", "set",
               "must be null with dtype nvfp4 (bf16 A; b is the weights' image, scales included)");
  if (fp8) {
    if (a.a_scales == nullptr || (a.b_scales == nullptr && !mxfp4))
      return bad("a_scales/b_scales", "null", "required for fp8-block");
    if (mxfp4 && a.b_scales != nullptr)
      return bad("b_scales", "set", "must be null with dtype mxfp4 (b is the weights' image, block scales included)");
    if (!aligned(a.a_scales, 16)) return bad("a_scales", "unaligned", "must be 16-byte aligned (TMA)");
    const int64_t ld = a.ld_a_scales ? a.ld_a_scales : round_up4(a.m_rows);
    if (ld < a.m_rows || ld % 4 != 0) return bad("ld_a_scales", std::to_string(ld), "must be >= m_rows and a multiple of 4");
  }
  const int64_t d_cols = swiglu ? a.n / 2 : a.n;
  const int64_t ldd = a.ldd ? a.ldd : d_cols;
  const int64_t d_eb = a.epilogue == GemmEpilogue::kSwigluFp8 ? 1 : 2;
  // The epilogues store 16-byte (bf16) / 8-byte (e4m3) segments per lane.
  if (ldd < d_cols || (ldd * d_eb) % 16 != 0)
    return bad("ldd", std::to_string(ldd), "must be >= the output columns with a row stride multiple of 16 bytes");
  if (!peers && !aligned(a.d, 16)) return bad("d", "unaligned", "must be 16-byte aligned");
  if (a.epilogue == GemmEpilogue::kSwigluFp8) {
    if (a.d_scales == nullptr) return bad("d_scales", "null", "required for swiglu-fp8");
    const int64_t ld = a.ld_d_scales ? a.ld_d_scales : round_up4(a.m_rows);
    if (ld < a.m_rows) return bad("ld_d_scales", std::to_string(ld), "must be >= m_rows");
  }
  const GemmTileConfig& t = a.tiles;
  if (t.block_m != 0 && t.block_m != 16 && t.block_m != 32 && t.block_m != 64 && t.block_m != 128)
    return bad("tiles.block_m", std::to_string(t.block_m), "must be 0, 16, 32, 64 or 128");
  if (t.block_n != 0 && t.block_n != 128 && t.block_n != 256) return bad("tiles.block_n", std::to_string(t.block_n), "must be 0, 128 or 256");
  if (t.block_n != 0 && a.n % t.block_n != 0) return bad("tiles.block_n", std::to_string(t.block_n), "must divide n");
  if (swiglu && t.block_n == 128) return bad("tiles.block_n", "128", "the SwiGLU epilogues need 256 (128 gate + 128 up)");
  if (t.num_sms < 0) return bad("tiles.num_sms", std::to_string(t.num_sms), "must be >= 0");
  if (t.cluster < 0 || t.cluster > 2) return bad("tiles.cluster", std::to_string(t.cluster), "must be 0, 1 or 2");
  if (t.cluster == 2 && a.dtype != GemmDtype::kFp8Block) return bad("tiles.cluster", "2", "clusters of 2 need dtype fp8-block");
  if (nvfp4) {
    if (a.n % 256 != 0) return bad("n", std::to_string(a.n), "must be a multiple of 256 with dtype nvfp4 (256-wide tiles)");
    if (t.block_m != 0 && t.block_m != 16 && t.block_m != 32)
      return bad("tiles.block_m", std::to_string(t.block_m), "dtype nvfp4 runs 16- or 32-row tiles");
    if (t.block_n != 0 && t.block_n != 256) return bad("tiles.block_n", std::to_string(t.block_n), "dtype nvfp4 runs 256-wide tiles");
    if (t.fp4_math_wg != 0 && t.fp4_math_wg != 2)
      return bad("tiles.fp4_math_wg", std::to_string(t.fp4_math_wg), "dtype nvfp4 runs two math warpgroups per tile (0 or 2)");
    if (t.ctas_per_sm != 0 && t.ctas_per_sm != 1)
      return bad("tiles.ctas_per_sm", std::to_string(t.ctas_per_sm), "dtype nvfp4 runs one CTA per SM (0 or 1)");
  }
  if (t.cluster == 2 && t.block_m != 0 && t.block_m != 128)
    return bad("tiles.cluster", "2", "clusters of 2 need 128-row tiles (tiles.block_m " + std::to_string(t.block_m) + ")");
  if (t.cluster == 2 && t.block_n == 128) return bad("tiles.cluster", "2", "clusters of 2 need 256-wide tiles");
  if (a.trace_max_tiles < 0) return bad("trace_max_tiles", std::to_string(a.trace_max_tiles), "must be >= 0");
  if (a.trace_max_tiles > 0 && a.trace == nullptr) return bad("trace", "null", "required with trace_max_tiles > 0");
  if (a.trace_max_tiles > 0 && !kGemmTraceBuilt)
    return bad("trace_max_tiles", std::to_string(a.trace_max_tiles),
               "the timeline needs the traced kernels (a build with MEGAMOE_GEMM_TRACE=ON, the default with the tool)");
  if (a.trace_max_tiles > 0 && !fp8) return bad("trace_max_tiles", std::to_string(a.trace_max_tiles), "the timeline is kept for dtype fp8-block only");
  if (int32_t(a.probe) < 0 || int32_t(a.probe) > int32_t(GemmProbe::kMathOnly))
    return bad("probe", std::to_string(int(a.probe)), "must be one of GemmProbe's values (0-4)");
  if (a.probe != GemmProbe::kNone && a.trace_max_tiles <= 0)
    return bad("probe", std::to_string(int(a.probe)), "needs the timeline (trace, trace_max_tiles > 0)");
  if ((t.block_m == 16 || t.block_m == 32) && !fp8 && !nvfp4)
    return bad("tiles.block_m", std::to_string(t.block_m), "16- and 32-row tiles need dtype fp8-block, mxfp4 or nvfp4");
  if (mxfp4) {
    if (a.n % 256 != 0) return bad("n", std::to_string(a.n), "must be a multiple of 256 with dtype mxfp4 (256-wide tiles)");
    if (t.block_m != 0 && t.block_m != 16 && t.block_m != 32 && t.block_m != 64)
      return bad("tiles.block_m", std::to_string(t.block_m), "dtype mxfp4 runs 16-, 32- or 64-row tiles");
    if (t.block_m == 64 && t.fp4_math_wg == 1)
      return bad("tiles.block_m", "64", "64-row mxfp4 tiles run two math warpgroups (tiles.fp4_math_wg 0 or 2, not 1)");
    if (t.block_n != 0 && t.block_n != 256) return bad("tiles.block_n", std::to_string(t.block_n), "dtype mxfp4 runs 256-wide tiles");
    if (t.cluster == 2) return bad("tiles.cluster", "2", "clusters of 2 need dtype fp8-block");
    if (t.fp4_math_wg < 0 || t.fp4_math_wg > 2)
      return bad("tiles.fp4_math_wg", std::to_string(t.fp4_math_wg),
                 "must be 0 (the default, " + std::to_string(kDefaultFp4MathWG) + "), 1 or 2 math warpgroups per tile");
    if (t.ctas_per_sm < 0 || t.ctas_per_sm > 2)
      return bad("tiles.ctas_per_sm", std::to_string(t.ctas_per_sm),
                 "must be 0 (the default, " + std::to_string(kDefaultFp4CtasPerSm) + "), 1 or 2 CTAs per SM");
  } else if (nvfp4) {
    // checked above
  } else if (t.fp4_math_wg != 0) {
    return bad("tiles.fp4_math_wg", std::to_string(t.fp4_math_wg),
               std::string("must be 0 with dtype ") + to_string(a.dtype) + " (math warpgroups of the mxfp4 tiles)");
  } else if (t.ctas_per_sm != 0) {
    return bad("tiles.ctas_per_sm", std::to_string(t.ctas_per_sm),
               std::string("must be 0 with dtype ") + to_string(a.dtype) + " (two CTAs per SM: mxfp4 16-row tiles)");
  }
  if (int32_t(a.dtype) < 0 || int32_t(a.dtype) > int32_t(GemmDtype::kNvfp4))
    return bad("dtype", std::to_string(int(a.dtype)), "must be fp8-block, bf16, mxfp4 or nvfp4");
  (void)fp4;
  return Status::ok();
}

Status plan_grouped_gemm(const GroupedGemmArgs& args, GroupedGemmPlan* plan) {
  MEGAMOE_RETURN_IF_ERROR(validate_grouped_gemm(args));
  DeviceInfo dev;
  MEGAMOE_RETURN_IF_ERROR(current_device(&dev));
  const bool mxfp4 = args.dtype == GemmDtype::kMxfp4;
  const bool nvfp4 = args.dtype == GemmDtype::kNvfp4;
  const bool fp8 = args.dtype == GemmDtype::kFp8Block || mxfp4;
  const bool masked = args.layout == GroupedLayout::kMasked;
  const bool swiglu = args.epilogue != GemmEpilogue::kStoreBf16;
  const int64_t eb = fp8 ? 1 : 2;

  GemmShapeHint hint;
  hint.m_per_expert = args.expected_m_per_expert > 0 ? args.expected_m_per_expert
                                                     : (masked ? args.m_rows : args.m_rows / args.num_experts);
  hint.num_experts = args.num_experts;
  hint.n = args.n;
  hint.k = args.k;
  hint.epilogue = args.epilogue;
  hint.fp8 = fp8;
  hint.num_sms = dev.sms;
  Knobs overrides;
  overrides.block_m = args.tiles.block_m;
  overrides.block_n = args.tiles.block_n;
  overrides.num_sms = args.tiles.num_sms;
  overrides.gemm_cluster = args.tiles.cluster;
  GemmTileConfig cfg = select_gemm_tiles(hint, &overrides);
  if (mxfp4) {  // the configurations compiled for mxfp4 weights (MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4)
    // More than 32 rows: 64-row tiles where two math warpgroups run (each expanded weight then
    // serves 64 tokens instead of 32: half the expansions and weight reads of a large expert).
    cfg.fp4_math_wg = args.tiles.fp4_math_wg != 0 ? args.tiles.fp4_math_wg : kDefaultFp4MathWG;
    cfg.block_m = select_mxfp4_block_m(hint.m_per_expert, args.tiles.block_m, cfg.fp4_math_wg);
    cfg.block_n = 256;
    cfg.cluster = 1;
    const int32_t cps = args.tiles.ctas_per_sm != 0 ? args.tiles.ctas_per_sm : kDefaultFp4CtasPerSm;
    cfg.ctas_per_sm = cfg.block_m == 16 && cfg.fp4_math_wg == 2 ? cps : 1;
  } else if (nvfp4) {  // MEGAMOE_GROUPED_GEMM_CONFIGS_NVFP4: 16 rows up to 16 per expert, else 32
    cfg.fp4_math_wg = 2;
    cfg.block_m = args.tiles.block_m != 0 ? args.tiles.block_m : hint.m_per_expert <= 16 ? 16 : 32;
    cfg.block_n = 256;
    cfg.cluster = 1;
    cfg.ctas_per_sm = 1;
  } else {
    cfg.fp4_math_wg = 0;
    cfg.ctas_per_sm = 0;
  }
  if (args.tile_order != GemmTileOrder::kAuto) cfg.round_robin = args.tile_order == GemmTileOrder::kRoundRobin;
  if (args.tile_counter == nullptr) cfg.round_robin = true;
  plan->tiles = cfg;
  plan->fp8 = fp8;
  plan->weight_fp4 = mxfp4 || nvfp4;
  plan->epilogue = args.epilogue;
  plan->empty = args.m_rows == 0;  // no rows: nothing to compute (masked max_m = 0 too)
  plan->grid = 0;
  if (plan->empty) return Status::ok();

  const int64_t lda = args.lda ? args.lda : args.k;
  const int64_t a_rows = masked ? int64_t(args.num_experts) * args.m_rows : args.m_rows;
  MEGAMOE_RETURN_IF_ERROR(make_map(&plan->tmap_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, args.a, uint64_t(args.k) * eb, a_rows,
                                   lda * eb, 128, cfg.block_m, true, "A"));
  // B boxes: the whole tile's rows, or half of them with clusters (each CTA of a pair loads one half).
  // FP4 weights load by bulk copies (no tensor map).
  if (mxfp4 || nvfp4)
    plan->tmap_b = plan->tmap_a;  // unused
  else
    MEGAMOE_RETURN_IF_ERROR(make_map(&plan->tmap_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, args.b, uint64_t(args.k) * eb,
                                     uint64_t(args.num_experts) * args.n, uint64_t(args.k) * eb, 128,
                                     cfg.block_n / cfg.cluster, true, "B"));
  const int64_t num_kb = args.k / 128;
  if (fp8) {
    const int64_t ld = args.ld_a_scales ? args.ld_a_scales : round_up4(args.m_rows);
    MEGAMOE_RETURN_IF_ERROR(make_map(&plan->tmap_sfa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, args.a_scales, args.m_rows,
                                     masked ? num_kb * args.num_experts : num_kb, ld * 4, cfg.block_m + 4, 1, false,
                                     "A scales"));
  } else {
    plan->tmap_sfa = plan->tmap_a;  // unused
  }
  // D for TMA stores: the plain store epilogue with identity rows (row r of A to row r of D).
  const bool tma_store = !swiglu && args.row_map == nullptr && args.num_peer_d == 0;
  plan->tmap_d = plan->tmap_a;  // unused unless tma_store
  if (tma_store)
    MEGAMOE_RETURN_IF_ERROR(make_map(&plan->tmap_d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, args.d, uint64_t(args.n), a_rows,
                                     uint64_t(args.ldd ? args.ldd : args.n) * 2, 64, 16, true, "D"));

  GroupedGemmParams& p = plan->params;
  p = GroupedGemmParams{};
  p.layout = args.layout;
  p.num_experts = args.num_experts;
  p.n = args.n;
  p.k = args.k;
  p.max_m = masked ? int32_t(args.m_rows) : 0;
  p.expert_offsets = args.expert_offsets;
  p.masked_counts = args.masked_counts;
  // mxfp4: the image starts with the block scales; the scaled bf16 SwiGLU: its per-expert scales
  // (bf16 tiles read no B scales)
  p.sfb = mxfp4 || nvfp4                                       ? static_cast<const float*>(args.b)
          : args.epilogue == GemmEpilogue::kSwigluBf16Scaled ? args.b_expert_scale
                                                               : args.b_scales;
  p.d = args.d;
  p.ld_d = args.ldd ? args.ldd : (swiglu ? args.n / 2 : args.n);
  p.row_map = args.row_map;
  p.row_weight = args.row_weight;
  for (int i = 0; i < args.num_peer_d; ++i) p.peer_d[i] = static_cast<__nv_bfloat16*>(args.peer_d[i]);
  p.num_peer_d = args.num_peer_d;
  p.peer_d_rows = args.peer_d_rows;
  p.sfd = args.d_scales;
  p.ld_sfd = args.ld_d_scales ? args.ld_d_scales : round_up4(args.m_rows);
  p.sfd_expert_stride = masked ? int64_t(args.n / 256) * p.ld_sfd : 0;
  p.pow2_scales = args.pow2_scales ? 1 : 0;
  p.tile_counter = cfg.round_robin ? nullptr : args.tile_counter;
  p.tma_store = tma_store ? 1 : 0;
  p.b_evict_first = args.weights_evict_first ? 1 : 0;
  p.trace = args.trace_max_tiles > 0 ? args.trace : nullptr;
  p.trace_max_tiles = args.trace_max_tiles;
  p.probe = p.trace != nullptr ? int32_t(args.probe) : 0;

  // Persistent grid: all SMs (times the CTAs per SM), fewer when the contiguous pool cannot have that many tiles.
  int64_t grid = (cfg.num_sms > 0 ? std::min(cfg.num_sms, dev.sms) : dev.sms) * std::max(cfg.ctas_per_sm, 1);
  if (!masked) {
    const int64_t max_tiles = (args.m_rows / cfg.block_m + args.num_experts) * (args.n / cfg.block_n);
    grid = std::min(grid, std::max<int64_t>(max_tiles, 1));
  }
  if (cfg.cluster > 1) grid = std::max<int64_t>(cfg.cluster, grid - grid % cfg.cluster);  // whole clusters
  plan->grid = int(grid);
  return Status::ok();
}

Status launch_grouped_gemm_plan(const GroupedGemmPlan& plan, cudaStream_t stream, GemmTileConfig* used,
                                const char* what) {
  if (used) *used = plan.tiles;
  if (plan.empty) return Status::ok();
  const GemmTileConfig& cfg = plan.tiles;
  const GroupedGemmParams& p = plan.params;
  const bool fp8 = plan.fp8;
  const bool w4 = plan.weight_fp4;
  const GemmEpilogue p_epi = plan.epilogue;
  // An error an earlier asynchronous operation left pending would be returned by the launch's check
  // below and read as the GEMM's: report it as what it is.
  const cudaError_t pending = cudaGetLastError();
  if (pending != cudaSuccess)
    return Status(StatusCode::kCudaError, std::string("a CUDA error was pending before the grouped GEMM launch (from an "
                                                      "earlier asynchronous operation on this thread or device, not "
                                                      "from the GEMM): ") +
                                              cudaGetErrorName(pending) + " (" + cudaGetErrorString(pending) + ")");
  cudaError_t err = cudaErrorInvalidConfiguration;
  int launched = 0;
#define MEGAMOE_DISPATCH(BM, BN, FP8, EPI, CL)                                                                  \
  if (!w4 && cfg.block_m == BM && cfg.block_n == BN && fp8 == FP8 && p_epi == EPI && cfg.cluster == CL)         \
    err = launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL>>(plan.tmap_a, plan.tmap_b, plan.tmap_sfa, \
                                                                         plan.tmap_d, p, plan.grid, stream, &launched);
#define MEGAMOE_DISPATCH_FP4(BM, BN, FP8, EPI, CL, W4, WG, CPS)                                                 \
  if (w4 && cfg.block_m == BM && cfg.block_n == BN && fp8 == FP8 && p_epi == EPI && cfg.fp4_math_wg == WG &&     \
      cfg.ctas_per_sm == CPS)                                                                                    \
    err = launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL, W4, WG, CPS>>(                      \
        plan.tmap_a, plan.tmap_b, plan.tmap_sfa, plan.tmap_d, p, plan.grid, stream, &launched);
  MEGAMOE_GROUPED_GEMM_CONFIGS_FP8(MEGAMOE_DISPATCH)
  MEGAMOE_GROUPED_GEMM_CONFIGS_BF16(MEGAMOE_DISPATCH)
  MEGAMOE_GROUPED_GEMM_CONFIGS_BF16_SCALED(MEGAMOE_DISPATCH)
  MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4(MEGAMOE_DISPATCH_FP4)
  MEGAMOE_GROUPED_GEMM_CONFIGS_NVFP4(MEGAMOE_DISPATCH_FP4)
#undef MEGAMOE_DISPATCH
#undef MEGAMOE_DISPATCH_FP4
  if (used != nullptr) used->grid = launched;
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError, std::string("grouped GEMM launch failed: ") + cudaGetErrorString(err) + " (" +
                                              (what ? what : "planned launch") + ", " + cfg.to_string() + ")");
  return Status::ok();
}

Status planned_gemm_tiles(const GroupedGemmArgs& args, GemmTileConfig* out) {
  GroupedGemmPlan plan;
  MEGAMOE_RETURN_IF_ERROR(plan_grouped_gemm(args, &plan));
  *out = plan.tiles;
  return Status::ok();
}

Status launch_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, GemmTileConfig* used) {
  GroupedGemmPlan plan;
  MEGAMOE_RETURN_IF_ERROR(plan_grouped_gemm(args, &plan));
  const Status st = launch_grouped_gemm_plan(plan, stream, used);
  if (st.is_ok()) return st;
  return Status(st.code(), st.message() + " (" + args.to_string() + ")");
}

}  // namespace megamoe::gemm
