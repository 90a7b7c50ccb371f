// sm90_gemm_config.cuh — the grouped GEMM's configuration, kernel parameters, shared-memory carve, ring
// position, scheduler tables and barrier setup (device building blocks; see sm90_fp8_grouped_gemm.cuh).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/grouped_scheduler.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "kernels/gemm/sm90_gemm_ptx.cuh"
#include "megamoe/formats.h"

namespace megamoe::gemm {

// The kernel's parameter block: GroupedGemmArgs (the host API: defaults, choices left to the
// heuristic) resolved by plan_grouped_gemm into what the device code reads besides the tensor maps.
struct GroupedGemmParams {
  GroupedLayout layout;
  int32_t num_experts;
  int32_t n;            // columns of B per expert (2I for the SwiGLU epilogues)
  int32_t k;            // reduction length in elements, multiple of 128 (fp8) / 64 (bf16)
  int32_t max_m;        // masked: rows per expert in A
  const int32_t* expert_offsets;  // contiguous: [E + 1]
  const int32_t* masked_counts;   // masked: [E]
  const float* sfb;     // fp8: [E, N/128, K/128]; kSwigluBf16Scaled (bf16, no B scales): the
                        // per-expert scale [E] (GroupedGemmArgs::b_expert_scale)
  // epilogue
  void* d;              // bf16 [*, ld_d] or e4m3 [*, ld_d]
  int64_t ld_d;         // elements
  const int32_t* row_map;    // kStoreBf16: A row -> D row (< 0: not stored); null: identity
  const float* row_weight;   // kStoreBf16: per A row factor applied in fp32; null: 1
  __nv_bfloat16* peer_d[8];  // kStoreBf16 with num_peer_d > 0: row_map = peer * peer_d_rows + row
  int32_t num_peer_d;
  int32_t peer_d_rows;
  float* sfd;                // kSwigluFp8: output scales, M-major like SFA
  int64_t ld_sfd;            // row stride of SFD (>= rows)
  int64_t sfd_expert_stride; // masked: (N/256) * ld_sfd; contiguous: 0
  int32_t pow2_scales;       // kSwigluFp8: power-of-two output scales
  // Dynamic tile scheduling: int32 [2] = {next tile, CTAs done}, zero before the launch and zero
  // again after it (the last CTA to finish resets it). null: static round-robin (CTA i runs tiles
  // i, i + grid, ...).
  int32_t* tile_counter;
  // kStoreBf16 with identity rows (no row_map, no peer buffers): the kernel's tmap_d describes D
  // and full 16-row slabs go out as TMA tensor stores (epilogue_store_bf16).
  int32_t tma_store;
  // 1: the weight tiles of experts with at most BLOCK_M rows load with L2 evict-first (each is read by
  // one tile only, so streaming it should not evict what L2 keeps for later); 0: default policy.
  int32_t b_evict_first;
  // Timeline for bench tools (null: off), %globaltimer ns: [grid][kTraceWordsHeader] per CTA (start,
  // scheduler tables built, producer done, math done), then [trace_max_tiles][kTraceWordsPerTile] per
  // tile id (CTA + 1, producer claimed it, issued its last K block, math saw its first K block,
  // finished its K loop, finished its epilogue); tiles from trace_max_tiles on are not stamped.
  // Only the kernel's kTrace instantiation (fp8) reads it.
  uint64_t* trace;
  int32_t trace_max_tiles;
  // Probe (kTrace kernel only, bench tools; the output is not computed): 1 = the math warpgroups only
  // wait for each K block and release it (no MMA, no epilogue: the weight stream alone), 2 = no
  // epilogue, 3 = no loads (the producer only marks each slot full), 4 = no loads and no epilogue.
  // 0 = off.
  int32_t probe;
};

// mxfp4 weights (Cfg::kWeightFp4): sfb points at the device image of gemm_weights.h's
// Mxfp4GemmWeights, the block scales first, the pieces from mxfp4_pieces_offset() on.
__device__ __forceinline__ const uint8_t* mxfp4_pieces(const GroupedGemmParams& p) {
  return reinterpret_cast<const uint8_t*>(p.sfb) + mxfp4_pieces_offset(p.num_experts, p.n, p.k);
}
// nvfp4 weights: sfb points at the device image of Nvfp4GemmWeights, the per-expert global scales first
// (what the scaled SwiGLU epilogue reads as sfb[expert]), the pieces from nvfp4_pieces_offset() on.
__device__ __forceinline__ const uint8_t* nvfp4_pieces(const GroupedGemmParams& p) {
  return reinterpret_cast<const uint8_t*>(p.sfb) + nvfp4_pieces_offset(p.num_experts);
}

template <int kBlockM_, int kBlockN_, bool kFp8_, GemmEpilogue kEpilogue_, int kCluster_ = 1, bool kWeightFp4_ = false,
          int kFp4MathWG_ = 1, int kCtasPerSm_ = 1>
struct GroupedGemmConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kFp8 = kFp8_;
  static constexpr GemmEpilogue kEpilogue = kEpilogue_;
  // mxfp4 weights (swapped 16-, 32- and 64-row tiles, 256 wide): the weight slot holds the tile's
  // BLOCK_N / 64 pieces of gemm_weights.h's layout (e2m1 codes in register-fragment order + shift
  // indices), loaded by one bulk copy; the math warpgroup expands them into wgmma's A registers
  // (math_k_block_swapped_fp4) and applies the 128 x 128 block scales as fp8-block's sb. The A
  // side (tokens e4m3 + 1x128 scales) is fp8-block's.
  static constexpr bool kWeightFp4 = kWeightFp4_;
  // FP4 weights with bf16 tokens (kFp8 false) are nvfp4 (gemm_weights.h's Nvfp4GemmWeights): the same
  // swapped tiles, with bf16 wgmma (k16) on A registers of e2m1 x e4m3 block scale (exact in bf16), K
  // blocks of 128 (the A slot two bf16 boxes of 64 columns), no scales per K block (the accumulators run
  // over the whole K).
  static constexpr bool kWeightMxfp4 = kWeightFp4 && kFp8;
  static constexpr bool kWeightNvfp4 = kWeightFp4 && !kFp8;
  // mxfp4 weights: math warpgroups per tile, 1 or 2. Two: warpgroup w expands and multiplies half w
  // of every 128-row chunk (slabs w and 2 + w of the weight slot: 64 gate rows and their 64 up rows in
  // the SwiGLU order), so each expands half the codes and issues half the wgmmas of a K block; both
  // read the same token tile and release every slot (the empty barrier counts all math warps).
  static constexpr int kFp4MathWG = kFp4MathWG_;
  // CTAs resident per SM, 1 or 2 (mxfp4 16-row tiles only). Two: each CTA gets half of the SM's
  // registers and shared memory, so an SM runs four math warpgroups on two tiles whose K loops (the
  // expansion's serial chain of shared-memory loads, expansion, wgmma issue and wait) do not line
  // up, and an SM whose CTA ran out of tiles still has the other's at work in the last wave.
  static constexpr int kCtasPerSm = kCtasPerSm_;
  // CTAs per cluster. 2: the pair of CTAs runs tiles 2u and 2u + 1 of the schedule at once (pair
  // tile u); when both are the same expert's n-block (two m-blocks sharing one weight tile) each CTA
  // loads half of the weight tile and multicasts it to both, so L2 sends each weight byte once per
  // pair (see "clusters" below).
  static constexpr int kCluster = kCluster_;
  static constexpr int kBHalfRows = kBlockN / kCluster;  // weight rows one CTA loads per K block (shared tile)
  static constexpr int kBlockKBytes = 128;            // one 128-byte swizzle row per tile row
  // elements per K block (nvfp4: 128 bf16 tokens, two 128-byte swizzle rows per token row)
  static constexpr int kBlockK = kFp8 || kWeightNvfp4 ? 128 : 64;
  static constexpr int kASubTiles = kBlockK * (kFp8 ? 1 : 2) / kBlockKBytes;  // 128-byte-wide A boxes per K block
  // BLOCK_M 16 or 32 (decode, fp8; bf16 rows or the SwiGLU + fp8 requant out): operands swapped. The
  // weights are wgmma's A (M = the tile's BLOCK_N weight rows in m64 halves), the BLOCK_M tokens its B
  // (N = 16 or 32): 16 / 32 MACs per weight byte instead of the 64 an m64 tile of 1-32 real rows
  // costs. One math warpgroup (mxfp4 weights: kFp4MathWG); 2 / 4 KiB A slots.
  // mxfp4 weights run 64-row tiles swapped too (two math warpgroups, N = 64 tokens): the weights stay
  // wgmma's register operand (the expansion's output), each expanded weight now serving 64 tokens.
  static constexpr bool kSwapAB = kBlockM <= 32 || (kWeightFp4 && kBlockM == 64);
  static constexpr int kNumMathWG = kBlockM <= 64 ? (kWeightFp4 ? kFp4MathWG : 1) : kBlockM / 64;
  static constexpr int kNumChunks = kBlockN / 128;
  // Swapped tiles: the m64 halves of each chunk one math warpgroup computes (2 / kNumMathWG; warpgroup
  // w's half h is the chunk's half w * kSwapHalves + h).
  static constexpr int kSwapHalves = kSwapAB ? 2 / kNumMathWG : 2;
  static constexpr int kNumThreads = 128 * (kNumMathWG + 1);
  static constexpr int kMathThreads = 128 * kNumMathWG;
  static constexpr int kStageA = kBlockM * kBlockKBytes * kASubTiles;
  static constexpr int kStageB = kWeightMxfp4   ? int(kBlockN / kFp4SlabRows * kFp4SlabBytes)
                                 : kWeightNvfp4 ? int(kBlockN / 64 * kNvfp4SlabBytes)
                                                : kBlockN * kBlockKBytes;
  static constexpr int64_t kPieceBytes = kWeightMxfp4 ? kFp4SlabBytes : kNvfp4SlabBytes;  // FP4: one 64-row slab
  // A scales: a box of BLOCK_M + 4 fp32 starting at the tile's first row rounded down to 4 (a 16-byte
  // aligned start in global memory, whatever the segment offset); slots 128-byte aligned for TMA.
  static constexpr int kSfaBox = kBlockM + 4;
  static constexpr int kSfaStride = kFp8 ? (kSfaBox * 4 + 127) / 128 * 32 : 0;  // floats per slot
  static constexpr int kStageSFA = kSfaStride * 4;
  static constexpr int kStageSFB = 16;
  static constexpr int kStageBytes = kStageA + kStageB + kStageSFA + kStageSFB + 16 + 32;  // + 2 barriers + tile record
  // kWeightFp4: the shift table, 8 e4m3 magnitudes for each shift in [kMxfp4MinShift, 6].
  static constexpr int kFp4TableRows = 6 - fmt::kMxfp4MinShift + 1;
  static constexpr int kFp4TableBytes = kWeightMxfp4 ? kFp4TableRows * 8 : 0;
  static constexpr int kClaimBytes = kCluster > 1 ? 2 * 16 + 2 * 4 : 0;  // 2 x {claim_full, claim_empty} + 2 values
  // bf16-store epilogue staging: per math warp 16 rows x 64 columns of bf16 (2 KiB), see
  // epilogue_store_bf16; swapped: the tile's BLOCK_M token rows of BLOCK_N bf16.
  // Swapped SwiGLU: BLOCK_M token rows of 128 e4m3 codes + the math warps' per-token amax; bf16 out
  // (nvfp4): BLOCK_M token rows of 128 bf16.
  static constexpr int kStageOut = kEpilogue == GemmEpilogue::kStoreBf16
                                       ? (kSwapAB ? kBlockM * kBlockN * 2 : kNumMathWG * 4 * 2048)
                                   : kSwapAB ? (kFp8 ? kBlockM * 128 + kNumMathWG * 4 * kBlockM * 4 : kBlockM * 256)
                                             : 0;
  // Per CTA: the 227 KiB a CTA may hold with one per SM; with two, half of the SM's 228 KiB less the
  // 1 KiB the hardware reserves per CTA.
  static constexpr int kSmemPerCta = kCtasPerSm == 1 ? 227 * 1024 : 228 * 1024 / kCtasPerSm - 1024;
  static constexpr int kSmemBudget =
      kSmemPerCta - 1024 /* alignment slack */ - 8 * 1024 /* tables */ - kStageOut - kClaimBytes - kFp4TableBytes;
  static_assert(kStageOut % 128 == 0, "the A-scale slots after the staging are TMA destinations");
  static constexpr int kStagesFit = kSmemBudget / kStageBytes;
  static constexpr int kStages = kStagesFit > 12 ? 12 : kStagesFit;
  static constexpr uint32_t kTxBytes = kStageA + kStageB + (kFp8 ? kSfaBox * 4 : 0);
  static constexpr int kMaxExperts = 512;
  // setmaxnreg budgets. The warpgroups trade registers within what the CTA holds at launch
  // (__launch_bounds__(kNumThreads, 1): kLaunchRegs per thread, 168 with three warpgroups): a
  // setmaxnreg.inc past what the decs freed would wait forever. One math warpgroup: 96 / 256. Two on
  // 128-row tiles: the producer shrinks to 56 (the tile counter's loop spilled at 48), the math grows to
  // 224. Two on mxfp4 tiles: the bulk-copy producer spills at 56, so 88; each math warpgroup holds half
  // the A registers and accumulators of the tile, 208 leave it room.
  // Two CTAs per SM (384 threads each): 80 registers per thread at launch; the producer gives 40 back
  // and the math warpgroups (16 tokens, half a tile's A registers and accumulators each) take 96.
  static constexpr uint32_t kLaunchRegs = (65536 / (kNumThreads * kCtasPerSm)) / 8 * 8 > 256
                                              ? 256
                                              : (65536 / (kNumThreads * kCtasPerSm)) / 8 * 8;
  static constexpr uint32_t kProducerRegs = kCtasPerSm == 2 ? 40 : kNumMathWG == 1 ? 96 : kWeightFp4 ? 88 : 56;
  static constexpr uint32_t kMathRegs = kCtasPerSm == 2    ? 96
                                        : kNumMathWG == 1 ? 256
                                        : kWeightFp4      ? 208
                                                          : 224;  // scheduler tables: 3 * (E + 1) int32 <= 8 KiB
  static_assert(128 * kProducerRegs + kMathThreads * kMathRegs <= kNumThreads * kLaunchRegs,
                "setmaxnreg budgets fit the registers the CTA launches with");
  static_assert(kBlockM == 16 || kBlockM == 32 || kBlockM == 64 || kBlockM == 128, "BLOCK_M is 16, 32, 64 or 128");
  static_assert(kEpilogue != GemmEpilogue::kSwigluBf16Scaled || !kFp8, "the scaled SwiGLU epilogue: bf16");
  static_assert(!kSwapAB || (kFp8 && (kEpilogue == GemmEpilogue::kStoreBf16 || kEpilogue == GemmEpilogue::kSwigluFp8)) ||
                    (kWeightNvfp4 && (kEpilogue == GemmEpilogue::kStoreBf16 || kEpilogue == GemmEpilogue::kSwigluBf16Scaled)),
                "16- and 32-row tiles: fp8 (bf16 rows or SwiGLU + fp8 out) or nvfp4 (bf16 rows or the scaled bf16 SwiGLU)");
  static_assert(kBlockN == 128 || kBlockN == 256, "BLOCK_N is 128 or 256");
  static_assert(kEpilogue == GemmEpilogue::kStoreBf16 || kBlockN == 256, "SwiGLU tiles hold 128 gate + 128 up columns");
  static_assert(kStages >= 3, "pipeline too shallow");
  static_assert(kCluster == 1 || (kCluster == 2 && kFp8 && kBlockM == 128 && !kSwapAB),
                "clusters of 2: fp8 tiles of 128 rows");
  static_assert(!kWeightFp4 || (kSwapAB && kBlockN == 256 && kCluster == 1),
                "FP4 weights: swapped 16-, 32- and 64-row tiles, 256 wide, no clusters");
  static_assert(!kWeightNvfp4 || (kBlockM <= 32 && kCtasPerSm == 1), "nvfp4 weights: 16- and 32-row tiles, one CTA per SM");
  static_assert(!kWeightFp4 || kBlockM <= 32 || kFp4MathWG == 2,
                "mxfp4 64-row tiles: two math warpgroups (one would hold 2 x 128 accumulators + 64 A registers)");
  static_assert(kFp4MathWG == 1 || (kFp4MathWG == 2 && kWeightFp4), "two math warpgroups per tile: FP4 weights");
  static_assert(!kSwapAB || kSwapHalves * kNumMathWG == 2, "the swapped chunk's two halves split over the math warpgroups");
  static_assert(kCtasPerSm == 1 || (kCtasPerSm == 2 && kWeightMxfp4 && kBlockM == 16 && kFp4MathWG == 2),
                "two CTAs per SM: mxfp4 16-row tiles with two math warpgroups");
  static_assert(kStageB % 1024 == 0, "the weight and staging slots after B stay 1024-aligned");

