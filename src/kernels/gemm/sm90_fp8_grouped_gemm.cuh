// sm90_fp8_grouped_gemm.cuh — the Hopper grouped GEMM for the experts, as device building blocks
// (pipeline, producer, math, epilogues) and the persistent kernel that composes them.
//
// D[rows of expert e, N] = A[rows, K] * B[e]^T, B[e] = [N, K] (K the reduction dim, K-major both).
//   fp8:  e4m3 x e4m3, fp32 accumulation; DeepSeek-style scales applied per 128-wide K block in fp32
//         registers: acc_final += (sa[row, kb] * sb[e, n/128, kb]) * acc_kb, where acc_kb is the
//         wgmma result of one K block (the "promotion" that keeps fp8 tensor-core accumulation short).
//   bf16: bf16 x bf16, fp32 accumulation straight in the wgmma accumulators.
//
// Kernel (one CTA per SM, persistent; tiles from a global counter in order, or CTA i runs tiles i,
// i + grid, ... without one; see grouped_scheduler.h and next_tile(). fp8 128 x 256 tiles may run as
// clusters of 2 whose CTAs share each weight tile by TMA multicast: "clusters" below):
//   (BLOCK_M 16 and 32, fp8 decode: the operands swapped, see "swapped operands" below)
//   warpgroups 0 .. kNumMathWG-1  math: each owns 64 rows of the BLOCK_M tile and all BLOCK_N
//                                 columns, issued as BLOCK_N/128 chunks of wgmma m64n128 (one temp
//                                 accumulator, promoted into a final accumulator per chunk), then
//                                 runs the epilogue: SwiGLU + requant from registers; bf16 rows
//                                 staged by stmatrix, then 16-byte stores (or one TMA store per
//                                 16 x 64 slab when the rows are D's own).
//   warpgroup kNumMathWG          producer: one thread issues, per K block, TMA loads of the A tile
//                                 (BLOCK_M x 128 B), the B tile (BLOCK_N x 128 B), the A scales
//                                 (a BLOCK_M + 4 fp32 box starting 16-byte aligned) and 4-byte
//                                 cp.async loads of the B scales.
// Shared memory: kStages ring slots {A, B, SFA, SFB}, a full and an empty mbarrier and a tile record
// per slot, the bf16-store epilogue's staging rows, the scheduler tables. The producer alone picks
// tiles; the slot holding a tile's first K block carries the tile (id, expert, n-block, rows: resolved
// once, by the producer) to the math warpgroups (id -1 after
// the last tile). full[s]: expect_tx arrival + (fp8) the cp.async arrival, completes when the bytes
// land; empty[s]: one arrival per math warp once its wgmmas on the slot retired.
//
// Layouts (bytes are e4m3 or bf16; everything K-major):
//   A       [rows, K], row stride lda elements (a multiple of 16 bytes)
//   SFA     fp32, M-major ("transposed"): contiguous [K/128][ld_sfa] indexed [kb][row];
//           masked [E][K/128][ld_sfa] indexed [e][kb][m]; ld_sfa >= rows (or max_m), multiple of 4.
//   B       [E, N, K]; SFB fp32 [E, N/128, K/128]
//   SwiGLU  B is the prepared w13: per 256 rows, 128 gate rows then the 128 matching up rows (see
//           gemm_weights.h); D = h [rows, N/2], fp8 + SFD [N/256][ld] (M-major like SFA), or bf16.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "kernels/common/sm90_clock.cuh"
#include "kernels/common/sm90_quant.cuh"
#include "kernels/gemm/grouped_scheduler.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "kernels/gemm/sm90_gemm_ptx.cuh"
#include "megamoe/formats.h"

namespace megamoe::gemm {

enum EpilogueKind : int32_t {
  kEpiStoreBf16 = 0,   // D bf16 rows (optionally weighted, optionally routed through row_map)
  kEpiSwigluFp8 = 1,   // h = silu(gate) * up, requantised to e4m3 with 1x128 fp32 scales
  kEpiSwigluBf16 = 2,  // h = silu(gate) * up as bf16
};

// Everything the device code needs besides the three tensor maps. Filled by the host launcher.
struct GroupedGemmParams {
  int32_t layout;       // kLayoutContiguous | kLayoutMasked
  int32_t num_experts;
  int32_t n;            // columns of B per expert (2I for the SwiGLU epilogues)
  int32_t k;            // reduction length in elements, multiple of 128 (fp8) / 64 (bf16)
  int32_t max_m;        // masked: rows per expert in A
  const int32_t* expert_offsets;  // contiguous: [E + 1]
  const int32_t* masked_counts;   // masked: [E]
  const float* sfb;     // fp8: [E, N/128, K/128]
  // epilogue
  void* d;              // bf16 [*, ld_d] or e4m3 [*, ld_d]
  int64_t ld_d;         // elements
  const int32_t* row_map;    // kEpiStoreBf16: A row -> D row (< 0: not stored); null: identity
  const float* row_weight;   // kEpiStoreBf16: per A row factor applied in fp32; null: 1
  __nv_bfloat16* peer_d[8];  // kEpiStoreBf16 with num_peer_d > 0: row_map = peer * peer_d_rows + row
  int32_t num_peer_d;
  int32_t peer_d_rows;
  float* sfd;                // kEpiSwigluFp8: output scales, M-major like SFA
  int64_t ld_sfd;            // row stride of SFD (>= rows)
  int64_t sfd_expert_stride; // masked: (N/256) * ld_sfd; contiguous: 0
  int32_t pow2_scales;       // kEpiSwigluFp8: power-of-two output scales
  // Dynamic tile scheduling: int32 [2] = {next tile, CTAs done}, zero before the launch and zero
  // again after it (the last CTA to finish resets it). null: static round-robin (CTA i runs tiles
  // i, i + grid, ...).
  int32_t* tile_counter;
  // kEpiStoreBf16 with identity rows (no row_map, no peer buffers): the kernel's tmap_d describes D
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

template <int kBlockM_, int kBlockN_, bool kFp8_, int kEpilogue_, int kCluster_ = 1>
struct GroupedGemmConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kEpilogue = kEpilogue_;
  // CTAs per cluster. 2: the pair of CTAs runs tiles 2u and 2u + 1 of the schedule at once (pair
  // tile u); when both are the same expert's n-block (two m-blocks sharing one weight tile) each CTA
  // loads half of the weight tile and multicasts it to both, so L2 sends each weight byte once per
  // pair (see "clusters" below).
  static constexpr int kCluster = kCluster_;
  static constexpr int kBHalfRows = kBlockN / kCluster;  // weight rows one CTA loads per K block (shared tile)
  static constexpr int kBlockKBytes = 128;            // one 128-byte swizzle row per tile row
  static constexpr int kBlockK = kFp8 ? 128 : 64;     // elements per K block
  // BLOCK_M 16 or 32 (decode, fp8; bf16 rows or the SwiGLU + fp8 requant out): operands swapped. The
  // weights are wgmma's A (M = the tile's BLOCK_N weight rows in m64 halves), the BLOCK_M tokens its B
  // (N = 16 or 32): 16 / 32 MACs per weight byte instead of the 64 an m64 tile of 1-32 real rows
  // costs. One math warpgroup; 2 / 4 KiB A slots.
  static constexpr bool kSwapAB = kBlockM <= 32;
  static constexpr int kNumMathWG = kBlockM <= 64 ? 1 : kBlockM / 64;
  static constexpr int kNumChunks = kBlockN / 128;
  static constexpr int kNumThreads = 128 * (kNumMathWG + 1);
  static constexpr int kMathThreads = 128 * kNumMathWG;
  static constexpr int kStageA = kBlockM * kBlockKBytes;
  static constexpr int kStageB = kBlockN * kBlockKBytes;
  // A scales: a box of BLOCK_M + 4 fp32 starting at the tile's first row rounded down to 4 (a 16-byte
  // aligned start in global memory, whatever the segment offset); slots 128-byte aligned for TMA.
  static constexpr int kSfaBox = kBlockM + 4;
  static constexpr int kSfaStride = kFp8 ? (kSfaBox * 4 + 127) / 128 * 32 : 0;  // floats per slot
  static constexpr int kStageSFA = kSfaStride * 4;
  static constexpr int kStageSFB = 16;
  static constexpr int kStageBytes = kStageA + kStageB + kStageSFA + kStageSFB + 16 + 32;  // + 2 barriers + tile record
  static constexpr int kClaimBytes = kCluster > 1 ? 2 * 16 + 2 * 4 : 0;  // 2 x {claim_full, claim_empty} + 2 values
  // bf16-store epilogue staging: per math warp 16 rows x 64 columns of bf16 (2 KiB), see
  // epilogue_store_bf16; swapped: the tile's BLOCK_M token rows of BLOCK_N bf16.
  // Swapped SwiGLU: BLOCK_M token rows of 128 e4m3 codes + the 4 warps' per-token amax.
  static constexpr int kStageOut = kEpilogue == 0 /* kEpiStoreBf16 */
                                       ? (kSwapAB ? kBlockM * kBlockN * 2 : kNumMathWG * 4 * 2048)
                                   : kSwapAB ? kBlockM * 128 + 4 * kBlockM * 4
                                             : 0;
  static constexpr int kSmemBudget =
      227 * 1024 - 1024 /* alignment slack */ - 8 * 1024 /* tables */ - kStageOut - kClaimBytes;
  static_assert(kStageOut % 128 == 0, "the A-scale slots after the staging are TMA destinations");
  static constexpr int kStagesFit = kSmemBudget / kStageBytes;
  static constexpr int kStages = kStagesFit > 12 ? 12 : kStagesFit;
  static constexpr uint32_t kTxBytes = kStageA + kStageB + (kFp8 ? kSfaBox * 4 : 0);
  static constexpr int kMaxExperts = 512;
  // setmaxnreg budgets (64K registers per SM): the producer shrinks to 56 (the tile counter's loop
  // spilled at 48), the math warpgroups grow to 224.
  static constexpr uint32_t kProducerRegs = kNumMathWG == 1 ? 96 : 56;
  static constexpr uint32_t kMathRegs = kNumMathWG == 1 ? 256 : 224;  // scheduler tables: 3 * (E + 1) int32 <= 8 KiB
  static_assert(kBlockM == 16 || kBlockM == 32 || kBlockM == 64 || kBlockM == 128, "BLOCK_M is 16, 32, 64 or 128");
  static_assert(!kSwapAB || (kFp8 && (kEpilogue == 0 /* kEpiStoreBf16 */ || kEpilogue == 1 /* kEpiSwigluFp8 */)),
                "16- and 32-row tiles: fp8, bf16 rows or SwiGLU + fp8 out");
  static_assert(kBlockN == 128 || kBlockN == 256, "BLOCK_N is 128 or 256");
  static_assert(kEpilogue == kEpiStoreBf16 || kBlockN == 256, "SwiGLU tiles hold 128 gate + 128 up columns");
  static_assert(kStages >= 3, "pipeline too shallow");
  static_assert(kCluster == 1 || (kCluster == 2 && kFp8 && kBlockM == 128 && !kSwapAB),
                "clusters of 2: fp8 tiles of 128 rows");

