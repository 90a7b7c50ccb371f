// sm90_fp8_grouped_gemm.h — host API of the Hopper (sm_90a) grouped GEMM for the experts.
//
// One call computes, for every local expert e, D[rows of e] = epilogue(A[rows of e] * B[e]^T) with
// K the reduction dimension of both operands. Device pointers only; launches on `stream`; never
// synchronises the host; safe inside CUDA-graph capture (no allocation, no host reads of device data).
//
//   dtype kFp8Block: A e4m3 with fp32 1x128 scales, B e4m3 with fp32 128x128 scales (DeepSeek-V3);
//                    scales may be any positive fp32, power-of-two ones included.
//   dtype kBf16:     A and B bf16, no scales.
//   dtype kMxfp4:    A e4m3 with fp32 1x128 scales (as kFp8Block); B mxfp4 as gemm_weights.h's
//                    Mxfp4GemmWeights lays it out: b = its device image (device_image(): the block
//                    scales, then the pieces), b_scales unused (null). Swapped 16- and 32-row tiles,
//                    256 wide, only (n a multiple of 256), with one or two math warpgroups per tile
//                    (tiles.fp4_math_wg); the values are fmt::mxfp4_to_fp8_128x128's.
//   dtype kNvfp4:    A bf16 (as kBf16); B nvfp4 as gemm_weights.h's Nvfp4GemmWeights lays it out: b =
//                    its device image (the per-expert global scales, then the pieces), b_scales and
//                    b_expert_scale unused (null). Swapped 16- and 32-row tiles, 256 wide, two math
//                    warpgroups; the weights expand in the pipeline to expand_nvfp4_to_bf16's values
//                    (exact), the global scale is applied by kSwigluBf16Scaled (from the image) and
//                    left to the caller with kStoreBf16 (row_weight).
//
// Grouped M layouts (see grouped_scheduler.h):
//   kContiguous  A [m_rows, K]; expert e owns rows [expert_offsets[e], expert_offsets[e+1]) (device
//                int32 [E+1]; as dispatch writes the pool, segments padded to its BLOCK_M). The A
//                scales are M-major: a_scales[kb * ld_a_scales + row], ld_a_scales >= m_rows and a
//                multiple of 4.
//   kMasked      A [E, max_m, K] (m_rows = max_m); expert e owns its first masked_counts[e] rows
//                (device int32 [E]). A scales a_scales[(e * K/128 + kb) * ld_a_scales + m],
//                ld_a_scales >= max_m, multiple of 4.
// B is [E, N, K] row-major; B scales [E, N/128, K/128] fp32.
//
// Epilogues:
//   kStoreBf16   D bf16: row r of A goes to D[row_map ? row_map[r] : r] (row_map < 0: dropped),
//                times row_weight[r] when given (fp32, before the bf16 rounding). Masked: D rows
//                are e * max_m + m like A's. With num_peer_d > 0 the rows go to several buffers
//                (each rank's combine region through its LSA pointer): row_map[r] = peer *
//                peer_d_rows + row names row `row` (stride ldd) of peer_d[peer]; d is unused.
//   kSwigluFp8   B is the prepared w13 (gemm_weights.h: per 256 rows, 128 gate rows then the 128
//                up rows of the same intermediate columns); N = 2I. D = h [rows, I] e4m3 with 1x128
//                scales written M-major like A's (d_scales[kb * ld_d_scales + row], masked
//                d_scales[(e * I/128 + kb) * ld_d_scales + m]), so FC2 consumes D and d_scales as its
//                A and a_scales directly. Rounding: formats.h (fp8_block_scale, float_to_e4m3).
//   kSwigluBf16  the same, h as bf16.
//   kSwigluBf16Scaled  kSwigluBf16 with both accumulators of expert e multiplied by b_expert_scale[e]
//                (fp32, device [num_experts]) before the SwiGLU: h = silu(s * gate) * (s * up). For
//                weights whose per-expert global scale stays out of B (nvfp4 expanded to bf16,
//                docs/GEMM.md "nvfp4, the first step"). Its own instantiations, so kSwigluBf16's
//                kernels are untouched. dtype bf16 only. Not yet run on a GPU.
// Rows of a segment past its end and padding rows inside the last tile are never stored.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/gemm/grouped_scheduler.h"
#include "megamoe/status.h"