  // Dynamic shared memory: 1 KiB alignment slack + ring + barriers + tables.
  static constexpr int smem_bytes(int num_experts) {
    return 1024 + kStages * (kStageA + kStageB + kStageSFA + kStageSFB) + kStageOut + kStages * 16 + kStages * 32 +
           kClaimBytes + kFp4TableBytes + 3 * (num_experts + 1) * 4 + 16;
  }
};

// The carved shared memory of one CTA.
template <class Cfg>
struct GroupedGemmSmem {
  uint8_t* a;       // [kStages][kStageA], 1024-aligned
  uint8_t* b;       // [kStages][kStageB], 1024-aligned
  float* sfa;       // [kStages][kSfaStride]
  float* sfb;       // [kStages][4]
  uint8_t* out;     // [math warps][16 rows][128 B] bf16-store epilogue staging (1024-aligned)
  uint64_t* full;   // [kStages]
  uint64_t* empty;  // [kStages]
  // [kStages][2]: the tile whose first K block the slot holds, as the producer resolved it: {id, expert,
  // n_block, row0}, {m0, rows, -, -}; id -1: no more tiles. The math warpgroups read it rather than
  // search the scheduler tables again at each tile switch.
  int4* tile_info;
  // Clusters (kCluster 2): rank 0's producer claims pair tiles and hands each to rank 1's through
  // rank 1's claim_val[i] / claim_full[i]; rank 1 frees the entry through rank 0's claim_empty[i].
  uint64_t* claim_full;   // [2]
  uint64_t* claim_empty;  // [2]
  int32_t* claim_val;     // [2]
  uint2* fp4_table;       // kWeightFp4: [kFp4TableRows] {magnitudes 0..3, 4..7} as e4m3, row i = shift i + kMxfp4MinShift
  int32_t* row_begin;
  int32_t* num_rows;
  int32_t* m_block_prefix;