  // Dynamic shared memory: 1 KiB alignment slack + ring + barriers + tables.
  static constexpr int smem_bytes(int num_experts) {
    return 1024 + kStages * (kStageA + kStageB + kStageSFA + kStageSFB) + kStageOut + kStages * 16 + kStages * 32 +
           kClaimBytes + 3 * (num_experts + 1) * 4 + 16;
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

// ---- producer ------------------------------------------------------------------------------------

// Publishes tile `tile_id` (= t) in ring slot `stage` (its first K block); the slot's full barrier
// arrival that follows releases it to the math warpgroups.
template <class Cfg>
__device__ __forceinline__ void publish_tile(const GroupedGemmSmem<Cfg>& sm, int stage, int32_t tile_id,
                                             const GroupedTile& t) {
  sm.tile_info[2 * stage] = make_int4(tile_id, t.expert, t.n_block, t.row0);
  sm.tile_info[2 * stage + 1] = make_int4(t.m0, t.rows, 0, 0);
}

// First A-scale column the TMA box starts at: the tile's first scale row rounded down to 4 (16 bytes).
__device__ __forceinline__ int32_t sfa_first_row(const GroupedGemmParams& p, const GroupedTile& t) {
  return p.layout == kLayoutMasked ? t.m0 : t.row0;
}
__device__ __forceinline__ int32_t sfa_box_start(const GroupedGemmParams& p, const GroupedTile& t) {
  const int32_t r = sfa_first_row(p, t);
  return r & ~3;  // invariant: TMA needs a 16-byte aligned global start (an unaligned one faults)
}

// Loads every K block of tile `tile_id` (= t) into the ring; the slot of its first K block also
// carries the tile (publish_tile), which is how the math warpgroups learn their next tile. Called by one thread.
// kEvictFirst: B with the L2 evict-first policy `b_policy` (a separate loop, so each stays unrolled).
template <class Cfg, bool kEvictFirst>
__device__ __forceinline__ void produce_tile(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int32_t tile_id,
                                             const GroupedTile& t, const GroupedGemmParams& p,
                                             const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                             const CUtensorMap* tmap_sfa, uint64_t b_policy) {
  const int num_kb = p.k / Cfg::kBlockK;
  const int32_t b_row = t.expert * p.n + t.n_block * Cfg::kBlockN;
  const float* sfb_tile = nullptr;
  if constexpr (Cfg::kFp8) sfb_tile = p.sfb + (int64_t(t.expert) * (p.n / 128) + t.n_block * Cfg::kNumChunks) * num_kb;
  for (int kb = 0; kb < num_kb; ++kb) {
    ptx::mbar_wait(&sm.empty[pipe.stage], pipe.phase ^ 1u);
    uint64_t* full = &sm.full[pipe.stage];
    if (kb == 0) publish_tile<Cfg>(sm, pipe.stage, tile_id, t);  // released by the arrive below
    ptx::mbar_arrive_expect_tx(full, Cfg::kTxBytes);
    ptx::tma_load_2d(sm.a + pipe.stage * Cfg::kStageA, tmap_a, full, kb * Cfg::kBlockKBytes, t.row0);
    if constexpr (kEvictFirst)
      ptx::tma_load_2d_hint(sm.b + pipe.stage * Cfg::kStageB, tmap_b, full, kb * Cfg::kBlockKBytes, b_row, b_policy);
    else
      ptx::tma_load_2d(sm.b + pipe.stage * Cfg::kStageB, tmap_b, full, kb * Cfg::kBlockKBytes, b_row);
    if constexpr (Cfg::kFp8) {
      const int32_t sfa_x = sfa_box_start(p, t);
      const int32_t sfa_y = p.layout == kLayoutMasked ? t.expert * num_kb + kb : kb;
      ptx::tma_load_2d(sm.sfa + pipe.stage * Cfg::kSfaStride, tmap_sfa, full, sfa_x, sfa_y);
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::cp_async_4(sm.sfb + pipe.stage * 4 + c, sfb_tile + c * num_kb + kb);
      ptx::cp_async_mbar_arrive_noinc(full);
    }
    pipe.advance(Cfg::kStages);
  }
}

// Walks the ring as produce_tile does, publishing tile t, but issues no copies; each slot's full barrier
// completes on plain arrivals, so the math warpgroups run their K loops on whatever the slots hold.
// For probes 3 and 4 (bench tools) and for a cluster's missing last tile (t with no rows).
template <class Cfg>
__device__ __forceinline__ void produce_tile_no_loads(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int32_t tile_id,
                                                      const GroupedTile& t, const GroupedGemmParams& p) {
  for (int kb = 0; kb < p.k / Cfg::kBlockK; ++kb) {
    ptx::mbar_wait(&sm.empty[pipe.stage], pipe.phase ^ 1u);
    if (kb == 0) publish_tile<Cfg>(sm, pipe.stage, tile_id, t);
    ptx::mbar_arrive(&sm.full[pipe.stage]);
    if constexpr (Cfg::kFp8) ptx::mbar_arrive(&sm.full[pipe.stage]);  // stands in for the cp.async arrival
    pipe.advance(Cfg::kStages);
  }
}

// Tells the math warpgroups there are no more tiles: the next slot carries tile id -1 and no data
// (its full barrier completes on plain arrivals). Called by the producing thread after its last tile.
template <class Cfg>
__device__ __forceinline__ void produce_end(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe) {
  ptx::mbar_wait(&sm.empty[pipe.stage], pipe.phase ^ 1u);
  sm.tile_info[2 * pipe.stage] = make_int4(-1, 0, 0, 0);
  ptx::mbar_arrive(&sm.full[pipe.stage]);
  if constexpr (Cfg::kFp8) ptx::mbar_arrive(&sm.full[pipe.stage]);  // stands in for the cp.async arrival
}

// The next tile of this CTA: from the global counter (dynamic: tiles go out in order as CTAs free
// up, so tiles that share a weight or an A block run at nearly the same time wherever the CTAs
// are, and their second reads hit L2) or round-robin (static). Either way CTA i's first tile is
// tile i (the CTAs start together, so the order is the same), which keeps the counter's round trip
// off the first loads; the counter hands out tiles from gridDim.x on. Producer thread only.
__device__ __forceinline__ int32_t next_tile(const GroupedGemmParams& p, int32_t prev) {
  if (prev < 0) return int32_t(blockIdx.x);
  if (p.tile_counter != nullptr) return int32_t(gridDim.x) + atomicAdd(&p.tile_counter[0], 1);
  return prev + int32_t(gridDim.x);
}

// After the producer's failing fetch: the last CTA of the grid to get there returns the counter to
// zero for the next launch (no CTA touches it again in this one).
// `claimers`: the threads that fetch from the counter (one per CTA, one per cluster with clusters).
__device__ __forceinline__ void release_tile_counter(const GroupedGemmParams& p, int32_t claimers) {
  if (p.tile_counter == nullptr) return;
  if (atomicAdd(&p.tile_counter[1], 1) == claimers - 1) {
    atomicExch(&p.tile_counter[0], 0);
    atomicExch(&p.tile_counter[1], 0);
  }
}

// ---- clusters (kCluster 2) ---------------------------------------------------------------------------
//
// The two CTAs of a cluster run pair tile u = tiles {2u, 2u + 1} of the schedule (rank r runs 2u + r),
// from a pair counter (rank 0 claims and hands the id to rank 1) or round-robin over the clusters. With
// the schedule's order (n-block major, m-block minor within an expert) the two are mostly the same
// expert's n-block at adjacent m-blocks: then each CTA loads the A rows of its own m-block and one half
// of the shared weight tile, multicast into both CTAs' slots, so L2 sends each weight byte once per
// pair (per K block 16 KiB of A + 16 KiB of B from L2 per CTA instead of 16 + 32). A pair that
// straddles an expert or an n-block (odd m-block counts) loads both halves in each CTA, no multicast.
// Both rings walk the same K blocks in the same slots (every pair tile has K / 128 of them; a CTA
// whose tile 2u + 1 does not exist walks its ring without loads), and each math warp releases a slot
// in both CTAs (release_slot), so a producer's empty wait also covers the partner's slot.

// Loads tile `tile_id` (= t) of the pair as produce_tile does; kShared: the partner runs the same
// weight tile, and this CTA loads rows [rank * BLOCK_N / 2, + BLOCK_N / 2) of it for both.
template <class Cfg, bool kShared>
__device__ __forceinline__ void produce_tile_pair(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int32_t tile_id,
                                                  const GroupedTile& t, uint32_t rank, const GroupedGemmParams& p,
                                                  const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                                  const CUtensorMap* tmap_sfa) {
  constexpr int kHalf = Cfg::kBHalfRows;
  const int num_kb = p.k / Cfg::kBlockK;
  const int32_t b_row = t.expert * p.n + t.n_block * Cfg::kBlockN;
  const float* sfb_tile = p.sfb + (int64_t(t.expert) * (p.n / 128) + t.n_block * Cfg::kNumChunks) * num_kb;
  const int32_t sfa_x = sfa_box_start(p, t);
  for (int kb = 0; kb < num_kb; ++kb) {
    ptx::mbar_wait(&sm.empty[pipe.stage], pipe.phase ^ 1u);  // both CTAs' math warps have read this slot
    uint64_t* full = &sm.full[pipe.stage];
    if (kb == 0) publish_tile<Cfg>(sm, pipe.stage, tile_id, t);
    // The partner's half may land first: its transaction bytes count down before this expect counts
    // them up, and the phase cannot complete while this arrival is still pending.
    ptx::mbar_arrive_expect_tx(full, Cfg::kTxBytes);
    ptx::tma_load_2d(sm.a + pipe.stage * Cfg::kStageA, tmap_a, full, kb * Cfg::kBlockKBytes, t.row0);
    uint8_t* const b = sm.b + pipe.stage * Cfg::kStageB;
    if constexpr (kShared) {
      ptx::tma_load_2d_multicast(b + rank * kHalf * Cfg::kBlockKBytes, tmap_b, full, kb * Cfg::kBlockKBytes,
                                 b_row + int32_t(rank) * kHalf, uint16_t((1u << Cfg::kCluster) - 1u));
    } else {
#pragma unroll
      for (int h = 0; h < Cfg::kCluster; ++h)
        ptx::tma_load_2d(b + h * kHalf * Cfg::kBlockKBytes, tmap_b, full, kb * Cfg::kBlockKBytes, b_row + h * kHalf);
    }
    const int32_t sfa_y = p.layout == kLayoutMasked ? t.expert * num_kb + kb : kb;
    ptx::tma_load_2d(sm.sfa + pipe.stage * Cfg::kSfaStride, tmap_sfa, full, sfa_x, sfa_y);
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::cp_async_4(sm.sfb + pipe.stage * 4 + c, sfb_tile + c * num_kb + kb);
    ptx::cp_async_mbar_arrive_noinc(full);
    pipe.advance(Cfg::kStages);
  }
}

// The tile id rank 1 publishes for the missing second tile of the last pair (an odd tile count).
constexpr int32_t kLoneTile = 0x7FFFFFFE;

// The pair counter's mailbox from rank 0 to rank 1 (two entries; `claim` counts the entries used).
// Rank 0 fetches a pair tile and posts it; rank 1 takes it.
template <class Cfg>
__device__ __forceinline__ int32_t post_claim(const GroupedGemmSmem<Cfg>& sm, const GroupedGemmParams& p, int32_t claim) {
  const int32_t num_clusters = int32_t(ptx::num_clusters_x());  // read here, not held (the producer has 56 registers)
  const int i = claim & 1;
  ptx::mbar_wait_cluster(&sm.claim_empty[i], (uint32_t(claim >> 1) & 1u) ^ 1u);  // rank 1 has taken what entry i held
  const int32_t next = num_clusters + atomicAdd(&p.tile_counter[0], 1);
  ptx::st_cluster_u32(ptx::cluster_map(&sm.claim_val[i], 1), uint32_t(next));
  ptx::mbar_arrive_cluster(ptx::cluster_map(&sm.claim_full[i], 1));  // release: the value first
  return next;
}
template <class Cfg>
__device__ __forceinline__ int32_t take_claim(const GroupedGemmSmem<Cfg>& sm, int32_t claim) {
  const int i = claim & 1;
  ptx::mbar_wait_cluster(&sm.claim_full[i], uint32_t(claim >> 1) & 1u);
  const int32_t next = *static_cast<volatile int32_t*>(&sm.claim_val[i]);
  ptx::mbar_arrive_cluster(ptx::cluster_map(&sm.claim_empty[i], 0));
  return next;
}

// The producing thread of a cluster CTA: every pair tile of the cluster, then the end marker.
// `stamp(t, word)` records tile t's timeline (bench tools).
template <class Cfg, class Stamp>
__device__ __forceinline__ void produce_cluster(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe,
                                                const GroupedSchedule& sched, const GroupedGemmParams& p,
                                                const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                                const CUtensorMap* tmap_sfa, bool no_loads, const Stamp& stamp) {
  const uint32_t rank = ptx::cluster_ctarank();
  const int32_t num_tiles = sched.num_tiles();
  const int32_t num_pairs = (num_tiles + 1) / 2;
  // Pair tiles: the cluster's index first, then round-robin over the clusters or from the counter. Rank
  // 0 fetches from the counter one pair tile ahead (when it starts a pair tile it posts the next), so
  // rank 1, whose loads wait for the id, does not wait for the fetch's round trip at each tile.
  const bool counter = p.tile_counter != nullptr;
  int32_t claim = 0, u = int32_t(ptx::cluster_id_x()), u_next = num_pairs;
  if (counter && rank == 0 && u < num_pairs) u_next = post_claim<Cfg>(sm, p, claim++);
  while (u < num_pairs) {
    const int32_t t = 2 * u + int32_t(rank);
    if (t < num_tiles) {
      stamp(t, 1);
      const GroupedTile tile = sched.tile(t);
      const int32_t other = 2 * u + int32_t(rank ^ 1u);
      bool shared = false;
      if (other < num_tiles) {
        const GroupedTile o = sched.tile(other);
        shared = o.expert == tile.expert && o.n_block == tile.n_block;
      }
      if (no_loads)  // probes 3 and 4
        produce_tile_no_loads<Cfg>(sm, pipe, t, tile, p);
      else if (shared)
        produce_tile_pair<Cfg, true>(sm, pipe, t, tile, rank, p, tmap_a, tmap_b, tmap_sfa);
      else
        produce_tile_pair<Cfg, false>(sm, pipe, t, tile, rank, p, tmap_a, tmap_b, tmap_sfa);
      stamp(t, 2);
    } else {
      // No tile 2u + 1: walk the ring in step. The math runs it as a tile of no rows of tile 0's expert
      // (stale operands, nothing stored).
      GroupedTile none = sched.tile(0);
      none.rows = 0;
      produce_tile_no_loads<Cfg>(sm, pipe, kLoneTile, none, p);
    }
    if (!counter) {
      u += int32_t(ptx::num_clusters_x());
    } else if (rank == 0) {
      u = u_next;
      if (u < num_pairs) u_next = post_claim<Cfg>(sm, p, claim++);
    } else {
      u = take_claim<Cfg>(sm, claim++);
    }
  }
  if (rank == 0) release_tile_counter(p, int32_t(ptx::num_clusters_x()));
  produce_end<Cfg>(sm, pipe);
}

// ---- math ------------------------------------------------------------------------------------------

// A math warp is done reading ring slot `stage` (every lane calls; `lane` = threadIdx.x % 32). In a
// cluster the partner CTA's producer writes half of this slot's weight tile too (multicast), so the
// release goes to both CTAs' empty barriers, lane 0 to this CTA's and lane 1 to the partner's: a slot is
// refilled once the math warps of both have read it, and the two rings stay in step. The remote arrive
// has the default (CTA-scope) release: the wgmma reads it orders have completed (wgmma.wait_group);
// a cluster-scope release per K block cost the K loop ~30% (measured with `--probe no-loads`).
template <class Cfg>
__device__ __forceinline__ void release_slot(const GroupedGemmSmem<Cfg>& sm, int stage, int lane) {
  if constexpr (Cfg::kCluster > 1) {
    ptx::mbar_arrive_local_and_remote(lane, &sm.empty[stage], ptx::cluster_map(&sm.empty[stage], ptx::cluster_ctarank() ^ 1u));
  } else {
    ptx::mbar_arrive_if(lane == 0, &sm.empty[stage]);  // predicated, not a branch: 3-5 fewer instructions
  }                                                     // in the swapped K loops
}

// One fp8 K block of math warpgroup `wg`: per 128-column chunk, the four m64n128k32 wgmmas into the
// temporary accumulator, then their promotion acc[c] (+)= (sa * sb[c]) * tmp. kFirst: the tile's first
// K block, whose promotion starts the sum: fmaf(s, tmp, +0), the bits a zeroed acc would give, without
// zeroing 64 registers per chunk between tiles (while the tensor cores wait).
template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_fp8(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int wg, int sfa0,
                                                 float (&acc)[Cfg::kNumChunks][64]) {
  const int lane = threadIdx.x % 32;
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint8_t* a_tile = sm.a + pipe.stage * Cfg::kStageA + wg * 64 * Cfg::kBlockKBytes;
  const uint8_t* b_tile = sm.b + pipe.stage * Cfg::kStageB;
  const uint64_t desc_a = ptx::make_sw128_desc(a_tile);
  const float sa0 = sm.sfa[pipe.stage * Cfg::kSfaStride + sfa0];
  const float sa1 = sm.sfa[pipe.stage * Cfg::kSfaStride + sfa0 + 8];
  float sb[Cfg::kNumChunks];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) sb[c] = sm.sfb[pipe.stage * 4 + c];
  float tmp[64];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) {
    const uint64_t desc_b = ptx::make_sw128_desc(b_tile + c * 128 * Cfg::kBlockKBytes);
    ptx::fence_operands(tmp);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) ptx::wgmma_m64n128k32_e4m3(tmp, desc_a + 2 * k, desc_b + 2 * k, k > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(tmp);
    if (c == Cfg::kNumChunks - 1) {
      // All reads of this slot (wgmma and scales) are done: hand it back to the producer.
      __syncwarp();
      release_slot<Cfg>(sm, pipe.stage, lane);
    }
    const float s0 = sa0 * sb[c], s1 = sa1 * sb[c];
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      acc[c][i + 0] = fmaf(s0, tmp[i + 0], kFirst ? 0.f : acc[c][i + 0]);
      acc[c][i + 1] = fmaf(s0, tmp[i + 1], kFirst ? 0.f : acc[c][i + 1]);
      acc[c][i + 2] = fmaf(s1, tmp[i + 2], kFirst ? 0.f : acc[c][i + 2]);
      acc[c][i + 3] = fmaf(s1, tmp[i + 3], kFirst ? 0.f : acc[c][i + 3]);
    }
  }
  pipe.advance(Cfg::kStages);
}

