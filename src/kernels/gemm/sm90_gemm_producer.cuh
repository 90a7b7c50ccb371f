// sm90_gemm_producer.cuh — the grouped GEMM's TMA producer: one thread loads every K block of a tile into the
// ring (produce_tile), the end marker, the tile order, and the clusters-of-2 producer (device building blocks).
#pragma once

#include "kernels/gemm/sm90_gemm_config.cuh"

namespace megamoe::gemm {

// ---- producer ------------------------------------------------------------------------------------

// Publishes tile `tile_id` (= t) in ring slot `stage` (its first K block); the slot's full barrier
// arrival that follows releases it to the math warpgroups.
template <class Cfg>
__device__ __forceinline__ void publish_tile(const GroupedGemmSmem<Cfg>& sm, int stage, int32_t tile_id,
                                             const GroupedTile& t) {
  sm.tile_info[2 * stage] = make_int4(tile_id, t.expert, t.n_block, t.row0);
  sm.tile_info[2 * stage + 1] = make_int4(t.m0, t.rows, 0, 0);
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
#pragma unroll
    for (int j = 0; j < Cfg::kASubTiles; ++j)  // nvfp4: two 64-column bf16 boxes per K block
      ptx::tma_load_2d(sm.a + pipe.stage * Cfg::kStageA + j * Cfg::kBlockM * Cfg::kBlockKBytes, tmap_a, full,
                       (kb * Cfg::kASubTiles + j) * Cfg::kBlockKBytes, t.row0);
    if constexpr (Cfg::kWeightFp4) {
      // The tile's BLOCK_N / 64 pieces of K block kb: one contiguous run ([E][K / BLOCK_K][N/64] pieces).
      const int64_t piece = (int64_t(t.expert) * num_kb + kb) * (p.n / 64) + t.n_block * (Cfg::kBlockN / 64);
      const uint8_t* pieces = Cfg::kWeightMxfp4 ? mxfp4_pieces(p) : nvfp4_pieces(p);
      ptx::bulk_load_1d(sm.b + pipe.stage * Cfg::kStageB, pieces + piece * Cfg::kPieceBytes, Cfg::kStageB, full);
    } else if constexpr (kEvictFirst) {
      ptx::tma_load_2d_hint(sm.b + pipe.stage * Cfg::kStageB, tmap_b, full, kb * Cfg::kBlockKBytes, b_row, b_policy);
    } else {
      ptx::tma_load_2d(sm.b + pipe.stage * Cfg::kStageB, tmap_b, full, kb * Cfg::kBlockKBytes, b_row);
    }
    if constexpr (Cfg::kFp8) {
      const int32_t sfa_x = sfa_box_start(p, t);
      const int32_t sfa_y = p.layout == GroupedLayout::kMasked ? t.expert * num_kb + kb : kb;
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
#pragma unroll
    for (int j = 0; j < Cfg::kASubTiles; ++j)  // nvfp4: two 64-column bf16 boxes per K block
      ptx::tma_load_2d(sm.a + pipe.stage * Cfg::kStageA + j * Cfg::kBlockM * Cfg::kBlockKBytes, tmap_a, full,
                       (kb * Cfg::kASubTiles + j) * Cfg::kBlockKBytes, t.row0);
    uint8_t* const b = sm.b + pipe.stage * Cfg::kStageB;
    if constexpr (kShared) {
      ptx::tma_load_2d_multicast(b + rank * kHalf * Cfg::kBlockKBytes, tmap_b, full, kb * Cfg::kBlockKBytes,
                                 b_row + int32_t(rank) * kHalf, uint16_t((1u << Cfg::kCluster) - 1u));
    } else {
#pragma unroll
      for (int h = 0; h < Cfg::kCluster; ++h)
        ptx::tma_load_2d(b + h * kHalf * Cfg::kBlockKBytes, tmap_b, full, kb * Cfg::kBlockKBytes, b_row + h * kHalf);
    }
    const int32_t sfa_y = p.layout == GroupedLayout::kMasked ? t.expert * num_kb + kb : kb;
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

}  // namespace megamoe::gemm