  __device__ __forceinline__ static GroupedGemmSmem carve(uint8_t* raw, int num_experts) {
    GroupedGemmSmem s;
    // Offsets added to `raw` itself, never through an integer: the compiler then knows every carved
    // pointer is shared memory and reads the scales and tables with LDS (a pointer rebuilt from an
    // integer is generic: LD through the generic path, ~4% of the math warps' samples in the
    // scheduler's table search alone).
    uint8_t* p = raw + ((1024u - (ptx::smem_addr(raw) & 1023u)) & 1023u);
    s.a = p;
    p += Cfg::kStages * Cfg::kStageA;
    s.b = p;
    p += Cfg::kStages * Cfg::kStageB;
    s.out = p;
    p += Cfg::kStageOut;
    s.sfa = reinterpret_cast<float*>(p);
    p += Cfg::kStages * Cfg::kStageSFA;
    s.sfb = reinterpret_cast<float*>(p);
    p += Cfg::kStages * Cfg::kStageSFB;
    s.tile_info = reinterpret_cast<int4*>(p);  // 16-byte aligned: everything before is a multiple of 16
    p += Cfg::kStages * 32;
    s.full = reinterpret_cast<uint64_t*>(p);
    s.empty = s.full + Cfg::kStages;
    p += Cfg::kStages * 16;
    if constexpr (Cfg::kCluster > 1) {
      s.claim_full = reinterpret_cast<uint64_t*>(p);
      s.claim_empty = s.claim_full + 2;
      p += 2 * 16;
    }
    if constexpr (Cfg::kCluster > 1) {
      s.claim_val = reinterpret_cast<int32_t*>(p);
      p += 2 * 4;
    }
    if constexpr (Cfg::kWeightMxfp4) {  // 8-byte aligned: after the barriers, no claims (no clusters)
      s.fp4_table = reinterpret_cast<uint2*>(p);
      p += Cfg::kFp4TableBytes;
    }
    s.row_begin = reinterpret_cast<int32_t*>(p);
    s.num_rows = s.row_begin + num_experts;
    s.m_block_prefix = s.num_rows + num_experts;
    return s;
  }
};