// Runs the K loop of one tile for math warpgroup `wg` (0-based among the math warpgroups), leaving
// the fp32 result for its 64 rows x BLOCK_N columns in acc[chunk][...] (fragment layout of
// ptx::wgmma_m64n128k32_e4m3). Called by all 128 threads of the warpgroup.
template <class Cfg>
__device__ __forceinline__ void math_tile(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, const GroupedGemmParams& p,
                                          const GroupedTile& t, int wg, float (&acc)[Cfg::kNumChunks][64]) {
  const int num_kb = p.k / Cfg::kBlockK;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  if constexpr (Cfg::kFp8) {
    const int r0 = wg * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile; second is r0 + 8
    const int sfa0 = sfa_first_row(p, t) - sfa_box_start(p, t) + r0;  // its A scale in the slot
    // invariant: num_kb >= 1 (validate_grouped_gemm: K a positive multiple of 128)
    math_k_block_fp8<Cfg, true>(sm, pipe, wg, sfa0, acc);
    for (int kb = 1; kb < num_kb; ++kb) math_k_block_fp8<Cfg, false>(sm, pipe, wg, sfa0, acc);
  } else {
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[c][i] = 0.f;

    for (int kb = 0; kb < num_kb; ++kb) {
      ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
      const uint8_t* a_tile = sm.a + pipe.stage * Cfg::kStageA + wg * 64 * Cfg::kBlockKBytes;
      const uint8_t* b_tile = sm.b + pipe.stage * Cfg::kStageB;
      const uint64_t desc_a = ptx::make_sw128_desc(a_tile);
      // bf16: the wgmmas accumulate in acc itself
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::fence_operands(acc[c]);
      ptx::wgmma_fence();
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) {
        const uint64_t desc_b = ptx::make_sw128_desc(b_tile + c * 128 * Cfg::kBlockKBytes);
#pragma unroll
        for (int k = 0; k < 4; ++k) ptx::wgmma_m64n128k16_bf16(acc[c], desc_a + 2 * k, desc_b + 2 * k, 1);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::fence_operands(acc[c]);
      __syncwarp();
      release_slot<Cfg>(sm, pipe.stage, lane);
      pipe.advance(Cfg::kStages);
    }
  }
}

