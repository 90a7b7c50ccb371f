// sm90_mega_kernel.cuh — the MegaMoE forward as one persistent kernel (sm_90a): dispatch, expert-pool
// placement, FC1 + SwiGLU, FC2 and combine in one cooperative launch, one CTA per SM.
//
// Roles and phases (BLOCK_M 128: 3 warpgroups; 16 and 64: 2):
//   prologue, every thread (the launch's register budget; shared memory aliases the GEMM's B ring):
//     dispatch   the transport's device code (dispatch_layout / dispatch_part): each token once per
//                destination rank into row me*T_max + i of the owner's recv_tokens / recv_scales /
//                recv_meta; the chunk's valid slots are counted per expert (shared histogram) and added
//                to the owners' count bank [epoch & 1][me][e] (system-scope reductions, remote). Each
//                CTA then fences and adds its share to [me][dispatch] in every rank (shares of a launch
//                sum to 2^32) and waits (bounded) until every source's share is complete here (B1).
//                B1 is also this rank's grid barrier: its own cell completes only once all its CTAs
//                have signalled.
//     placement  every CTA sums the count bank into per-expert totals and offsets (shared memory);
//                a warp per recv row claims its k slots' pool rows at once (lane j: offsets[e_j] +
//                atomicAdd(fill[e_j])), reads the row once and stores it expert-major into each, with
//                its scales written M-major (pool_x_scales[kb * ld_pool + p]: FC1 reads them by TMA as
//                they are, no transpose kernel), and where FC2's partial goes (pool_dst, pool_weight;
//                nvfp4 weights: the weight times the expert's w2 global scale);
//                then each CTA adds its placed rows per expert to expert_placed[e] (one release per
//                CTA: a fence per row serialised the copies). No grid barrier: every CTA has the counts, builds the GEMMs' scheduler
//                tables from them in shared memory and starts its tiles; an FC1 tile waits for its own
//                expert's rows only. Meanwhile each CTA's first FC1 weight tile is prefetched into L2.
//   GEMM (warp-specialised from here on; setmaxnreg as the grouped GEMM):
//     producer   one thread takes tiles u = 0, 1, ... from the tile counter (CTA i's first is i):
//                u < T1 is FC1 tile u, else FC2 tile u - T1; before an expert's first FC1 tile it waits
//                (bounded, abort-aware) until expert_placed[e] reaches the expert's rows, then a global
//                proxy fence; before an FC2 tile it waits (bounded,
//                abort-aware) until every FC1 n-block of its m-block is done (fc1_done[mb] ==
//                nb1 * math warps), then a global proxy fence so TMA reads what generic stores wrote;
//                then produce_tile (the grouped GEMM's building block). After the last: the end marker.
//     math       math_tile with FC1's or FC2's parameters, then epilogue_swiglu (h + scales into the
//                intermediate pool; each warp then bumps fc1_done[mb] once, release) or
//                epilogue_store_bf16 (FC2: the weighted bf16 partial of each pool row into its source
//                rank's combine row, through the LSA pointers: the routed FC2's sink). After the end
//                marker: a CTA ticket; the last CTA publishes "all rows" to every source (the
//                transport's combine progress cell); every CTA waits (bounded) for every owner's and
//                sums its share of this rank's tokens in slot order in fp32 (reduce_token).
//
// Deadlock freedom (every CTA resident: a cooperative launch, grid <= SMs or the rank's SM budget):
// tiles go out in increasing order and each CTA's tiles increase, so a tile only waits on tiles
// handed out before it. Take the smallest tile u whose math never completes. Every earlier tile of
// its CTA completed, so the ring slots they held were released and the producer reaches u; u's
// dependencies (FC1 tiles of its m-block, all < T1 <= u) completed, so the producer issues u's loads
// (it has issued every load of its CTA's earlier tiles before it blocks); the math warpgroups then
// finish u (its epilogue waits on nothing). Contradiction: every tile completes, then every CTA
// reaches the ticket. The FC1 tiles' wait for placed rows depends on no tile: every CTA places its
// share of the rows in its prologue, before its first tile, so every expert_placed count completes. A producer whose wait fails (timeout, abort) still posts the end marker, so
// its math warpgroups leave the ring and nothing inside the CTA hangs.
//
// Counters: the cross-rank cells are the transport's (epoch-tagged, only grow, compared with the
// epoch); local ones are zero at rest: fill, placed and fc1_done are zeroed in the prologue before B1
// (which every CTA of the rank passes only once all of them signalled) and used after it, the grid barrier, the tile counter and the CTA ticket return to zero with their last user.
// The count bank [(epoch + 1) & 1] is zeroed here for the next launch: its sources write it only after
// this rank's combine signal of this launch, which follows the zeroing. No host reset, no exit barrier.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/sm90_clock.cuh"
#include "kernels/gemm/sm90_gemm_config.cuh"
#include "kernels/gemm/sm90_gemm_epilogue.cuh"
#include "kernels/gemm/sm90_gemm_math.cuh"
#include "kernels/gemm/sm90_gemm_producer.cuh"
#include "kernels/mega/mega_schedule.h"
#include "kernels/transport/sm90_combine_reduce.cuh"
#include "kernels/transport/sm90_combine_wire.cuh"
#include "kernels/transport/sm90_dispatch.cuh"