// Ring position shared by producer and consumers; both walk the same sequence of K blocks.
struct PipeState {
  int32_t stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Builds the scheduler tables in shared memory (all threads of the CTA call it; ends in a barrier).
template <class Cfg>
__device__ __forceinline__ GroupedSchedule build_schedule(const GroupedGemmSmem<Cfg>& sm, const GroupedGemmParams& p,
                                                          int num_n_blocks) {
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t begin, rows;
    grouped_expert_rows(p.layout, e, p.expert_offsets, p.masked_counts, p.max_m, &begin, &rows);
    sm.row_begin[e] = begin;
    sm.num_rows[e] = rows;
    sm.m_block_prefix[e + 1] = (rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0: inclusive scan in chunks of 32
    const int lane = threadIdx.x;
    int32_t carry = 0;
    for (int base = 0; base < E; base += 32) {
      int32_t v = base + lane < E ? sm.m_block_prefix[base + lane + 1] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
      }
      if (base + lane < E) sm.m_block_prefix[base + lane + 1] = carry + v;
      carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) sm.m_block_prefix[0] = 0;
  }
  __syncthreads();
  GroupedSchedule s;
  s.row_begin = sm.row_begin;
  s.num_rows = sm.num_rows;
  s.m_block_prefix = sm.m_block_prefix;
  s.num_experts = E;
  s.num_n_blocks = num_n_blocks;
  s.block_m = Cfg::kBlockM;
  return s;
}