// ---- swapped operands (BLOCK_M 16 or 32, fp8) ---------------------------------------------------------
//
// The weights are wgmma's A: the tile's BLOCK_N weight rows in m64 halves (chunk c, half h: rows
// 128c + 64h ..), read from the B slot; the tile's BLOCK_M token rows are wgmma's B (N = BLOCK_M), the
// A slot. Accumulator fragment of (c, h): thread (warp w, lane l) holds weight row 128c + 64h + 16w +
// l/4 (+8) for tokens 8i + 2(l%4) + j, i < BLOCK_M / 8, j in {0, 1}; register 4i + 2hh + j is
// row + 8hh (ptx::wgmma_m64n16k32_e4m3 / m64n32k32). Token s / 2 * 8 + 2(l%4) + s % 2 is this
// thread's token s, s < BLOCK_M / 4.

// The swapped tile's accumulators: [chunk][half][registers of BLOCK_M tokens]
template <class Cfg>
using SwappedAcc = float[Cfg::kNumChunks][2][Cfg::kBlockM / 2];

template <int kTokens>
__device__ __forceinline__ void wgmma_swapped(float (&d)[kTokens / 2], uint64_t desc_w, uint64_t desc_x, int scale_d) {
  if constexpr (kTokens == 16)
    ptx::wgmma_m64n16k32_e4m3(d, desc_w, desc_x, scale_d);
  else
    ptx::wgmma_m64n32k32_e4m3(d, desc_w, desc_x, scale_d);
}

// This thread's token s (fragment column), s < BLOCK_M / 4.
__device__ __forceinline__ int swapped_token(int s, int q) { return (s / 2) * 8 + 2 * q + s % 2; }