namespace megamoe::gemm {

enum class GemmDtype { kFp8Block, kBf16, kMxfp4, kNvfp4 };
// GroupedLayout: grouped_scheduler.h (host and device).
// The epilogue, as the host API names it and as the kernel's template parameter (GroupedGemmConfig).
enum class GemmEpilogue : int32_t {
  kStoreBf16 = 0,   // D bf16 rows (optionally weighted, optionally routed through row_map)
  kSwigluFp8 = 1,   // h = silu(gate) * up, requantised to e4m3 with 1x128 fp32 scales
  kSwigluBf16 = 2,  // h = silu(gate) * up as bf16
  kSwigluBf16Scaled = 3,  // h = silu(s_e * gate) * (s_e * up) as bf16, s_e = b_expert_scale[e]
};

const char* to_string(GemmDtype d);
const char* to_string(GroupedLayout l);
const char* to_string(GemmEpilogue e);

// Tile configuration. 0 = chosen by select_gemm_tiles() (gemm_heuristic.h).
struct GemmTileConfig {
  int32_t block_m = 0;  // 16, 32, 64 or 128 rows per tile (16-64: one math warpgroup, 128: two; 16
                        // and 32: fp8 only, the operands swapped)
  int32_t block_n = 0;  // 128 or 256 (SwiGLU: 256 = 128 gate + 128 up)
  int32_t num_sms = 0;  // persistent CTAs; 0 = all SMs
  bool round_robin = false;  // tiles i, i + grid, ... per CTA instead of from the tile counter
  // CTAs per cluster: 2 = pairs of CTAs running adjacent m-blocks of one weight tile, each loading half
  // of it for both (TMA multicast; fp8, 128 x 256 tiles only); 1 = none; 0 = the heuristic's choice.
  int32_t cluster = 0;
  // dtype mxfp4: math warpgroups per tile, 1 or 2 (two: each expands and multiplies half of every
  // weight tile, docs/GEMM.md "FP4 weights"); 0 = kDefaultFp4MathWG. Other dtypes: 0 (as `used`, too).
  int32_t fp4_math_wg = 0;
  // dtype mxfp4: CTAs per SM, 1 or 2, for the 16-row tiles of two math warpgroups (two: each CTA holds
  // half of the SM's registers and shared memory, the SM runs two tiles at once); other tiles (32 or 64
  // rows, one math warpgroup) run one whatever it says. 0 = kDefaultFp4CtasPerSm. Other dtypes: 0.
  // `used`: what ran (1 or 2 with dtype mxfp4).
  int32_t ctas_per_sm = 0;
  int32_t grid = 0;  // output (launch_grouped_gemm's `used`): the CTAs launched
  std::string to_string() const;
};

// The mxfp4 GEMM's math warpgroups per tile where GemmTileConfig::fp4_math_wg leaves it to the GEMM.
constexpr int32_t kDefaultFp4MathWG = 2;
// The CTAs per SM of the mxfp4 16-row tiles where GemmTileConfig::ctas_per_sm leaves it to the GEMM.
constexpr int32_t kDefaultFp4CtasPerSm = 1;

// Timeline words (GroupedGemmArgs::trace): a header per CTA, then one record per tile id.
constexpr int kTraceWordsHeader = 4;
constexpr int kTraceWordsPerTile = 6;

// Bench probes (GroupedGemmArgs::probe): the math warpgroups skip their MMAs and epilogue (kStream: the
// weight stream alone) or the epilogue (kNoEpilogue); or the producer issues no copies and only marks
// each ring slot full, so the math runs on whatever the slots hold (kNoLoads: the MMAs and epilogue
// without the memory system's loads; kMathOnly: the K loops alone). Results are not computed.
enum class GemmProbe : int32_t { kNone = 0, kStream = 1, kNoEpilogue = 2, kNoLoads = 3, kMathOnly = 4 };

// Order in which the persistent CTAs take tiles: the heuristic's choice (GemmTileConfig::round_robin),
// from the tile counter (needs GroupedGemmArgs::tile_counter), or round-robin.
enum class GemmTileOrder { kAuto, kCounter, kRoundRobin };

struct GroupedGemmArgs {
  GemmDtype dtype = GemmDtype::kFp8Block;
  GroupedLayout layout = GroupedLayout::kContiguous;
  GemmEpilogue epilogue = GemmEpilogue::kStoreBf16;
  int32_t num_experts = 0;
  int32_t n = 0;  // rows of each B[e] (2I for SwiGLU); multiple of 128 (SwiGLU: 256)
  int32_t k = 0;  // multiple of 128
  // A
  const void* a = nullptr;
  int64_t lda = 0;      // elements; 0 = k
  int64_t m_rows = 0;   // contiguous: rows of A (the pool); masked: max_m
  const float* a_scales = nullptr;
  int64_t ld_a_scales = 0;  // 0 = m_rows rounded up to 4
  const int32_t* expert_offsets = nullptr;  // contiguous
  const int32_t* masked_counts = nullptr;   // masked
  // B
  const void* b = nullptr;
  const float* b_scales = nullptr;
  const float* b_expert_scale = nullptr;  // kSwigluBf16Scaled only: fp32 [num_experts]; null otherwise
  // D
  void* d = nullptr;
  int64_t ldd = 0;  // elements; 0 = n (kStoreBf16) or n/2 (SwiGLU)
  float* d_scales = nullptr;  // kSwigluFp8
  int64_t ld_d_scales = 0;    // 0 = m_rows rounded up to 4
  const int32_t* row_map = nullptr;   // kStoreBf16
  const float* row_weight = nullptr;  // kStoreBf16
  static constexpr int kMaxPeerD = 8;
  void* peer_d[kMaxPeerD] = {};       // kStoreBf16 into several buffers (see above)
  int32_t num_peer_d = 0;
  int32_t peer_d_rows = 0;
  bool pow2_scales = false;           // kSwigluFp8 output scales
  // Dynamic tile scheduling (recommended): device int32 [2], zeroed once before the first launch;
  // every launch leaves it zero again. CTAs then take tiles in order from it, so the CTAs that share
  // a weight tile or an A block run together and read it from DRAM once (with static round-robin
  // they drift apart over a long launch and re-read it). Launches that share one must be ordered
  // (one stream). null: static round-robin.
  int32_t* tile_counter = nullptr;
  GemmTileOrder tile_order = GemmTileOrder::kAuto;  // round-robin whatever it says when tile_counter is null
  // true: weight tiles of experts with at most BLOCK_M rows (each read by one tile only: decode) load
  // with L2 evict-first, so streaming them does not evict what L2 holds. Off by default: 3-7% faster on
  // qwen3-30b-a3b decode after a dirty L2, 3-8% slower on deepseek-v3's (docs/perf-history/gemm.md,
  // session 11).
  bool weights_evict_first = false;
  // Timeline for bench tools (null: off): device uint64 [grid * kTraceWordsHeader + trace_max_tiles *
  // kTraceWordsPerTile], %globaltimer ns, zeroed by the caller; layout at GroupedGemmParams::trace
  // (sm90_fp8_grouped_gemm.cuh).
  uint64_t* trace = nullptr;
  int32_t trace_max_tiles = 0;
  // With the timeline only: what the math warpgroups skip, to show where the time goes (the output is
  // then NOT computed).
  GemmProbe probe = GemmProbe::kNone;
  // Tiles: 0 fields from the heuristic, with expected_m_per_expert as its bucket hint (0: derived
  // from m_rows / num_experts).
  GemmTileConfig tiles;
  int64_t expected_m_per_expert = 0;

  std::string to_string() const;
};

// Checks the arguments (shape rules, alignment, nulls) without launching. Messages name the field.
Status validate_grouped_gemm(const GroupedGemmArgs& args);

// The tile configuration launch_grouped_gemm() would run for `args` on the current device (the
// heuristic's choice for the bucket hint, with the overrides applied), without launching (host code;
// plan_grouped_gemm in sm90_gemm_plan.cuh is the whole plan).
Status planned_gemm_tiles(const GroupedGemmArgs& args, GemmTileConfig* out);

// Launches the grouped GEMM on `stream`. Returns kInvalidArgument for bad arguments, kUnavailable
// when the current device is not sm_90, kCudaError when the launch fails (an error an earlier
// asynchronous operation left pending is reported as that, before the launch, not blamed on it).
// *used (optional) receives the tile configuration that ran.
Status launch_grouped_gemm(const GroupedGemmArgs& args, cudaStream_t stream, GemmTileConfig* used = nullptr);

}  // namespace megamoe::gemm