template <class Cfg>
__device__ __forceinline__ void init_barriers(const GroupedGemmSmem<Cfg>& sm) {
#pragma unroll
  for (int s = 0; s < Cfg::kStages; ++s) {
    ptx::mbar_init(&sm.full[s], Cfg::kFp8 ? 2 : 1);  // expect_tx arrival (+ cp.async arrival)
    ptx::mbar_init(&sm.empty[s], Cfg::kNumMathWG * 4 * Cfg::kCluster);  // one per math warp of the cluster
  }
  if constexpr (Cfg::kCluster > 1) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ptx::mbar_init(&sm.claim_full[i], 1);
      ptx::mbar_init(&sm.claim_empty[i], 1);
    }
  }
  ptx::mbar_init_fence();
}

// First A-scale column the TMA box starts at: the tile's first scale row rounded down to 4 (16 bytes).
__device__ __forceinline__ int32_t sfa_first_row(const GroupedGemmParams& p, const GroupedTile& t) {
  return p.layout == GroupedLayout::kMasked ? t.m0 : t.row0;
}
__device__ __forceinline__ int32_t sfa_box_start(const GroupedGemmParams& p, const GroupedTile& t) {
  const int32_t r = sfa_first_row(p, t);
  return r & ~3;  // invariant: TMA needs a 16-byte aligned global start (an unaligned one faults)
}

}  // namespace megamoe::gemm