// One fp8 K block: every (c, h)'s four m64nBLOCK_Mk32 wgmmas issued before one wait, then the promotion
// acc (+)= (sa[token] * sb[c]) * tmp (kFirst: the tile's first K block, as math_k_block_fp8).
template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_swapped(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int box0,
                                                     SwappedAcc<Cfg>& acc) {
  constexpr int kRegs = Cfg::kBlockM / 2;
  const int lane = threadIdx.x % 32, q = lane % 4;
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint64_t desc_x = ptx::make_sw128_desc(sm.a + pipe.stage * Cfg::kStageA);
  const uint8_t* w_tile = sm.b + pipe.stage * Cfg::kStageB;
  const float* sfa = sm.sfa + pipe.stage * Cfg::kSfaStride + box0;
  float sa[Cfg::kBlockM / 4];  // this thread's tokens
#pragma unroll
  for (int s = 0; s < Cfg::kBlockM / 4; ++s) sa[s] = sfa[swapped_token(s, q)];
  float sb[Cfg::kNumChunks];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) sb[c] = sm.sfb[pipe.stage * 4 + c];
  SwappedAcc<Cfg> tmp;
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) ptx::fence_operands(tmp[c][h]);
  ptx::wgmma_fence();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint64_t desc_w = ptx::make_sw128_desc(w_tile + (c * 128 + h * 64) * Cfg::kBlockKBytes);
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_swapped<Cfg::kBlockM>(tmp[c][h], desc_w + 2 * k, desc_x + 2 * k, k > 0);
    }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) ptx::fence_operands(tmp[c][h]);
  // All reads of this slot (wgmma and scales) are done: hand it back to the producer.
  __syncwarp();
  release_slot<Cfg>(sm, pipe.stage, lane);
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const float sc = sa[(i / 4) * 2 + (i % 2)] * sb[c];
        acc[c][h][i] = fmaf(sc, tmp[c][h][i], kFirst ? 0.f : acc[c][h][i]);
      }
  pipe.advance(Cfg::kStages);
}

template <class Cfg>
__device__ __forceinline__ void math_tile_swapped(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe,
                                                  const GroupedGemmParams& p, const GroupedTile& t,
                                                  SwappedAcc<Cfg>& acc) {
  const int box0 = sfa_first_row(p, t) - sfa_box_start(p, t);  // the tile's first token in the scale slot
  // invariant: num_kb >= 1 (validate_grouped_gemm: K a positive multiple of 128)
  math_k_block_swapped<Cfg, true>(sm, pipe, box0, acc);
  for (int kb = 1; kb < p.k / Cfg::kBlockK; ++kb) math_k_block_swapped<Cfg, false>(sm, pipe, box0, acc);
}

// ---- epilogues -------------------------------------------------------------------------------------

// Where an output row goes. The default sink writes D[row_map ? row_map[a_row] : a_row], or, with
// peer buffers, row row_map % peer_d_rows of peer_d[row_map / peer_d_rows] (a rank's combine region
// through its LSA pointer); a fused kernel may supply its own sink.
struct DefaultRowSink {
  const GroupedGemmParams& p;
  __device__ __forceinline__ __nv_bfloat16* row_ptr(int32_t a_row) const {
    const int32_t dst = p.row_map ? p.row_map[a_row] : a_row;
    if (dst < 0) return nullptr;
    if (p.num_peer_d > 0) {
      const int32_t peer = dst / p.peer_d_rows;
      return peer < p.num_peer_d ? p.peer_d[peer] + int64_t(dst - peer * p.peer_d_rows) * p.ld_d : nullptr;
    }
    return static_cast<__nv_bfloat16*>(p.d) + int64_t(dst) * p.ld_d;
  }
};

// Quad transpose: the 4 lanes q of a quad each hold x[0..3]; afterwards y[p] = lane p's x[q]. Used
// to turn the wgmma fragment (a quad holds 8 consecutive columns of one row per 8-column group,
// 2 per lane) into one contiguous 4-group segment per lane, so the epilogue issues 16-byte
// (bf16) / 8-byte (e4m3) stores of full sectors instead of 4-byte / 2-byte ones. All 32 lanes
// must call it (warp shuffles); selects, not indexed registers, keep everything in registers.
__device__ __forceinline__ void quad_transpose(const uint32_t (&x)[4], uint32_t (&y)[4]) {
  const int q = threadIdx.x & 3;
  auto pick = [&](int k) { return k == 0 ? x[0] : k == 1 ? x[1] : k == 2 ? x[2] : x[3]; };
  const uint32_t r1 = __shfl_xor_sync(0xffffffffu, pick(q ^ 1), 1);
  const uint32_t r2 = __shfl_xor_sync(0xffffffffu, pick(q ^ 2), 2);
  const uint32_t r3 = __shfl_xor_sync(0xffffffffu, pick(q ^ 3), 3);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int d = p ^ q;
    y[p] = d == 0 ? x[p] : d == 1 ? r1 : d == 2 ? r2 : r3;
  }
}

// Two fp32 to packed bf16x2 (round to nearest even, as fmt::float_to_bf16 for every non-NaN input;
// a NaN becomes the canonical 0x7FFF where the host codec keeps the payload).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// bf16 rows: value = acc (* row_weight), rounded once. Each warp stages its 16 rows 64 columns at a
// time in shared memory with stmatrix (the accumulator fragment's 8x8 blocks are stmatrix's layout,
// so no shuffles), then reads them back as whole 16-byte row pieces and stores those: 8 lanes per
// 128-byte row segment, full sectors, any row mapping (the sink's pointer per row). ncu measured the
// shuffle-transpose version at ~940 instructions per warp per tile, while the tensor cores idle.
// Staging rows are 128 bytes with the 16-byte pieces XOR-swizzled by (row & 7): conflict-free
// stmatrix rows and read-back.
// invariant: D rows are 16-byte aligned (validate_grouped_gemm checks d and ldd).
//
// tma_d (null: not used): a tensor map of D itself ([rows, N] bf16, box 64 x 16, 128-byte swizzle:
// the staging rows' layout), for a sink that stores row r at D row r. A warp whose 16 rows all lie
// inside the tile's segment then stores each staged 16 x 64 slab with one TMA tensor store instead
// of the read-back and 16-byte stores (rows past the segment must not be written, so a partial
// slab takes the per-row path); the staging is reused once the store has read it.
template <class Cfg, class Sink>
__device__ __forceinline__ void epilogue_store_bf16(const GroupedGemmSmem<Cfg>& sm, const float (&acc)[Cfg::kNumChunks][64],
                                                    const GroupedTile& t, int wg, const Sink& sink,
                                                    const float* row_weight, const CUtensorMap* tma_d = nullptr) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int wrow0 = wg * 64 + warp * 16;  // the warp's first row in the tile
  const uint8_t* stage_ptr = sm.out + (wg * 4 + warp) * 2048;
  const uint32_t stage = ptx::smem_addr(stage_ptr);
  // warp-uniform; read through a shuffle so that ptxas knows it (a branch on a value it must treat as
  // per-lane moved the mainloop's ring position out of uniform registers)
  const bool tma = __shfl_sync(0xffffffffu, tma_d != nullptr && wrow0 + 16 <= t.rows ? 1 : 0, 0) != 0;
  // This lane's two accumulator rows (lane / 4 and + 8) and their weights.
  float w0 = 1.f, w1 = 1.f;
  if (row_weight != nullptr) {
    const int r0 = wrow0 + lane / 4;
    if (r0 < t.rows) w0 = row_weight[t.row0 + r0];
    if (r0 + 8 < t.rows) w1 = row_weight[t.row0 + r0 + 8];
  }
  // stmatrix addresses: lane l gives row (l & 7) + 8 * ((l >> 3) & 1) of 16-byte piece (l >> 4) of
  // each pair of 8-column groups.
  const int st_row = (lane & 7) + 8 * ((lane >> 3) & 1), st_piece = lane >> 4;
  // Rounds the warp's 16 rows x 64 columns of chunk c, half `half`, to bf16 and writes them into the
  // staging rows.
  const auto stage_slab = [&](int c, int half) {
#pragma unroll
    for (int g2 = 0; g2 < 4; ++g2) {  // 8-column groups 2*g2 and 2*g2+1 of this 64-column half
      const int g = half * 8 + 2 * g2;
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 2; ++m)  // group g + m, rows lane/4 (h = 0) and lane/4 + 8 (h = 1)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float v0 = acc[c][4 * (g + m) + 2 * h], v1 = acc[c][4 * (g + m) + 2 * h + 1];
          const float w = h == 0 ? w0 : w1;
          r[2 * m + h] = row_weight ? pack_bf16x2(v0 * w, v1 * w) : pack_bf16x2(v0, v1);
        }
      const int piece = 2 * g2 + st_piece;
      ptx::stmatrix_x4(stage + st_row * 128 + ((piece ^ (st_row & 7)) << 4), r[0], r[1], r[2], r[3]);
    }
  };
  // Two loops, one per path, chosen once per tile: with the per-row path in the same loop body (a
  // branch per slab), FC2 ran ~1% slower (measured with the per-row path compiled out, PERF.md
  // session 15).
  if (tma) {
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        ptx::bulk_wait_read<0>();  // the staging's previous TMA store (this tile's or the last one's) has read it
        __syncwarp();
        stage_slab(c, half);
        ptx::fence_proxy_async_smem();
        __syncwarp();
        ptx::tma_store_2d(lane == 0, tma_d, stage_ptr, t.n_block * Cfg::kBlockN + c * 128 + half * 64, t.row0 + wrow0);
        ptx::bulk_commit();  // a no-op where nothing was issued
      }
  } else {
    // Lane l < 16 resolves row l's destination once; the others get it by shuffle.
    __nv_bfloat16* my_row = nullptr;
    if (lane < 16 && wrow0 + lane < t.rows) my_row = sink.row_ptr(t.row0 + wrow0 + lane);
    // read-back: lane l takes row 4 * it + l / 8, piece l % 8
    const int rb_piece = lane % 8;
    if (tma_d != nullptr) {  // an earlier tile's TMA stores from this staging have read it
      ptx::bulk_wait_read<0>();  // every lane: a no-op where nothing is pending
      __syncwarp();
    }
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        stage_slab(c, half);
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int row = 4 * it + lane / 8;
          const uint4 v = ptx::lds_v4(stage + row * 128 + ((rb_piece ^ (row & 7)) << 4));
          const unsigned long long pr =
              __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_row), row);
          __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(pr);
          if (out != nullptr)
            *reinterpret_cast<uint4*>(out + t.n_block * Cfg::kBlockN + c * 128 + half * 64 + 8 * rb_piece) = v;
        }
        __syncwarp();  // the next stmatrix overwrites the staging rows
      }
  }
}