namespace megamoe::mega {

using kernels::SignalCtx;
using kernels::TransportArgs;

// Timeline words per CTA (MegaArgs::trace, bench builds), %globaltimer ns.
enum MegaTraceWord : int {
  kTraceStart = 0,
  kTraceDispatched = 1,  // B1 passed: every source's rows are here
  kTracePlaced = 2,      // this CTA placed its share of the rows
  kTraceFc1Done = 3,     // this CTA's last FC1 epilogue finished (0: none)
  kTraceGemmDone = 4,    // the math warpgroups saw the end marker
  kTraceCombineIn = 5,   // every owner's partials of this rank's tokens are here
  kTraceDone = 6,        // this CTA's reduce finished
  kMegaTraceWords = 8,
};

// Local counters of one layer's launches (zero at rest; see the header).
struct MegaCounters {
  uint32_t bar_arrived;     // grid barrier: CTAs arrived at the current one (the last arriver resets it)
  uint32_t bar_generation;  // grid barrier: barriers completed (only grows; waiters compare for change)
  uint64_t done_ticket;     // CTAs whose math warpgroups finished every tile (the last resets it)
  int32_t tile_counter[2];  // GroupedGemmParams::tile_counter ({next tile, CTAs done}; the last resets it)
  int32_t pad[2];
};

struct MegaArgs {
  TransportArgs tr;               // signals, workspace layout, pool_dst / pool_weight, input status
  const void* x;                  // [T, H] bf16 or e4m3
  const float* x_scale;           // [T, H/128] with an e4m3 x
  const int32_t* topk_ids;        // [T, k]
  const float* topk_weights;      // [T, k]
  uint16_t* y;                    // [T, H] bf16
  int32_t dispatch_mode;          // kernels::DispatchMode
  int32_t tokens_per_cta;         // dispatch chunk (<= threads)
  int32_t dispatch_parts;         // work items per token
  int32_t reduce_parts;           // (token, part) items of the reduce
  // 0: FC2's epilogue writes each row's weighted bf16 partial into its source's combine row (bf16
  // wire, one row per slot). 1: FC2 writes unweighted bf16 rows into expert_out, and after every
  // CTA's FC2 (a grid barrier) the math warps send them in the combine wire's format (combine_format;
  // with the owner reduce, one fp32 sum of a token's local slots per (token, owner)): the transport's
  // encoders (sm90_combine_wire.cuh).
  int32_t staged;
  int32_t send_parts;             // staged: (row or token, part) items of the send
  uint16_t* expert_out;           // staged: [P, H] bf16 (local)
  float output_scale;             // the routing weights used are fp32(output_scale * w), as routed's
  void* expert_counts;            // EPLB: [E_l] int32 or int64 += rows each local expert received; null
  int32_t counts_int64;
  int64_t ld_pool;                // M-major stride of pool_x_scales and intermediate_scales (rows)
  MegaCounters* ctr;
  int32_t* expert_fill;           // [E_l]: rows claimed (their pool slot) per local expert
  int32_t* expert_placed;         // [E_l]: rows copied into the pool per local expert
  int32_t* fc1_done;              // [max_m_blocks]
  int32_t max_m_blocks;
  // In-kernel FC2 reduce (bf16 wire, not staged; sm90_mega_kernel's kFc2Reduce variant): FC2's
  // epilogue adds each pool row's weighted bf16 partial into its source's accumulation row (the
  // combine region, [T_max, H] bf16, zero at rest) with bf16x2 reductions; after every owner's "all
  // rows" the source copies its rows to y and zeroes them.
  int32_t fc2_reduce;
  uint64_t* trace;                // [grid][kMegaTraceWords] or null
  // nvfp4 weights: w2's fp32 global scale per local expert [E_l], folded into each pool row's weight
  // at placement (fp32(fp32(output_scale * w) * s[e]), as the routed pool build); null otherwise.
  const float* w2_expert_scale;
};

// Stage ids of the kernel's own waits (the transport's are kStageDispatchDone / kStageCombineDone).
constexpr int32_t kStageGridBarrier = kernels::kStageMegaGrid;
constexpr int32_t kStageFc1Rows = kernels::kStageMegaFc1;
constexpr int32_t kStageRowsPlaced = kernels::kStageMegaPlaced;

__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int32_t ld_acquire_gpu_s32(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void red_add_relaxed_gpu_s32(int32_t* p, int32_t v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Lane 0's value in every lane, as one opaque shuffle (the compiler cannot split a select around it).
__device__ __forceinline__ int32_t warp_broadcast(int32_t v) {
  int32_t r;
  asm volatile("shfl.sync.idx.b32 %0, %1, 0, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}

// *p += v (relaxed, gpu scope) where pred holds: a predicated instruction, no branch.
__device__ __forceinline__ void red_add_relaxed_gpu_s32_if(bool pred, int32_t* p, int32_t v) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %0, 0;\n @q red.relaxed.gpu.global.add.s32 [%1], %2;\n}\n" ::"r"(int(pred)),
      "l"(p), "r"(v)
      : "memory");
}
__device__ __forceinline__ void red_add_relaxed_sys_s32(int32_t* p, int32_t v) {
  asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Polls `ready()` (one thread) until it holds, bounded by the transport's timeout and aborted when a
// rank raised its abort cell; a failure is recorded (stage, peer = this rank, expected, seen()) and
// this rank's abort raised. Returns whether it held.
template <class Ready, class Seen>
__device__ __forceinline__ bool wait_local(const SignalCtx& sig, int32_t stage, uint64_t expected, const Ready& ready,
                                           const Seen& seen) {
  if (ready()) return true;
  const uint64_t start = kernels::globaltimer_ns();
  for (uint32_t iter = 1;; ++iter) {
    if (ready()) return true;
    if ((iter & 63u) == 0) {
      const int aborter = kernels::first_aborter(sig);
      if (aborter >= 0) {
        kernels::record_wait_error(sig, kernels::kWaitPeerAbort, stage, aborter, expected, seen());
        return false;
      }
      if (kernels::globaltimer_ns() - start > static_cast<uint64_t>(sig.timeout_ns)) {
        kernels::record_wait_error(sig, kernels::kWaitTimeout, stage, sig.rank, expected, seen());
        kernels::raise_abort(sig, stage);
        return false;
      }
      if (iter > 4096) __nanosleep(128);
    }
  }
}

// Grid barrier of one launch's CTAs (the threads cta_sync() covers call it, thread 0 among them; all
// CTAs resident). Thread 0
// arrives (acq_rel: the CTA's writes before the barrier are released, the last arriver acquires them
// all) and waits for the generation to move; the last arriver resets the count and bumps the
// generation (release). Bounded: false after a timeout or an abort (recorded).
template <class CtaSync>
__device__ __forceinline__ bool grid_barrier(MegaCounters* c, const SignalCtx& sig, bool* s_ok, const CtaSync& cta_sync) {
  cta_sync();
  if (threadIdx.x == 0) {
    const uint32_t gen = ld_acquire_gpu_u32(&c->bar_generation);  // read before arriving
    bool ok = true;
    fence_acq_rel_gpu();
    if (atomicAdd(&c->bar_arrived, 1u) == gridDim.x - 1) {
      c->bar_arrived = 0;  // the next barrier's arrivals follow the generation bump below
      fence_acq_rel_gpu();
      atomicAdd(&c->bar_generation, 1u);
    } else {
      ok = wait_local(
          sig, kStageGridBarrier, gen + 1u, [&] { return ld_acquire_gpu_u32(&c->bar_generation) != gen; },
          [&] { return uint64_t(ld_acquire_gpu_u32(&c->bar_generation)); });
    }
    *s_ok = ok;
  }
  cta_sync();
  return *s_ok;
}
// ... of every thread of the CTA.
__device__ __forceinline__ bool grid_barrier(MegaCounters* c, const SignalCtx& sig, bool* s_ok) {
  return grid_barrier(c, sig, s_ok, [] { __syncthreads(); });
}

// Shared memory of the prologue (aliases the GEMM's B ring, which TMA fills only afterwards).
template <int kThreads>
struct MegaPrologueSmem {
  kernels::DispatchSmemT<kThreads> dispatch;
  int32_t hist[kMegaMaxExperts];             // this chunk's valid slots per global expert
  int32_t counts[kMegaMaxLocalExperts];      // rows per local expert (every source)
  int32_t offsets[kMegaMaxLocalExperts + 1]; // their exclusive prefix; [E_l] = all rows
  int32_t m_blocks[kMegaMaxLocalExperts + 1];  // exclusive prefix of the experts' m-blocks (the weight prefetch)
  int32_t placed[kMegaMaxLocalExperts];     // rows this CTA placed per local expert
  int32_t src_start[kernels::kMaxTransportRanks + 1];  // recv rows of the sources before s
  bool ok;
};

// 16-byte pieces per lane a placing warp holds of its row (8: a 4096-byte row in one batch).
constexpr int kPlaceBatch = 8;

// Exclusive prefix of counts[0, n) into offsets[0, n] by warp 0 (32 at a time); on return every lane
// of the warp sees all of offsets (the __syncwarp orders the other lanes' stores before its reads).
__device__ __forceinline__ void warp_exclusive_scan(const int32_t* counts, int32_t* offsets, int n, int lane) {
  int32_t carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int32_t c = base + lane < n ? counts[base + lane] : 0;
    int32_t v = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += up;
    }
    if (base + lane < n) offsets[base + lane] = carry + v - c;
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
  if (lane == 0) offsets[n] = carry;
  __syncwarp();
}

// The dispatch of this rank's tokens (every thread). Returns after this CTA's signal left.
template <int kThreads, int kMode>
__device__ __forceinline__ void mega_dispatch_copy(const MegaArgs& a, MegaPrologueSmem<kThreads>& s, int64_t t_lo,
                                                   int64_t t_hi) {
  const int lane = threadIdx.x & 31;
  const int items = (t_hi > t_lo ? static_cast<int>(t_hi - t_lo) : 0) * a.dispatch_parts;
  for (int i = threadIdx.x / 32; i < items; i += kThreads / 32) {
    const int ct = i / a.dispatch_parts, part = i % a.dispatch_parts;
    kernels::dispatch_part<kMode>(a.tr, s.dispatch.peer_base, s.dispatch.rows[ct], t_lo + ct, part, a.dispatch_parts,
                                  a.x, a.x_scale, a.topk_ids, a.topk_weights, lane);
  }
}

// What the prologue needs to prefetch this CTA's first FC1 weight tile into L2 while the rows are
// placed (HBM is otherwise idle then: decode's forward is mostly that weight stream).
struct MegaWeightPrefetch {
  const CUtensorMap* tmap_b1;  // FC1's weights, boxes of 128 bytes x BLOCK_N rows
  int32_t n, k;                // FC1's N (2I) and K (H) in elements
  int32_t block_k_bytes;       // 128
  int32_t block_k;             // elements per K block (128 fp8, 64 bf16)
  const uint8_t* fp4_pieces;   // mxfp4 weights: FC1's pieces (gemm_weights.h's layout), read by bulk copies
};
// Where the prologue writes the GEMMs' scheduler tables (the carve's, as build_schedule would).
struct MegaTables {
  int32_t* row_begin;       // [E_l]
  int32_t* num_rows;        // [E_l]
  int32_t* m_block_prefix;  // [E_l + 1]
};

// K blocks of the first tile prefetched per CTA: 6 x 32 KiB x 132 CTAs ~ 25 MiB, half of L2.
constexpr int kMegaPrefetchKBlocks = 6;

// Prologue: dispatch (B1), placement (each row counted in expert_placed as it lands) and the
// scheduler tables (`tables`' arrays, from the counts). Returns false when this CTA's dispatch wait
// failed (recorded; its abort makes every other wait of the group give up promptly). kWeightFp4: FC1's
// weights are mxfp4 pieces (the prefetch reads them by bulk prefetches, not the tensor map).
// kExpertScale (nvfp4 weights): each slot's weight times its local expert's w2 global scale
// (MegaArgs::w2_expert_scale).
template <int kThreads, bool kFp8Wire, int kBlockM, bool kWeightFp4 = false, bool kExpertScale = false>
__device__ __forceinline__ bool mega_prologue(const MegaArgs& a, MegaPrologueSmem<kThreads>& s, uint64_t epoch,
                                              const MegaWeightPrefetch& wp, const MegaTables& tables) {
  const TransportArgs& tr = a.tr;
  const SignalCtx& sig = tr.sig;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int R = sig.num_ranks;
  const int64_t El = tr.experts_per_rank(), E = tr.num_experts, k = tr.top_k(), T_max = tr.t_max();
  const uint32_t bank = static_cast<uint32_t>(epoch & 1u);
  int32_t* const counts_base = reinterpret_cast<int32_t*>(sig.own_base + tr.layout.recv_expert_counts.offset);

  // Local counters of this launch, and the next launch's count bank, zeroed before this CTA's
  // dispatch signal (so before B1 completes anywhere).
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * kThreads + tid, gthreads = int64_t(gridDim.x) * kThreads;
  for (int64_t i = gtid; i < El; i += gthreads) a.expert_fill[i] = a.expert_placed[i] = 0;
  for (int64_t i = gtid; i < a.max_m_blocks; i += gthreads) a.fc1_done[i] = 0;
  for (int64_t i = gtid; i < R * El; i += gthreads) counts_base[(bank ^ 1u) * R * El + i] = 0;
  for (int64_t e = tid; e < E; e += kThreads) s.hist[e] = 0;
  for (int64_t e = tid; e < El; e += kThreads) s.placed[e] = 0;
  if (tid < R) s.dispatch.peer_base[tid] = sig.peer_ptr(tid, 0);
  __syncthreads();

  // ---- dispatch ----
  const int64_t t_lo = static_cast<int64_t>(blockIdx.x) * a.tokens_per_cta;
  const int64_t t_hi = min(tr.num_tokens, t_lo + a.tokens_per_cta);
  int32_t* const hist = s.hist;
  kernels::dispatch_layout<kThreads>(tr, a.topk_ids, s.dispatch, t_lo, t_hi,
                                     [hist](int32_t id) { atomicAdd(&hist[id], 1); });  // ends with a barrier
  // The chunk's rows per expert into their owners' count banks.
  for (int64_t e = tid; e < E; e += kThreads) {
    const int32_t n = s.hist[e];
    if (n == 0) continue;
    const int owner = static_cast<int>(tr.el_div.div(static_cast<uint32_t>(e)));
    int32_t* cell = reinterpret_cast<int32_t*>(s.dispatch.peer_base[owner] + tr.layout.recv_expert_counts.offset) +
                    (bank * R + sig.rank) * El + (e - owner * El);
    red_add_relaxed_sys_s32(cell, n);
  }
  if constexpr (kFp8Wire) {
    if (a.dispatch_mode == kernels::kFp8Copy) mega_dispatch_copy<kThreads, kernels::kFp8Copy>(a, s, t_lo, t_hi);
    else mega_dispatch_copy<kThreads, kernels::kBf16ToFp8>(a, s, t_lo, t_hi);
  } else {
    if (a.dispatch_mode == kernels::kFp8ToBf16) mega_dispatch_copy<kThreads, kernels::kFp8ToBf16>(a, s, t_lo, t_hi);
    else mega_dispatch_copy<kThreads, kernels::kBf16Copy>(a, s, t_lo, t_hi);
  }
  // invariant: every CTA adds exactly one share, whatever happened above (as the dispatch kernel).
  __syncthreads();
  if (tid == 0) {
    kernels::fence_acq_rel_sys();
    const uint64_t share = blockIdx.x == 0 ? (1ull << 32) - (gridDim.x - 1) : 1ull;  // G shares sum to 2^32
    for (int p = 0; p < R; ++p) kernels::red_add_relaxed_sys(sig.peer_cell(p, sig.rank, kernels::kSlotDispatch), share);
    const SignalCtx local = sig;
    s.ok = kernels::wait_all_sources(local, kernels::kSlotDispatch, epoch << 32, (epoch + 1) << 32,
                                     kernels::kStageDispatchDone, 32);
    if (blockIdx.x == 0) {
      kernels::record_bad_input(tr, a.topk_ids);  // every CTA's accumulation is visible after B1
      // The launch epoch for the host and the transport's check (every CTA read it before its share).
      *reinterpret_cast<volatile uint64_t*>(sig.own_cell(sig.rank, kernels::kLocalEpoch)) = epoch;
    }
    if (a.trace != nullptr) a.trace[blockIdx.x * kMegaTraceWords + kTraceDispatched] = kernels::globaltimer_ns();
  }
  __syncthreads();
  const bool dispatched = s.ok;

  // ---- placement ----
  // Totals and offsets per local expert from every source's counts (this launch's bank), and the
  // recv rows per source.
  for (int64_t e = tid; e < El; e += kThreads) {
    int32_t n = 0;
    for (int src = 0; src < R; ++src) n += counts_base[(bank * R + src) * El + e];
    s.counts[e] = dispatched ? n : 0;
  }
  __syncthreads();
  if (warp == 0) {
    warp_exclusive_scan(s.counts, s.offsets, static_cast<int>(El), lane);
    // This CTA's first FC1 tile is tile blockIdx.x of the schedule (next_tile): its first K blocks'
    // weights into L2 now, so the tile's first loads find them (a hint: nothing depends on it).
    for (int64_t e = lane; e < El; e += 32) s.hist[e] = (s.counts[e] + kBlockM - 1) / kBlockM;  // hist is free now
    __syncwarp();
    warp_exclusive_scan(s.hist, s.m_blocks, static_cast<int>(El), lane);
    if (lane == 0 && dispatched) {
      const gemm::GroupedSchedule sched{s.offsets, s.counts, s.m_blocks, static_cast<int32_t>(El),
                                        wp.n / mega_block_n(), kBlockM};
      const int32_t t = static_cast<int32_t>(blockIdx.x);
      if (t < sched.num_tiles()) {
        const gemm::GroupedTile tile = sched.tile(t);
        const int32_t b_row = tile.expert * wp.n + tile.n_block * mega_block_n();
        const int num_kb = wp.k / wp.block_k;
        if constexpr (kWeightFp4) {  // the tile's pieces of K block kb: one run ([E][K/128][N/64])
          constexpr int64_t kPieces = mega_block_n() / gemm::kFp4SlabRows;
          for (int kb = 0; kb < num_kb && kb < kMegaPrefetchKBlocks; ++kb) {
            const int64_t piece = (int64_t(tile.expert) * num_kb + kb) * (wp.n / gemm::kFp4SlabRows) + tile.n_block * kPieces;
            gemm::ptx::bulk_prefetch_l2(wp.fp4_pieces + piece * gemm::kFp4SlabBytes,
                                        static_cast<uint32_t>(kPieces * gemm::kFp4SlabBytes));
          }
        } else {
          for (int kb = 0; kb < num_kb && kb < kMegaPrefetchKBlocks; ++kb)
            gemm::ptx::tma_prefetch_l2_2d(wp.tmap_b1, kb * wp.block_k_bytes, b_row);
        }
      }
    }
    if (lane == 0) {
      const int32_t* recv_counts = tr.own<int32_t>(tr.layout.recv_token_counts);
      int32_t acc = 0;
      s.src_start[0] = 0;
      for (int src = 0; src < R; ++src) {
        acc += dispatched ? min(max(recv_counts[src], 0), static_cast<int32_t>(T_max)) : 0;
        s.src_start[src + 1] = acc;
      }
      if (s.offsets[El] > tr.layout.pool_rows) {  // inconsistent peers: place nothing
        if (blockIdx.x == 0) tr.input_status->pool_overflow += 1;
        for (int src = 0; src <= R; ++src) s.src_start[src] = 0;
      }
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {  // expert_offsets for the staged send (read after its grid barrier)
    int32_t* offsets = tr.own<int32_t>(tr.layout.expert_offsets);
    for (int64_t e = tid; e <= El; e += kThreads) offsets[e] = s.offsets[e];
    // EPLB receive counts (the caller reads and zeroes them; launches are stream-ordered).
    if (a.expert_counts != nullptr && dispatched) {
      for (int64_t e = tid; e < El; e += kThreads) {
        if (a.counts_int64) static_cast<long long*>(a.expert_counts)[e] += s.counts[e];
        else static_cast<int32_t*>(a.expert_counts)[e] += s.counts[e];
      }
    }
  }
  const int64_t H = tr.hidden();
  const int64_t row_bytes = H * (kFp8Wire ? 1 : 2);
  const int64_t scale_cols = H / 128;
  const char* recv_x = tr.own<char>(tr.layout.recv_tokens);
  const float* recv_scales = tr.own<float>(tr.layout.recv_scales);
  char* pool_x = tr.own<char>(tr.layout.pool_x);
  float* pool_scales = tr.own<float>(tr.layout.pool_x_scales);
  const int64_t rows = s.src_start[R];
  const int64_t gwarp = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + warp;
  const int64_t gwarps = int64_t(gridDim.x) * (kThreads / 32);
  const int64_t chunks = row_bytes / 16;
  // A warp per received row: lane j < k holds slot j (its expert, claimed pool row p_j); the row is
  // read once and stored into every claimed row, so the warp has up to k x kBatch stores in flight
  // and pays the claim's round trip once per row, not once per slot.
  for (int64_t u_row = gwarp; u_row < rows; u_row += gwarps) {
    int src = 0;
    while (src + 1 < R && u_row >= s.src_start[src + 1]) ++src;
    const int64_t recv_row = src * T_max + (u_row - s.src_start[src]);
    const uint4* from = reinterpret_cast<const uint4*>(recv_x + recv_row * row_bytes);
    // The row's first batch is loaded before the claim, so the two round trips overlap.
    uint4 v[kPlaceBatch];
#pragma unroll
    for (int b = 0; b < kPlaceBatch; ++b) v[b] = lane + 32 * b < chunks ? from[lane + 32 * b] : make_uint4(0, 0, 0, 0);
    float sc[2] = {0.f, 0.f};
    if constexpr (kFp8Wire) {
      const float* fs = recv_scales + recv_row * scale_cols;
#pragma unroll
      for (int b = 0; b < 2; ++b) sc[b] = lane + 32 * b < scale_cols ? fs[lane + 32 * b] : 0.f;
    }
    int32_t* const meta = reinterpret_cast<int32_t*>(sig.own_base + tr.layout.recv_meta.offset +
                                                     recv_row * tr.layout.meta_bytes);
    // The slot's local expert, -1 when not here (never trusted blindly); the token and the slot's
    // weight are loaded with it (the claim below is the row's only dependent round trip).
    const int32_t e = lane < k ? meta[1 + lane] : -1;
    const int32_t t = meta[0];
    const int32_t w_bits = lane < k ? meta[1 + k + lane] : 0;
    const bool here = lane < k && e >= 0 && e < El;
    const int32_t idx = here ? atomicAdd(&a.expert_fill[e], 1) : 0;
    const bool claimed = here && idx < s.counts[e];
    if (here && !claimed) atomicAdd(&tr.input_status->pool_overflow, 1);  // more rows than counted
    const int32_t p = claimed ? s.offsets[e] + idx : -1;
    if (lane < k) {
      // The owner reduce's inverse map: every slot of every received row gets its pool row or -1.
      if (tr.layout.params.owner_reduce) tr.recv_pool_row[recv_row * k + lane] = p;
      if (claimed) {
        tr.pool_dst[p] = (t >= 0 && t < T_max) ? static_cast<int32_t>((src * T_max + t) * k + lane) : -1;
        // fp32(output_scale * w): the routed backend's routing prep computes the same product;
        // nvfp4: times w2's global scale of expert e, the routed pool build's second product
        float w = __fmul_rn(a.output_scale, __int_as_float(w_bits));
        if constexpr (kExpertScale) w = __fmul_rn(w, a.w2_expert_scale[e]);
        tr.pool_weight[p] = w;
        // the owner reduce's sums read the slot's weight from the row's metadata (owner_slots); every
        // wire weights FC2's rows by pool_weight or this, so w2's global scale reaches each of them
        if (tr.layout.params.owner_reduce) meta[1 + k + lane] = __float_as_int(w);
        atomicAdd(&s.placed[e], 1);
      }
    }
    const uint32_t slots = __ballot_sync(0xffffffffu, claimed);  // warp-uniform
    for (int64_t base = 0;; base += 32 * kPlaceBatch) {  // base: warp-uniform
      for (uint32_t m = slots; m != 0; m &= m - 1) {
        const int64_t pj = __shfl_sync(0xffffffffu, p, __ffs(m) - 1);
        uint4* to = reinterpret_cast<uint4*>(pool_x + pj * row_bytes);
#pragma unroll
        for (int b = 0; b < kPlaceBatch; ++b)
          if (base + lane + 32 * b < chunks) to[base + lane + 32 * b] = v[b];
      }
      if (base + 32 * kPlaceBatch >= chunks) break;
#pragma unroll
      for (int b = 0; b < kPlaceBatch; ++b) {
        const int64_t c = base + 32 * kPlaceBatch + lane + 32 * b;
        v[b] = c < chunks ? from[c] : make_uint4(0, 0, 0, 0);
      }
    }
    if constexpr (kFp8Wire) {  // M-major: FC1's TMA reads [kb][row]
      const float* fs = recv_scales + recv_row * scale_cols;
      for (uint32_t m = slots; m != 0; m &= m - 1) {
        const int64_t pj = __shfl_sync(0xffffffffu, p, __ffs(m) - 1);
#pragma unroll
        for (int b = 0; b < 2; ++b)
          if (lane + 32 * b < scale_cols) pool_scales[(lane + 32 * b) * a.ld_pool + pj] = sc[b];
        for (int64_t c = lane + 64; c < scale_cols; c += 32) pool_scales[c * a.ld_pool + pj] = fs[c];  // H > 8192
      }
    }
  }
  // This CTA's rows are in the pool: release them to the FC1 producers of their experts (every
  // thread's proxy fence for the TMA loads that read its stores, the barrier, then warp 0's one
  // gpu-scope fence, which orders every warp's stores before it, and one count per expert: a
  // fence in every warp waits for each warp's stores separately).
  fence_proxy_async_global();
  __syncthreads();
  if (warp == 0) {
    fence_acq_rel_gpu();
    for (int64_t e = lane; e < El; e += 32)
      if (s.placed[e] != 0) red_add_relaxed_gpu_s32(a.expert_placed + e, s.placed[e]);
  }
  // The GEMMs' scheduler tables from this launch's counts (the grouped GEMM builds them from
  // expert_offsets in global memory; here every CTA has them in shared memory already, so no barrier
  // is needed before its first tile: an FC1 tile waits for its own expert's rows instead).
  for (int64_t e = tid; e < El; e += kThreads) {
    tables.row_begin[e] = s.offsets[e];
    tables.num_rows[e] = s.counts[e];
  }
  for (int64_t e = tid; e <= El; e += kThreads) tables.m_block_prefix[e] = s.m_blocks[e];
  __syncthreads();
  if (a.trace != nullptr && tid == 0) a.trace[blockIdx.x * kMegaTraceWords + kTracePlaced] = kernels::globaltimer_ns();
  return dispatched;
}

// The in-kernel FC2 reduce's sink (gemm::DefaultRowSink's interface): pool row p's partial goes to
// row t of its source's accumulation region, added 8 bf16 at a time (red.add.noftz.v4.bf16x2,
// system scope: owners on other GPUs add to the same row). The adds of a row are unordered, so the
// sum is not bitwise repeatable; each add rounds once to bf16 (the cpu backend's definition).
struct MegaReduceSink {
  const MegaArgs& a;
  __device__ __forceinline__ __nv_bfloat16* row_ptr(int32_t pool_row) const {
    const int32_t dst = a.tr.pool_dst[pool_row];  // (source * T_max + token) * k + slot, -1: none
    if (dst < 0) return nullptr;
    const uint32_t k = static_cast<uint32_t>(a.tr.top_k()), t_max = static_cast<uint32_t>(a.tr.t_max());
    const uint32_t row = static_cast<uint32_t>(dst) / k;  // source * T_max + token
    const uint32_t src = row / t_max;
    return reinterpret_cast<__nv_bfloat16*>(a.tr.sig.peer_ptr(static_cast<int>(src), a.tr.layout.combine.offset)) +
           int64_t(row - src * t_max) * a.tr.hidden();
  }
  __device__ __forceinline__ void put(__nv_bfloat16* to, const uint4& v) const {
    asm volatile("red.relaxed.sys.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
  }
};

// FC2's sink: its source's combine row (the bf16 wire, gemm::DefaultRowSink with FC2's row map) or,
// kFc2Reduce, its accumulation row.
template <bool kFc2Reduce>
__device__ __forceinline__ auto fc2_sink(const MegaArgs& a, const gemm::GroupedGemmParams& p2) {
  if constexpr (kFc2Reduce) return MegaReduceSink{a};
  else return gemm::DefaultRowSink{p2};
}

// The in-kernel FC2 reduce's end: this rank's tokens' accumulation rows into y, and zeroed for the
// next launch ((token, part) items of 16-byte pieces over the grid's math warps; every owner's adds
// are in: after wait_combine_all).
__device__ __forceinline__ void mega_reduced_rows_to_y(const MegaArgs& a, int64_t warp_id, int64_t num_warps, int lane) {
  const int64_t H = a.tr.hidden(), pieces = H / 8, T = a.tr.num_tokens;
  uint4* acc = reinterpret_cast<uint4*>(a.tr.sig.own_base + a.tr.layout.combine.offset);
  uint4* y = reinterpret_cast<uint4*>(a.y);
  const int64_t parts = a.reduce_parts, per_part = (pieces + parts - 1) / parts;
  for (int64_t item = warp_id; item < T * parts; item += num_warps) {
    const int64_t tok = item / parts, p0 = (item - tok * parts) * per_part;
    const int64_t p1 = min(pieces, p0 + per_part);
    for (int64_t i = p0 + lane; i < p1; i += 32) {
      uint4* from = acc + tok * pieces + i;
      y[tok * pieces + i] = *from;
      *from = make_uint4(0, 0, 0, 0);
    }
  }
}

// Per-warp shared staging of the staged send (kMaxWarps: the most math warps a CTA has).
constexpr int kMegaMaxMathWarps = 8;
struct MegaSendSmem {
  uint8_t scales[kMegaMaxMathWarps][32];                        // a block scale row (mxfp8 / nvfp4)
  int32_t rows[kMegaMaxMathWarps][kernels::kMaxTopK];           // owner reduce: a token's local pool rows
  float weights[kMegaMaxMathWarps][kernels::kMaxTopK];          // ... and their routing weights
  int32_t start[kernels::kMaxTransportRanks + 1];               // owner reduce: received tokens per source
};

// The staged send: every pool row's weighted partial (kOwner: every received token's slot-order sum
// of them) from expert_out, encoded in kFormat, into its source's combine row; (unit, part) items
// over the grid's math warps. The transport's encoders, so the rows are the routed backend's bits.
template <int kFormat, bool kOwner>
__device__ __forceinline__ void mega_send_rows(const MegaArgs& a, MegaSendSmem& s, int64_t warp_id, int64_t num_warps,
                                               int warp, int lane) {
  const TransportArgs& tr = a.tr;
  const int R = tr.sig.num_ranks;
  const int64_t k = tr.top_k(), H = tr.hidden(), T_max = tr.t_max(), wire = tr.layout.wire_row_bytes;
  const int64_t units = kOwner ? s.start[R] : tr.own<int32_t>(tr.layout.expert_offsets)[tr.experts_per_rank()];
  const int64_t rounds = kernels::combine_send_rounds(kFormat, H);
  const uint32_t uparts = static_cast<uint32_t>(a.send_parts), urounds = static_cast<uint32_t>(rounds);
  // invariant: units * parts < 2^31 (pool rows <= R * T_max * k, parts <= the row's rounds)
  for (int64_t item = warp_id; item < units * uparts; item += num_warps) {
    const uint32_t u = static_cast<uint32_t>(item) / uparts, part = static_cast<uint32_t>(item) - u * uparts;
    const int64_t rb = urounds * part / uparts, re = urounds * (part + 1) / uparts;
    if constexpr (kOwner) {
      int src;
      uint32_t i;
      kernels::locate_recv_row(s.start, R, u, &src, &i);
      const int64_t w = src * T_max + i, t = kernels::recv_row_token(tr, w);
      if (t < 0) continue;  // warp-uniform, as n below
      const int n = kernels::owner_slots(tr, w, lane, s.rows[warp], s.weights[warp]);
      if (n == 0) continue;
      const kernels::OwnerSum<uint16_t> from{a.expert_out, H, s.rows[warp], s.weights[warp], n};
      kernels::send_row<kFormat>(tr, from, tr.sig.peer_ptr(src, tr.layout.combine.offset) + (t * R + tr.sig.rank) * wire,
                                 rb, re, lane, s.scales[warp]);
    } else {
      const int32_t dst = tr.pool_dst[u];  // (source * T_max + token) * k + slot, -1: none
      if (dst < 0) continue;
      const int64_t per_rank = T_max * k;
      const int src = static_cast<int>(dst / per_rank);
      const kernels::SlotPartial<uint16_t> from{a.expert_out + int64_t(u) * H, tr.pool_weight[u]};
      kernels::send_row<kFormat>(tr, from, tr.sig.peer_ptr(src, tr.layout.combine.offset) + (dst - src * per_rank) * wire,
                                 rb, re, lane, s.scales[warp]);
    }
  }
}

// Rounds per step of the per-slot bf16 reduce: only the math warps reduce (8 or 4 per SM, a
// combine kernel has 16), so each lane keeps 2 rounds x 8 slots of 16-byte loads in flight (4
// rounds spill at the launch bound of 168 registers).
constexpr int kMegaReduceRounds = 2;

// This rank's tokens, (token, part) items over the grid's math warps (every owner's rows are here).
template <int kFormat, bool kOwner>
__device__ __forceinline__ void mega_reduce_tokens(const MegaArgs& a, int64_t warp_id, int64_t num_warps, int lane) {
  const int64_t rounds = kernels::combine_reduce_rounds(kFormat, a.tr.hidden());
  const uint32_t uparts = static_cast<uint32_t>(a.reduce_parts), urounds = static_cast<uint32_t>(rounds);
  for (int64_t item = warp_id; item < a.tr.num_tokens * a.reduce_parts; item += num_warps) {
    const uint32_t tok = static_cast<uint32_t>(item) / uparts;
    const uint32_t part = static_cast<uint32_t>(item) - tok * uparts;
    kernels::reduce_token<kFormat, kOwner, kMegaReduceRounds>(a.tr, a.topk_ids, a.y, tok, urounds * part / uparts,
                                           urounds * (part + 1) / uparts, lane);
  }
}

// The wire format and mode as template arguments (the staged path's choice, made once per launch).
template <class F>
__device__ __forceinline__ void with_wire(int32_t format, bool owner, const F& f) {
  if (format == kWsMxfp8) {
    if (owner) f(std::integral_constant<int, kWsMxfp8>(), std::true_type());
    else f(std::integral_constant<int, kWsMxfp8>(), std::false_type());
  } else if (format == kWsNvfp4) {
    if (owner) f(std::integral_constant<int, kWsNvfp4>(), std::true_type());
    else f(std::integral_constant<int, kWsNvfp4>(), std::false_type());
  } else {
    if (owner) f(std::integral_constant<int, kWsBf16>(), std::true_type());
    else f(std::integral_constant<int, kWsBf16>(), std::false_type());
  }
}

// GroupedGemmSmem of another configuration with the same ring (FC1's SwiGLU epilogue over the FC2
// configuration's carve).
template <class To, class From>
__device__ __forceinline__ gemm::GroupedGemmSmem<To> rebind_smem(const gemm::GroupedGemmSmem<From>& s) {
  static_assert(To::kStages == From::kStages && To::kStageA == From::kStageA && To::kStageB == From::kStageB &&
                    To::kStageSFA == From::kStageSFA && To::kStageOut <= From::kStageOut,
                "the same ring and enough staging");
  gemm::GroupedGemmSmem<To> t;
  t.a = s.a;
  t.b = s.b;
  t.sfa = s.sfa;
  t.sfb = s.sfb;
  t.out = s.out;
  if constexpr (To::kWeightFp4) t.fp4_table = s.fp4_table;
  t.full = s.full;
  t.empty = s.empty;
  t.tile_info = s.tile_info;
  t.row_begin = s.row_begin;
  t.num_rows = s.num_rows;
  t.m_block_prefix = s.m_block_prefix;
  return t;
}

// Cfg: the FC2 configuration (store-bf16; the carve, producer and math of both GEMMs); Cfg1 the FC1
// configuration (SwiGLU epilogue). The combine's wire and mode are MegaArgs' (staged, format, owner);
// kFc2Reduce: the in-kernel FC2 reduce (MegaArgs::fc2_reduce), its own kernel so that the others'
// code stays as it is.
template <class Cfg, class Cfg1, bool kFc2Reduce>
__global__ void __launch_bounds__(Cfg::kNumThreads, 1)
    sm90_mega_kernel(const __grid_constant__ CUtensorMap tmap_a1, const __grid_constant__ CUtensorMap tmap_b1,
                     const __grid_constant__ CUtensorMap tmap_sfa1, const __grid_constant__ CUtensorMap tmap_a2,
                     const __grid_constant__ CUtensorMap tmap_b2, const __grid_constant__ CUtensorMap tmap_sfa2,
                     const __grid_constant__ gemm::GroupedGemmParams p1, const __grid_constant__ gemm::GroupedGemmParams p2,
                     const __grid_constant__ MegaArgs a) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Cfg::kBlockM == Cfg1::kBlockM && Cfg::kBlockN == Cfg1::kBlockN && Cfg::kFp8 == Cfg1::kFp8 &&
                    Cfg::kWeightFp4 == Cfg1::kWeightFp4,
                "one tile shape and weight format for both GEMMs");
  static_assert(Cfg::kCluster == 1 && Cfg1::kCluster == 1, "no clusters");
  constexpr int kThreads = Cfg::kNumThreads;
  constexpr int kMathWarps = Cfg::kMathThreads / 32;
  static_assert(kThreads == mega_threads(Cfg::kBlockM) && kMathWarps == mega_math_warps(Cfg::kBlockM), "mega_schedule.h");
  static_assert(kMathWarps <= kMegaMaxMathWarps, "the send's per-warp staging");
  extern __shared__ uint8_t smem_raw[];
  const gemm::GroupedGemmSmem<Cfg> sm = gemm::GroupedGemmSmem<Cfg>::carve(smem_raw, p1.num_experts);
  static_assert(sizeof(MegaPrologueSmem<kThreads>) <= Cfg::kStages * Cfg::kStageB, "the prologue fits the B ring");
  auto& ps = *reinterpret_cast<MegaPrologueSmem<kThreads>*>(sm.b);
  const SignalCtx& sig = a.tr.sig;
  uint64_t* const trace = a.trace != nullptr ? a.trace + blockIdx.x * kMegaTraceWords : nullptr;
  if (trace != nullptr && threadIdx.x == 0) trace[kTraceStart] = kernels::globaltimer_ns();
  // The launch epoch: the previous launch's + 1 (stored back by CTA 0 once every CTA has read it).
  const uint64_t epoch = sig.local_epoch() + 1;

  const MegaWeightPrefetch prefetch{&tmap_b1, p1.n, p1.k, Cfg::kBlockKBytes, Cfg::kBlockK,
                                    Cfg::kWeightFp4 ? gemm::mxfp4_pieces(p1) : nullptr};
  if constexpr (Cfg::kWeightFp4) {  // the shift table (outside the B ring; the prologue's barriers publish it)
    for (int i = threadIdx.x; i < Cfg::kFp4TableRows; i += blockDim.x) {
      uint32_t lo, hi;
      fmt::mxfp4_shift_table_row(i + fmt::kMxfp4MinShift, &lo, &hi);
      sm.fp4_table[i] = make_uint2(lo, hi);
    }
  }
  const MegaTables tables{sm.row_begin, sm.num_rows, sm.m_block_prefix};  // the carve's, not the B ring's
  gemm::GroupedSchedule sched1;
  sched1.row_begin = sm.row_begin;
  sched1.num_rows = sm.num_rows;
  sched1.m_block_prefix = sm.m_block_prefix;
  sched1.num_experts = p1.num_experts;
  sched1.num_n_blocks = p1.n / Cfg::kBlockN;
  sched1.block_m = Cfg::kBlockM;
  // nvfp4 weights (bf16 images): FC1's scaled SwiGLU, w2's global scale in the row weights.
  constexpr bool kExpertScale = Cfg1::kEpilogue == gemm::GemmEpilogue::kSwigluBf16Scaled;
  const bool ok = mega_prologue<kThreads, Cfg::kFp8, Cfg::kBlockM, Cfg::kWeightFp4, kExpertScale>(
      a, ps, epoch, prefetch, tables);  // ends with a barrier

  if (threadIdx.x == 0) {
    gemm::init_barriers<Cfg>(sm);  // after the prologue's use of the ring (its proxy fence included)
    gemm::ptx::tma_prefetch_desc(&tmap_a1);
    gemm::ptx::tma_prefetch_desc(&tmap_b1);
    gemm::ptx::tma_prefetch_desc(&tmap_a2);
    gemm::ptx::tma_prefetch_desc(&tmap_b2);
    if constexpr (Cfg::kFp8) {
      gemm::ptx::tma_prefetch_desc(&tmap_sfa1);
      gemm::ptx::tma_prefetch_desc(&tmap_sfa2);
    }
  }
  __syncthreads();  // the barriers are initialised
  gemm::GroupedSchedule sched2 = sched1;
  sched2.num_n_blocks = p2.n / Cfg::kBlockN;
  // Warp-uniform by a shuffle (values from shared memory are per-lane to ptxas; a loop exit on one
  // moves the K loop's ring position out of the uniform registers). A CTA whose dispatch wait failed
  // runs no tiles: its producer posts the end marker at once (gating the counts instead costs the K
  // loops their uniform registers too: +35 instructions); the abort it raised ends the other CTAs'
  // waits for its tiles promptly.
  const int32_t fc1_tiles = warp_broadcast(sched1.num_tiles());
  const int32_t num_tiles = fc1_tiles + warp_broadcast(sched2.num_tiles());
  const int32_t fc1_expect = sched1.num_n_blocks * kMathWarps;  // fc1_done of a complete m-block
  gemm::PipeState pipe;
  const int wg = threadIdx.x / 128;

  if (wg == Cfg::kNumMathWG) {
    gemm::ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x % 128 == 0) {
      int32_t placed_expert = -1;  // the last expert whose rows this producer saw placed
      // A failed prologue runs no tiles (the math warpgroups get the end marker at once).
      for (int32_t t = ok ? gemm::next_tile(p1, -1) : num_tiles; t < num_tiles; t = gemm::next_tile(p1, t)) {
        if (t < fc1_tiles) {
          const gemm::GroupedTile tile = sched1.tile(t);
          if (tile.expert != placed_expert) {  // the expert's rows are all in the pool (bounded wait)
            const int32_t* placed = a.expert_placed + tile.expert;
            const int32_t rows = sched1.num_rows[tile.expert];
            if (!wait_local(
                    sig, kStageRowsPlaced, uint64_t(rows), [&] { return ld_acquire_gpu_s32(placed) >= rows; },
                    [&] { return uint64_t(ld_acquire_gpu_s32(placed)); }))
              break;  // recorded and aborted; the end marker below releases the math warpgroups
            fence_proxy_async_global();  // the placement's generic stores, before these TMA loads
            placed_expert = tile.expert;
          }
          gemm::produce_tile<Cfg, false>(sm, pipe, t, tile, p1, &tmap_a1, &tmap_b1, &tmap_sfa1, 0);
        } else {
          const gemm::GroupedTile tile = sched2.tile(t - fc1_tiles);
          const int32_t mb = sched1.m_block_prefix[tile.expert] + tile.m0 / Cfg::kBlockM;
          const int32_t* done = a.fc1_done + mb;
          if (!wait_local(
                  sig, kStageFc1Rows, uint64_t(fc1_expect), [&] { return ld_acquire_gpu_s32(done) >= fc1_expect; },
                  [&] { return uint64_t(ld_acquire_gpu_s32(done)); }))
            break;  // recorded and aborted; the end marker below releases the math warpgroups
          fence_proxy_async_global();  // the FC1 epilogues' generic stores, before these TMA loads
          gemm::produce_tile<Cfg, false>(sm, pipe, t, tile, p2, &tmap_a2, &tmap_b2, &tmap_sfa2, 0);
        }
      }
      gemm::release_tile_counter(p1, int32_t(gridDim.x));
      gemm::produce_end<Cfg>(sm, pipe);
    }
  } else {
    gemm::ptx::setmaxnreg_inc<Cfg::kMathRegs>();
    using Acc = std::conditional_t<Cfg::kSwapAB, gemm::SwappedAcc<Cfg>, float[Cfg::kNumChunks][64]>;
    Acc acc;
    const int lane = threadIdx.x % 32;
    // The tile in the ring slot the next K block comes from (or the end marker: id -1). Read as
    // warp-uniform (a shuffle from lane 0): ptxas keeps the K loop's ring position in uniform
    // registers only while the tile loop has no divergent exit or branch.
    const auto next_tile_info = [&](gemm::GroupedTile* tile) {
      gemm::ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
      const int4 info0 = sm.tile_info[2 * pipe.stage];
      const int32_t t = __shfl_sync(0xffffffffu, info0.x, 0);
      const int4 info1 = sm.tile_info[2 * pipe.stage + 1];
      tile->expert = info0.y;
      tile->n_block = info0.z;
      tile->row0 = info0.w;
      tile->m0 = info1.x;
      tile->rows = info1.y;
      return t;
    };
    // Two loops, one per GEMM, each with one epilogue (a branch between the epilogues in one loop
    // cost the K loop its uniform registers): a CTA's tiles increase, so its FC1 tiles come first.
    gemm::GroupedTile tile;
    int32_t t = next_tile_info(&tile);
    for (; t >= 0 && t < fc1_tiles; t = next_tile_info(&tile)) {
      if constexpr (Cfg::kSwapAB) {
        gemm::math_tile_swapped<Cfg>(sm, pipe, p1, tile, acc);
        gemm::epilogue_swiglu_swapped<Cfg1>(rebind_smem<Cfg1>(sm), acc, tile, p1);
      } else {
        gemm::math_tile<Cfg>(sm, pipe, p1, tile, wg, acc);
        gemm::epilogue_swiglu<Cfg1>(acc, tile, wg, p1);
      }
      // This warp's rows and scales of m-block mb are stored: release them to FC2's producers (every
      // lane fences; lane 0's increment is predicated, not a branch: a lane-0 branch here moved the K
      // loop's ring position out of the uniform registers).
      fence_proxy_async_global();
      __syncwarp();
      fence_acq_rel_gpu();
      red_add_relaxed_gpu_s32_if(lane == 0, a.fc1_done + sched1.m_block_prefix[tile.expert] + tile.m0 / Cfg::kBlockM, 1);
    }
    const uint64_t fc1_last = trace != nullptr ? kernels::globaltimer_ns() : 0;
    for (; t >= 0; t = next_tile_info(&tile)) {
      const auto sink = fc2_sink<kFc2Reduce>(a, p2);
      if constexpr (Cfg::kSwapAB) {
        gemm::math_tile_swapped<Cfg>(sm, pipe, p2, tile, acc);
        gemm::epilogue_store_swapped<Cfg>(sm, acc, tile, sink, p2.row_weight);
      } else {
        gemm::math_tile<Cfg>(sm, pipe, p2, tile, wg, acc);
        gemm::epilogue_store_bf16<Cfg>(sm, acc, tile, wg, sink, p2.row_weight, nullptr);
      }
    }
    // ---- combine ----
    constexpr uint32_t kMathBarrier = 2;  // named barrier of the math threads (the epilogues use 1)
    const auto math_sync = [] { gemm::ptx::named_barrier_sync(kMathBarrier, Cfg::kMathThreads); };
    const int warp = threadIdx.x / 32;
    const int64_t warp_id = int64_t(blockIdx.x) * kMathWarps + warp, num_warps = int64_t(gridDim.x) * kMathWarps;
    const int32_t format = a.tr.layout.params.combine_format;
    const bool owner = a.tr.layout.params.owner_reduce != 0;
    __shared__ bool s_combine_ok;
    __shared__ MegaSendSmem s_send;
    if (!kFc2Reduce && a.staged) {
      // Every CTA's FC2 rows are in expert_out (the owner reduce sums rows of several CTAs' tiles).
      bool sent_ok = grid_barrier(a.ctr, sig, &s_combine_ok, math_sync);
      if (threadIdx.x == 0 && owner) kernels::recv_row_starts(a.tr, s_send.start);
      math_sync();
      if (sent_ok) {
        with_wire(format, owner, [&](auto fmt, auto own) {
          mega_send_rows<decltype(fmt)::value, decltype(own)::value>(a, s_send, warp_id, num_warps, warp, lane);
        });
      }
    }
    math_sync();  // every partial of this CTA is stored
    if (threadIdx.x == 0) {
      if (trace != nullptr) {
        trace[kTraceFc1Done] = fc1_last;
        trace[kTraceGemmDone] = kernels::globaltimer_ns();
      }
      kernels::fence_acq_rel_sys();  // this CTA's partials (local and remote), before its ticket
      if (kernels::atomic_add_acq_rel_gpu(&a.ctr->done_ticket, 1) + 1 == gridDim.x) {
        a.ctr->done_ticket = 0;  // the next launch is stream-ordered after this one
        kernels::publish_combine(sig, epoch, [](int) { return kernels::kCombineAllRows; });
      }
      const SignalCtx local = sig;
      s_combine_ok = kernels::wait_combine_all(local, epoch);
      if (trace != nullptr) trace[kTraceCombineIn] = kernels::globaltimer_ns();
    }
    math_sync();
    if (s_combine_ok) {
      if constexpr (kFc2Reduce) {
        mega_reduced_rows_to_y(a, warp_id, num_warps, lane);
      } else if (a.staged) {
        with_wire(format, owner, [&](auto fmt, auto own) {
          mega_reduce_tokens<decltype(fmt)::value, decltype(own)::value>(a, warp_id, num_warps, lane);
        });
      } else {
        mega_reduce_tokens<kWsBf16, false>(a, warp_id, num_warps, lane);
      }
    }
    if (trace != nullptr) {
      math_sync();
      if (threadIdx.x == 0) trace[kTraceDone] = kernels::globaltimer_ns();
    }
  }
#endif
}

}  // namespace megamoe::mega