// bf16 rows of a swapped tile: token row r gets the tile's BLOCK_N columns (times row_weight[r]).
// The fragment's 8 x 8 blocks (8 weight rows x 8 tokens) go through stmatrix.trans into staging rows
// of one token each ([BLOCK_M tokens][BLOCK_N] bf16, 16-byte pieces XOR-swizzled by token & 7:
// conflict-free), then the warpgroup copies the 16-byte pieces of the tile's real token rows to where
// the sink puts them. Two named barriers over the warpgroup: the staging is read before it is
// rewritten.
template <class Cfg, class Sink>
__device__ __forceinline__ void epilogue_store_swapped(const GroupedGemmSmem<Cfg>& sm, const SwappedAcc<Cfg>& acc,
                                                       const GroupedTile& t, const Sink& sink,
                                                       const float* row_weight) {
  constexpr int kPitch = Cfg::kBlockN * 2;   // bytes per staged token row
  constexpr int kPieces = Cfg::kBlockN / 8;  // 16-byte pieces per token row
  constexpr int kTok = Cfg::kBlockM / 4;     // tokens per thread
  static_assert(Cfg::kBlockM * kPitch <= Cfg::kStageOut, "staging holds the tile's token rows");
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32, q = lane % 4;
  const uint32_t stage = ptx::smem_addr(sm.out);
  float w[kTok];  // weights of this thread's tokens (swapped_token)
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int tok = swapped_token(s, q);
    w[s] = row_weight != nullptr && tok < t.rows ? row_weight[t.row0 + tok] : 1.f;
  }
  // stmatrix.trans, 16 tokens per call: lane L gives row L % 8 of matrix L / 8 = 2j' + hh (tokens
  // 16g + 8j' .., weight rows + 8hh)
  const int hh_l = (lane / 8) % 2;
  ptx::named_barrier_sync(1, 128);  // the previous tile's copy-out has read the staging
#pragma unroll
  for (int g = 0; g < Cfg::kBlockM / 16; ++g) {
    const int tok_l = 16 * g + (lane / 16) * 8 + lane % 8;
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n0 = c * 128 + h * 64 + warp * 16 + 8 * hh_l;  // first weight row of this lane's matrix
        const uint32_t addr = stage + tok_l * kPitch + (((n0 / 8) ^ (tok_l & 7)) << 4);
        uint32_t r[4];  // matrix 2j' + hh: (acc[4j + 2hh], acc[4j + 2hh + 1]) for tokens 8j + 2q, + 1, j = 2g + j'
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int j = 2 * g + m / 2, hh = m % 2;
          r[m] = pack_bf16x2(acc[c][h][4 * j + 2 * hh] * w[2 * j], acc[c][h][4 * j + 2 * hh + 1] * w[2 * j + 1]);
        }
        ptx::stmatrix_x4_trans(addr, r[0], r[1], r[2], r[3]);
      }
  }
  ptx::named_barrier_sync(1, 128);
#pragma unroll
  for (int idx = tid; idx < Cfg::kBlockM * kPieces; idx += 128) {
    const int tok = idx / kPieces, piece = idx % kPieces;
    __nv_bfloat16* out = tok < t.rows ? sink.row_ptr(t.row0 + tok) : nullptr;
    if (out != nullptr)
      *reinterpret_cast<uint4*>(out + t.n_block * Cfg::kBlockN + piece * 8) =
          ptx::lds_v4(stage + tok * kPitch + ((piece ^ (tok & 7)) << 4));
  }
}

// silu(g) * u in fp32 from the fast exponential and division (g / (1 + e), 0 when 1 + e overflows;
// a few ulp from the host's silu, far below the bf16 / e4m3 step of the output) and an IEEE multiply.
// e = 2^(-g * log2 e) by ex2.approx.ftz: __expf's bits wherever e is normal, and 0 where __expf gives a
// subnormal (g > 87.3), which 1 + e rounds away either way; it saves __expf's range check and
// rescaling (three instructions per element).
// Not a codec: the requantisation below is. The epilogue runs while the tensor cores idle, on two
// warps per scheduler, so every instruction per element shows in the layer's time.
__device__ __forceinline__ float swiglu(float g, float u) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return __fmul_rn(__fdividef(g, 1.f + e), u);
}

// SwiGLU over a 128 gate + 128 up tile: h[:, 128 * n_block ...] of width 128, one 1x128 block per
// row: fp8 e4m3 codes + fp32 scale (fmt::fp8_block_scale of the row's amax and e4m3(div_rn(h, s)),
// as fmt::quantize_fp8_1x128 computes them), or bf16. Stores: 8 bytes (e4m3) / 16 bytes (bf16)
// per lane after the quad transpose.
template <class Cfg>
__device__ __forceinline__ void epilogue_swiglu(const float (&acc)[Cfg::kNumChunks][64], const GroupedTile& t, int wg,
                                                const GroupedGemmParams& p) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + warp * 16 + lane / 4 + 8 * h;
    float v[32];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[2 * i] = swiglu(acc[0][4 * i + 2 * h], acc[1][4 * i + 2 * h]);
      v[2 * i + 1] = swiglu(acc[0][4 * i + 2 * h + 1], acc[1][4 * i + 2 * h + 1]);
      amax = fmaxf(amax, fmaxf(fmt::finite_abs(v[2 * i]), fmt::finite_abs(v[2 * i + 1])));
    }
    // The 4 lanes of a quad hold one row.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const bool valid = r < t.rows;  // uniform over the quad
    const int64_t a_row = t.row0 + r;
    if constexpr (Cfg::kEpilogue == kEpiSwigluFp8) {
      const float s = fmt::fp8_block_scale(amax, p.pow2_scales != 0);
      const float inv = __frcp_rn(s);
      uint8_t* out = static_cast<uint8_t*>(p.d) + a_row * p.ld_d + t.n_block * 128;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x[4], y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * j + k;
          // == fmt::float_to_e4m3(fmt::div_rn(v, s)) for each of the pair, without the division
          x[k] = kernels::quantize_e4m3_pair(v[2 * i], v[2 * i + 1], s, inv);
        }
        quad_transpose(x, y);
        if (valid)
          *reinterpret_cast<uint2*>(out + 8 * (4 * j + q)) = make_uint2(y[0] | (y[1] << 16), y[2] | (y[3] << 16));
      }
      if (valid && q == 0) {
        const int64_t m = p.layout == kLayoutMasked ? t.m0 + r : a_row;
        p.sfd[t.expert * p.sfd_expert_stride + int64_t(t.n_block) * p.ld_sfd + m] = s;
      }
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.d) + a_row * p.ld_d + t.n_block * 128;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x[4], y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = pack_bf16x2(v[2 * (4 * j + k)], v[2 * (4 * j + k) + 1]);
        quad_transpose(x, y);
        if (valid) *reinterpret_cast<uint4*>(out + 8 * (4 * j + q)) = make_uint4(y[0], y[1], y[2], y[3]);
      }
    }
  }
}

// SwiGLU + fp8 1x128 requant of a swapped tile (chunk 0 = the 128 gate rows, chunk 1 = the matching up
// rows, gemm_weights.h): h = silu(gate) * up per (intermediate column, token), then per token the
// amax over the tile's 128 columns (registers, then lanes of the same l % 4, then the 4 warps through
// shared memory), its scale and the e4m3 codes (as epilogue_swiglu computes them), staged as token
// rows ([BLOCK_M][128] codes) and stored 16 bytes at a time; one scale per real token.
template <class Cfg>
__device__ __forceinline__ void epilogue_swiglu_swapped(const GroupedGemmSmem<Cfg>& sm, const SwappedAcc<Cfg>& acc,
                                                        const GroupedTile& t, const GroupedGemmParams& p) {
  static_assert(Cfg::kNumChunks == 2, "gate and up chunks");
  constexpr int kM = Cfg::kBlockM, kTok = kM / 4;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32, q = lane % 4;
  uint8_t* const codes = sm.out;                                   // [kM tokens][128]
  float* const red = reinterpret_cast<float*>(sm.out + kM * 128);  // [4 warps][kM tokens]
  float v[2][kM / 2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < kM / 2; ++i) v[h][i] = swiglu(acc[0][h][i], acc[1][h][i]);
  // token s of this thread (swapped_token): registers (s / 2) * 4 + s % 2 (+ 2) of both halves
  float amax[kTok];
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int i = (s / 2) * 4 + s % 2;
    amax[s] = fmaxf(fmaxf(fmt::finite_abs(v[0][i]), fmt::finite_abs(v[0][i + 2])),
                    fmaxf(fmt::finite_abs(v[1][i]), fmt::finite_abs(v[1][i + 2])));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) amax[s] = fmaxf(amax[s], __shfl_xor_sync(0xffffffffu, amax[s], o));
  }
  ptx::named_barrier_sync(1, 128);  // the previous tile's copy-out has read the staging
  if (lane < 4) {
#pragma unroll
    for (int s = 0; s < kTok; ++s) red[warp * kM + swapped_token(s, q)] = amax[s];
  }
  ptx::named_barrier_sync(1, 128);
  float scale[kTok];
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int tok = swapped_token(s, q);
    const float a = fmaxf(fmaxf(red[tok], red[kM + tok]), fmaxf(red[2 * kM + tok], red[3 * kM + tok]));
    scale[s] = fmt::fp8_block_scale(a, p.pow2_scales != 0);
    const float inv = __frcp_rn(scale[s]);
    const int i = (s / 2) * 4 + s % 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // rows 64h + 16w + l/4 and + 8 of one token: one pair, one scale
      const uint32_t c2 = kernels::quantize_e4m3_pair(v[h][i], v[h][i + 2], scale[s], inv);
      const int row = 64 * h + 16 * warp + lane / 4;
      codes[tok * 128 + row] = uint8_t(c2 & 0xFFu);
      codes[tok * 128 + row + 8] = uint8_t(c2 >> 8);
    }
  }
  ptx::named_barrier_sync(1, 128);
#pragma unroll
  for (int idx = tid; idx < kM * 8; idx += 128) {  // kM token rows x 8 pieces of 16 bytes
    const int tok = idx / 8, piece = idx % 8;
    if (tok < t.rows)
      *reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.d) + int64_t(t.row0 + tok) * p.ld_d + t.n_block * 128 +
                                piece * 16) = ptx::lds_v4(ptx::smem_addr(codes + tok * 128 + piece * 16));
  }
  if (warp == 0 && lane < 4) {
#pragma unroll
    for (int s = 0; s < kTok; ++s) {
      const int tok = swapped_token(s, q);
      if (tok < t.rows) {
        const int64_t m = p.layout == kLayoutMasked ? t.m0 + tok : t.row0 + tok;
        p.sfd[t.expert * p.sfd_expert_stride + int64_t(t.n_block) * p.ld_sfd + m] = scale[s];
      }
    }
  }
}

// ---- the persistent kernel ---------------------------------------------------------------------------

// kTrace: the instantiation that stamps GroupedGemmParams::trace (bench tools); the other one has no
// trace code at all (its stamps cost the math loop registers and K-loop instructions).
template <class Cfg, bool kTrace>
__global__ void __launch_bounds__(Cfg::kNumThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                             const __grid_constant__ CUtensorMap tmap_sfa, const __grid_constant__ CUtensorMap tmap_d,
                             const __grid_constant__ GroupedGemmParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const GroupedGemmSmem<Cfg> sm = GroupedGemmSmem<Cfg>::carve(smem_raw, p.num_experts);
  const int wg = threadIdx.x / 128;
  uint64_t* const trace = kTrace ? p.trace + int64_t(blockIdx.x) * kTraceWordsHeader : nullptr;
  // tile t's record, or null
  const auto tile_rec = [&p](int32_t t) -> uint64_t* {
    return kTrace && t < p.trace_max_tiles
               ? p.trace + int64_t(gridDim.x) * kTraceWordsHeader + int64_t(t) * kTraceWordsPerTile
               : nullptr;
  };
  if (trace != nullptr && threadIdx.x == 0) trace[0] = kernels::globaltimer_ns();
  if (threadIdx.x == 0) {
    init_barriers<Cfg>(sm);
    ptx::tma_prefetch_desc(&tmap_a);
    ptx::tma_prefetch_desc(&tmap_b);
    if constexpr (Cfg::kFp8) ptx::tma_prefetch_desc(&tmap_sfa);
    if (p.tma_store) ptx::tma_prefetch_desc(&tmap_d);
  }
  const int num_n_blocks = p.n / Cfg::kBlockN;
  const GroupedSchedule sched = build_schedule<Cfg>(sm, p, num_n_blocks);  // ends in __syncthreads
  if constexpr (Cfg::kCluster > 1) ptx::cluster_sync();  // the partner's barriers exist before any remote use
  const int num_tiles = sched.num_tiles();
  PipeState pipe;
  if (trace != nullptr && threadIdx.x == 0) trace[1] = kernels::globaltimer_ns();

  if (wg == Cfg::kNumMathWG) {
    // Producer warpgroup: few registers; one thread issues every copy.
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kCluster > 1) {
      if (threadIdx.x % 128 == 0) {
        const auto stamp = [&](int32_t t, int word) {
          if (uint64_t* rec = tile_rec(t)) {
            if (word == 1) rec[0] = blockIdx.x + 1;
            rec[word] = kernels::globaltimer_ns();
          }
        };
        produce_cluster<Cfg>(sm, pipe, sched, p, &tmap_a, &tmap_b, &tmap_sfa, kTrace && p.probe >= 3, stamp);
        if (trace != nullptr) trace[2] = kernels::globaltimer_ns();
      }
    } else if (threadIdx.x % 128 == 0) {
      const uint64_t evict_first = ptx::createpolicy_evict_first();
      for (int32_t t = next_tile(p, -1); t < num_tiles; t = next_tile(p, t)) {
        uint64_t* const rec = tile_rec(t);
        if (rec != nullptr) {
          rec[0] = blockIdx.x + 1;
          rec[1] = kernels::globaltimer_ns();
        }
        const GroupedTile tile = sched.tile(t);
        if (kTrace && p.probe >= 3)
          produce_tile_no_loads<Cfg>(sm, pipe, t, tile, p);
        else if (p.b_evict_first != 0 && sched.num_rows[tile.expert] <= Cfg::kBlockM)
          produce_tile<Cfg, true>(sm, pipe, t, tile, p, &tmap_a, &tmap_b, &tmap_sfa, evict_first);
        else
          produce_tile<Cfg, false>(sm, pipe, t, tile, p, &tmap_a, &tmap_b, &tmap_sfa, 0);
        if (rec != nullptr) rec[2] = kernels::globaltimer_ns();
      }
      release_tile_counter(p, int32_t(gridDim.x));
      produce_end<Cfg>(sm, pipe);
      if (trace != nullptr) trace[2] = kernels::globaltimer_ns();
    }
  } else {
    ptx::setmaxnreg_inc<Cfg::kMathRegs>();
    // swapped tiles (BLOCK_M 16 / 32) hold [chunk][half][BLOCK_M / 2] accumulators, the others [chunk][64]
    using Acc = std::conditional_t<Cfg::kSwapAB, SwappedAcc<Cfg>, float[Cfg::kNumChunks][64]>;
    Acc acc;
    for (;;) {
      ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);  // the next tile's first K block (or the end)
      // Read as warp-uniform (a shuffle from lane 0). ptxas keeps the mainloop's ring position in
      // uniform registers only while this loop has no divergent exit or branch: an exit on a value
      // it must treat as per-lane, followed by code (the TMA stores' wait below), or a lane-0 branch
      // in the epilogue, cost +30 instructions per K block (measured 1.5-8% slower, session 7).
      const int4 info0 = sm.tile_info[2 * pipe.stage];
      const int32_t t = __shfl_sync(0xffffffffu, info0.x, 0);
      if (t < 0) break;
      // The tile as the producer resolved it (clusters: kLoneTile, the missing second tile of the last
      // pair, comes as a tile of no rows; a branch around a release loop for it instead cost the K loop
      // its uniform registers, +45 instructions per K block).
      const int4 info1 = sm.tile_info[2 * pipe.stage + 1];
      GroupedTile tile;
      tile.expert = info0.y;
      tile.n_block = info0.z;
      tile.row0 = info0.w;
      tile.m0 = info1.x;
      tile.rows = info1.y;
      // Timeline stamps (kTrace): every math thread writes the same word.
      if (uint64_t* rec = tile_rec(t)) rec[3] = kernels::globaltimer_ns();
      if (kTrace && p.probe == 1) {  // the weight stream alone
        for (int kb = 0; kb < p.k / Cfg::kBlockK; ++kb) {
          ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
          __syncwarp();
          release_slot<Cfg>(sm, pipe.stage, threadIdx.x % 32);
          pipe.advance(Cfg::kStages);
        }
        if (uint64_t* rec = tile_rec(t)) rec[4] = rec[5] = kernels::globaltimer_ns();
        continue;
      }
      if constexpr (Cfg::kSwapAB)
        math_tile_swapped<Cfg>(sm, pipe, p, tile, acc);
      else
        math_tile<Cfg>(sm, pipe, p, tile, wg, acc);
      if (uint64_t* rec = tile_rec(t)) rec[4] = kernels::globaltimer_ns();
      if (!(kTrace && (p.probe == 2 || p.probe == 4))) {
        const DefaultRowSink sink{p};
        if constexpr (Cfg::kSwapAB && Cfg::kEpilogue == kEpiStoreBf16)
          epilogue_store_swapped<Cfg>(sm, acc, tile, sink, p.row_weight);
        else if constexpr (Cfg::kSwapAB)
          epilogue_swiglu_swapped<Cfg>(sm, acc, tile, p);
        else if constexpr (Cfg::kEpilogue == kEpiStoreBf16)
          epilogue_store_bf16<Cfg>(sm, acc, tile, wg, sink, p.row_weight, p.tma_store ? &tmap_d : nullptr);
        else
          epilogue_swiglu<Cfg>(acc, tile, wg, p);
      }
      if (uint64_t* rec = tile_rec(t)) rec[5] = kernels::globaltimer_ns();
    }
    // The TMA stores have read their staging before the CTA's shared memory goes away (every lane:
    // a no-op where nothing was issued).
    if constexpr (Cfg::kEpilogue == kEpiStoreBf16) ptx::bulk_wait_all();
    if (trace != nullptr && threadIdx.x == 0) trace[3] = kernels::globaltimer_ns();
  }
  if constexpr (Cfg::kCluster > 1) {  // neither CTA exits while the partner may still arrive on its barriers
    __syncwarp();
    ptx::cluster_sync();
  }
#endif
}

}  // namespace megamoe::gemm

// ---- host side: one launch of one configuration (explicitly instantiated in the *_inst.cu files) ----
#if !defined(__CUDACC_RTC__)
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
namespace megamoe::gemm {

// A launch of `grid` CTAs in clusters of Cfg::kCluster along x; `attr` holds the cluster size and must
// outlive the returned configuration.
template <class Cfg>
cudaLaunchConfig_t cluster_launch_config(int grid, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(unsigned(grid));
  lc.blockDim = dim3(unsigned(Cfg::kNumThreads));
  lc.dynamicSmemBytes = smem;
  lc.stream = stream;
  *attr = cudaLaunchAttribute{};
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = Cfg::kCluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  lc.attrs = attr;
  lc.numAttrs = 1;
  return lc;
}

template <class Cfg>
cudaError_t launch_grouped_gemm_config(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b, const CUtensorMap& tmap_sfa,
                                       const CUtensorMap& tmap_d, const GroupedGemmParams& p, int grid, cudaStream_t stream,
                                       int* launched) {
  const int smem = Cfg::smem_bytes(p.num_experts);
  // invariant: the dynamic limit is raised once per configuration and device (a function attribute
  // is per device) to the largest it can need (kMaxExperts), so launches inside CUDA-graph capture
  // do no attribute changes after the first launch on a device.
  static std::mutex mutex;
  static uint64_t raised_on = 0;  // bit d: raised on CUDA device d (d < 64)
  static int max_clusters[64] = {};  // clusters of this configuration that fit on device d at once
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!(raised_on >> device & 1u)) {
      err = cudaFuncSetAttribute(sm90_grouped_gemm_kernel<Cfg, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 Cfg::smem_bytes(Cfg::kMaxExperts));
      if constexpr (Cfg::kFp8) {  // the traced kernel exists for fp8 only
        if (err == cudaSuccess)
          err = cudaFuncSetAttribute(sm90_grouped_gemm_kernel<Cfg, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     Cfg::smem_bytes(Cfg::kMaxExperts));
      }
      if (err != cudaSuccess) return err;
      if constexpr (Cfg::kCluster > 1) {
        // A persistent grid must fit at once: a cluster's CTAs need SMs of one GPC, so fewer than
        // SMs / kCluster clusters may fit.
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t lc =
            cluster_launch_config<Cfg>(Cfg::kCluster, size_t(Cfg::smem_bytes(Cfg::kMaxExperts)), nullptr, &attr);
        err = cudaOccupancyMaxActiveClusters(&max_clusters[device], sm90_grouped_gemm_kernel<Cfg, false>, &lc);
        if (err != cudaSuccess) return err;
        if (max_clusters[device] < 1) return cudaErrorInvalidConfiguration;
      }
      raised_on |= uint64_t(1) << device;
    }
  }
  if constexpr (Cfg::kCluster > 1) {  // grid: a multiple of kCluster (launch_grouped_gemm)
    grid = std::min(grid, max_clusters[device] * Cfg::kCluster);
    if (launched != nullptr) *launched = grid;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t lc = cluster_launch_config<Cfg>(grid, size_t(smem), stream, &attr);
    if (p.trace != nullptr) return cudaLaunchKernelEx(&lc, sm90_grouped_gemm_kernel<Cfg, true>, tmap_a, tmap_b, tmap_sfa, tmap_d, p);
    return cudaLaunchKernelEx(&lc, sm90_grouped_gemm_kernel<Cfg, false>, tmap_a, tmap_b, tmap_sfa, tmap_d, p);
  }
  if (launched != nullptr) *launched = grid;
  if constexpr (Cfg::kFp8) {
    if (p.trace != nullptr) {
      sm90_grouped_gemm_kernel<Cfg, true><<<grid, Cfg::kNumThreads, smem, stream>>>(tmap_a, tmap_b, tmap_sfa, tmap_d, p);
      return cudaGetLastError();
    }
  }
  sm90_grouped_gemm_kernel<Cfg, false><<<grid, Cfg::kNumThreads, smem, stream>>>(tmap_a, tmap_b, tmap_sfa, tmap_d, p);
  return cudaGetLastError();
}

// X(BLOCK_M, BLOCK_N, fp8, epilogue, cluster)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_FP8(X)   \
  X(16, 128, true, kEpiStoreBf16, 1)          \
  X(16, 256, true, kEpiStoreBf16, 1)          \
  X(16, 256, true, kEpiSwigluFp8, 1)          \
  X(32, 128, true, kEpiStoreBf16, 1)          \
  X(32, 256, true, kEpiStoreBf16, 1)          \
  X(32, 256, true, kEpiSwigluFp8, 1)          \
  X(64, 128, true, kEpiStoreBf16, 1)          \
  X(64, 256, true, kEpiStoreBf16, 1)          \
  X(128, 128, true, kEpiStoreBf16, 1)         \
  X(128, 256, true, kEpiStoreBf16, 1)         \
  X(128, 256, true, kEpiStoreBf16, 2)         \
  X(64, 256, true, kEpiSwigluFp8, 1)          \
  X(128, 256, true, kEpiSwigluFp8, 1)         \
  X(128, 256, true, kEpiSwigluFp8, 2)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_BF16(X)  \
  X(64, 128, false, kEpiStoreBf16, 1)         \
  X(64, 256, false, kEpiStoreBf16, 1)         \
  X(128, 128, false, kEpiStoreBf16, 1)        \
  X(128, 256, false, kEpiStoreBf16, 1)        \
  X(64, 256, false, kEpiSwigluBf16, 1)        \
  X(128, 256, false, kEpiSwigluBf16, 1)

#define MEGAMOE_GROUPED_GEMM_EXTERN(BM, BN, FP8, EPI, CL)                                                      \
  extern template cudaError_t launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL>>(             \
      const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const GroupedGemmParams&, int,  \
      cudaStream_t, int*);
#define MEGAMOE_GROUPED_GEMM_INSTANTIATE(BM, BN, FP8, EPI, CL)                                                 \
  template cudaError_t launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL>>(                    \
      const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const GroupedGemmParams&, int,  \
      cudaStream_t, int*);

}  // namespace megamoe::gemm
#endif
