// Combine kernels of the EP transport (sm_90a).
//
// Progress cells: owner r sets [r][kSlotCombine] in source d's copy (ordered stores) to epoch << 20 |
// bound: every partial of d's tokens whose recv row at r is below `bound` is in d's combine rows;
// kCombineAllRows: all of them. A source waits for the bound its tokens need (the fused kernel, per
// token, from the rows dispatch recorded in token_rows) or for all rows.
//
// combine_send_kernel (owner; what an FC2 epilogue does, here for tests, benchmarks and backends whose
//   FC2 writes a local [pool_rows, H] buffer): partial = weight * out[p] (one fp32 multiply, weight
//   from recv_meta) for every real pool row p, encoded in the combine wire format (bf16 | mxfp8 |
//   nvfp4, fmt:: codecs) and stored through the LSA pointer into row t*k+j of the source rank's
//   combine region. Work item = (pool row, part of the row), so a small T still fills the GPU (bf16:
//   a lane loads kCombineLoadRounds 16-byte chunks before it stores them; mxfp8 / nvfp4: a lane
//   encodes one block, e4m3 by the cvt instruction). No signal here: progress is published by
//   combine_reduce_kernel, which follows in stream order (so an FC2 epilogue that writes the rows
//   itself needs nothing else).
//   Owner reduce (WorkspaceParams::owner_reduce): work item = (received token, part); the token's
//   local slots' partials (recv_pool_row, written by the pool build) summed in slot order in fp32
//   and encoded once into row t*R+me of the source's combine region: one row per (token, owner)
//   instead of one per (token, slot), k / (owners a token touches) times fewer bytes.
// combine_reduce_kernel (source): CTA 0 fences and publishes "all rows" in every rank's
//   [me][kSlotCombine] cell; every CTA waits (bounded) until all ranks have published it here; then
//   the valid slots of each token are summed in slot order in fp32 (acc starts at +0) and written as
//   bf16 (RNE). Work item = (token, part of the row), up to 8 slots' chunks loaded before they are
//   summed. Slots with ids outside [0, E) or repeated are skipped, as in dispatch. Owner reduce: the
//   rows t*R+r of the owners r of the token's valid slots, in rank order.
// combine_kernel (both in one launch, for callers with a local FC2 output; see there): with one
//   group, send, a ticket per CTA, the last publishes all rows, every CTA waits and reduces; with
//   G > 1 groups of recv rows, the rows go out group by group, each group published as its last
//   sending CTA is done, and reducing warps take the tokens in order as their rows arrive.
#pragma once

#include "kernels/common/pdl.cuh"
#include "kernels/transport/sm90_combine_reduce.cuh"
#include "kernels/transport/sm90_combine_wire.cuh"

namespace megamoe {
namespace kernels {

constexpr int kCombineThreads = 256;

// The send part: every real pool row's weighted partial (kOwner: every received token's sum of them),
// encoded, into the source rank's combine row. Ends with a CTA barrier and one system-scope fence by
// thread 0 (the CTA's rows ordered before whatever thread 0 does next: a ticket, or nothing and the
// next kernel publishes).
template <int kFormat, typename InT, bool kOwner>
__device__ __forceinline__ void combine_send_rows(const TransportArgs& a, const InT* __restrict__ expert_out, int parts) {
  constexpr int kWarps = kCombineThreads / 32;
  __shared__ char* s_peer_base[kMaxTransportRanks];
  __shared__ uint8_t s_scales[kWarps][32];
  __shared__ int32_t s_start[kMaxTransportRanks + 1];
  __shared__ int32_t s_rows[kOwner ? kWarps : 1][kMaxTopK];
  __shared__ float s_weights[kOwner ? kWarps : 1][kMaxTopK];
  const int R = a.sig.num_ranks;
  if (threadIdx.x < R) s_peer_base[threadIdx.x] = a.sig.peer_ptr(threadIdx.x, a.layout.combine.offset);
  if (kOwner && threadIdx.x == 32) recv_row_starts(a, s_start);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t k = a.top_k(), El = a.experts_per_rank(), H = a.hidden();
  const int64_t wire = a.layout.wire_row_bytes;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // items (unit, part): a unit is a pool row, or (kOwner) a received token
  const int64_t units = kOwner ? s_start[R] : a.own<int32_t>(a.layout.expert_offsets)[El];
  const int64_t rounds = combine_send_rounds(kFormat, H);
  // invariant: units * parts < 2^31 (pool rows <= R * T_max * k + padding, parts <= 7): 32-bit item
  // arithmetic.
  const uint32_t uparts = static_cast<uint32_t>(parts), urounds = static_cast<uint32_t>(rounds);
  for (int64_t item = blockIdx.x * (blockDim.x / 32) + warp; item < units * parts; item += warps) {
    const uint32_t u = static_cast<uint32_t>(item) / uparts;
    const uint32_t part = static_cast<uint32_t>(item) - u * uparts;
    const int64_t rb = urounds * part / uparts, re = urounds * (part + 1) / uparts;
    if constexpr (kOwner) {
      int s;
      uint32_t i;
      locate_recv_row(s_start, R, u, &s, &i);
      const int64_t w = s * a.t_max() + i, t = recv_row_token(a, w);
      if (t < 0) continue;  // warp-uniform, as n below
      const int n = owner_slots(a, w, lane, s_rows[warp], s_weights[warp]);
      if (n == 0) continue;
      const OwnerSum<InT> src{expert_out, H, s_rows[warp], s_weights[warp], n};
      send_row<kFormat>(a, src, s_peer_base[s] + (t * R + a.sig.rank) * wire, rb, re, lane, s_scales[warp]);
    } else {
      RowTarget rt;
      if (!row_target(a, u, &rt)) continue;
      const SlotPartial<InT> src{expert_out + static_cast<int64_t>(u) * H, rt.w};
      send_row<kFormat>(a, src, s_peer_base[rt.s] + (rt.t * k + rt.j) * wire, rb, re, lane, s_scales[warp]);
    }
  }
  // One fence per CTA, after the barrier (a fence per thread serialises).
  __syncthreads();
  if (threadIdx.x == 0) fence_acq_rel_sys();
}

// Send only: the epoch is published by combine_reduce_kernel, which follows in stream order.
template <int kFormat, typename InT, bool kOwner>
__global__ void __launch_bounds__(kCombineThreads)
    combine_send_kernel(TransportArgs a, const InT* __restrict__ expert_out, int parts) {
  pdl_enter();  // launched with launch_pdl (sm90_combine.cu)
  combine_send_rows<kFormat, InT, kOwner>(a, expert_out, parts);
}

// publishes all rows, every CTA waits (bounded) for every rank's, then reduces.
template <int kFormat, bool kOwner>
__global__ void __launch_bounds__(kCombineThreads)
    combine_reduce_kernel(TransportArgs a, const int32_t* __restrict__ topk_ids, uint16_t* __restrict__ y, int parts) {
  __shared__ bool s_ok;
  pdl_enter();  // launched with launch_pdl (sm90_combine.cu)
  if (threadIdx.x == 0) {
    const SignalCtx sig = a.sig;  // a local copy: the wait is not inlined
    const uint64_t epoch = sig.local_epoch();
    if (blockIdx.x == 0) {  // its fence covers the rows this rank sent (earlier kernels)
      zero_next_forward_counters(a);
      publish_combine(sig, epoch, [](int) { return kCombineAllRows; });
    }
    s_ok = wait_combine_all(sig, epoch);
  }
  __syncthreads();
  if (!s_ok) return;
  combine_reduce_tokens<kFormat, kOwner>(a, topk_ids, y, parts);
}


// Host-chosen shape of one combine_kernel launch.
struct CombineShape {
  int send_parts, reduce_parts;  // work items per row / per token (one group)
  int groups;                    // recv-row groups, 1 .. kMaxCombineGroups
  int reducers;                  // groups > 1: CTAs that only reduce (the last ones of the grid)
};

// Send and reduce in one launch.
// One group: each CTA sends its rows, fences and takes a ticket; the last publishes all rows (the
//   peers' reduce starts as soon as this rank's last row is out, with no kernel boundary in between);
//   every CTA then waits for every rank's and reduces, (token, part) items over the grid.
// G groups: the sending CTAs (all but the last `reducers`) send the rows of recv-row group g =
//   i * G / count_s (i: the row within source s's region, count_s its rows) for g = 0, 1, ..., each
//   CTA fencing and taking group g's ticket after it; the last taker publishes bound
//   ceil((g + 1) * count_s / G) to each source s (all rows after the last group). Reducing warps
//   (the reducers' from the start, the senders' once they are done) take tokens in order from a
//   counter, wait until every owner of the token's rows (token_rows, from dispatch) has published a
//   bound above its row, and sum the token. Rows at an owner are in token order, so early tokens
//   complete first and the reduce runs behind the sends instead of after them.
// invariant: every sending CTA takes exactly one ticket per group and every CTA one `done` ticket;
//   the last taker of each counter returns it to zero (the next launch is stream-ordered).
// invariant: the grid is co-resident (the launcher caps it at the occupancy limit and launches it
//   cooperatively: it starts only once every CTA has an SM, beside whatever else runs): waiting CTAs
//   spin until CTAs of this and the other ranks have sent, so a CTA that never got an SM would hang
//   the group (the bounded wait would report it as a timeout).
template <int kFormat, typename InT, bool kOwner>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(TransportArgs a, const InT* __restrict__ expert_out, const int32_t* __restrict__ topk_ids,
                   uint16_t* __restrict__ y, CombineShape shape) {
  __shared__ bool s_ok;
  pdl_enter();  // launched with launch_pdl (sm90_combine.cu); see pdl.cuh on co-residency
  if (blockIdx.x == 0 && threadIdx.x == 0) zero_next_forward_counters(a);
  if (shape.groups <= 1) {
    combine_send_rows<kFormat, InT, kOwner>(a, expert_out, shape.send_parts);  // ends with a barrier; thread 0 fenced
    if (threadIdx.x == 0) {
      const SignalCtx sig = a.sig;
      const uint64_t epoch = sig.local_epoch();
      uint64_t* ticket = sig.own_cell(sig.rank, kLocalCombineTicket);
      // acq_rel: the last taker's release to the peers carries every CTA's fenced rows.
      if (atomic_add_acq_rel_gpu(ticket, 1) + 1 == gridDim.x) {
        *ticket = 0;
        publish_combine(sig, epoch, [](int) { return kCombineAllRows; });
      }
      s_ok = wait_combine_all(sig, epoch);
    }
    __syncthreads();
    if (!s_ok) return;
    combine_reduce_tokens<kFormat, kOwner>(a, topk_ids, y, shape.reduce_parts);
    return;
  }

  constexpr int kWarps = kCombineThreads / 32;
  __shared__ char* s_peer_base[kMaxTransportRanks];
  __shared__ uint8_t s_scales[kWarps][32];
  __shared__ int32_t s_start[kMaxTransportRanks + 1];
  __shared__ int32_t s_rows[kOwner ? kWarps : 1][kMaxTopK];
  __shared__ float s_weights[kOwner ? kWarps : 1][kMaxTopK];
  const int R = a.sig.num_ranks, G = shape.groups;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  if (threadIdx.x < R) s_peer_base[threadIdx.x] = a.sig.peer_ptr(threadIdx.x, a.layout.combine.offset);
  if (kOwner && threadIdx.x == 32) recv_row_starts(a, s_start);
  __syncthreads();
  const uint64_t epoch = a.sig.local_epoch();
  const int64_t k = a.top_k(), El = a.experts_per_rank(), H = a.hidden(), wire = a.layout.wire_row_bytes;
  const int64_t rounds = combine_send_rounds(kFormat, H);
  const int32_t* counts = a.own<int32_t>(a.layout.recv_token_counts);  // [s]: rows source s sent here
  CombineCounters* cc = a.combine_counters;
  const int senders = static_cast<int>(gridDim.x) - shape.reducers;
  if (static_cast<int>(blockIdx.x) < senders) {
    // units: pool rows, or (kOwner) received tokens
    const int64_t units = kOwner ? s_start[R] : a.own<int32_t>(a.layout.expert_offsets)[El];
    const int64_t warp_id = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
    const int64_t warps = static_cast<int64_t>(senders) * (blockDim.x / 32);
    for (int g = 0; g < G; ++g) {
      // 32 units per warp step, one per lane, strided over the sending warps (units next to each
      // other are mostly in the same group: blocks of consecutive rows left a few warps with a whole
      // group each and the group's publish waited for them); the warp sends the step's units of
      // group g together.
      for (int64_t step = 0; warp_id + step * warps < units; step += 32) {
        const int64_t u = warp_id + (step + lane) * warps;
        RowTarget rt;  // kOwner: s and i only
        bool mine = u < units;
        if constexpr (kOwner) {
          uint32_t i = 0;
          if (mine) locate_recv_row(s_start, R, static_cast<uint32_t>(u), &rt.s, &i);
          rt.i = i;
        } else {
          mine = mine && row_target(a, u, &rt);
        }
        // group of recv row i of source s (a row past its source's count, inconsistent peers, goes
        // with the last group: still sent); 32-bit: i < T_max <= 65535, G <= 8
        if (mine)
          mine = min(static_cast<uint32_t>(rt.i) * static_cast<uint32_t>(G) / static_cast<uint32_t>(max(counts[rt.s], 1)),
                     static_cast<uint32_t>(G - 1)) == static_cast<uint32_t>(g);
        uint32_t todo = __ballot_sync(0xFFFFFFFFu, mine);
        while (todo != 0) {
          const int l = __ffs(todo) - 1;
          todo &= todo - 1;
          const int s = __shfl_sync(0xFFFFFFFFu, rt.s, l);
          if constexpr (kOwner) {
            const int64_t w = s * a.t_max() + __shfl_sync(0xFFFFFFFFu, rt.i, l), t = recv_row_token(a, w);
            if (t < 0) continue;  // warp-uniform, as n below
            const int n = owner_slots(a, w, lane, s_rows[warp], s_weights[warp]);
            if (n == 0) continue;
            const OwnerSum<InT> src{expert_out, H, s_rows[warp], s_weights[warp], n};
            send_row<kFormat>(a, src, s_peer_base[s] + (t * R + a.sig.rank) * wire, 0, rounds, lane, s_scales[warp]);
          } else {
            const int64_t row_p = __shfl_sync(0xFFFFFFFFu, u, l);
            const int64_t t = __shfl_sync(0xFFFFFFFFu, rt.t, l), j = __shfl_sync(0xFFFFFFFFu, rt.j, l);
            const SlotPartial<InT> src{expert_out + row_p * H, __shfl_sync(0xFFFFFFFFu, rt.w, l)};
            send_row<kFormat>(a, src, s_peer_base[s] + (t * k + j) * wire, 0, rounds, lane, s_scales[warp]);
          }
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        fence_acq_rel_sys();  // this CTA's group-g rows, before its ticket
        if (atomic_add_acq_rel_gpu(&cc->group_ticket[g], 1) + 1 == static_cast<uint64_t>(senders)) {
          cc->group_ticket[g] = 0;
          const SignalCtx sig = a.sig;
          const bool last = g == G - 1;
          // Group g's publish after group g - 1's (their stores to one cell must not reorder): its
          // last sender finished group g - 1 first, so that publisher is running; a local wait.
          if (g == 0 || wait_local_at_least(sig, &cc->published, static_cast<uint64_t>(g), kStageCombineDone)) {
            publish_combine(sig, epoch, [&](int s) {
              return last ? kCombineAllRows : static_cast<uint64_t>(((g + 1) * static_cast<int64_t>(counts[s]) + G - 1) / G);
            });
            fence_acq_rel_sys();  // the stores above before the next group's (through `published`)
            st_release_gpu(&cc->published, static_cast<uint64_t>(g + 1));
          }
        }
      }
    }
  }
  // Reduce: batches of kWarps tokens in order, one token per warp. Thread 0 alone waits for the
  // batch's rows (the highest row at each owner), sleeping between polls, so the cells see one
  // poller per CTA.
  __shared__ unsigned long long s_t0;
  for (;;) {
    if (threadIdx.x == 0) {
      const unsigned long long t0 = atomicAdd(&cc->next_token, static_cast<unsigned long long>(kWarps));
      s_t0 = t0;
      s_ok = true;
      if (t0 < static_cast<unsigned long long>(a.num_tokens)) {
        const int64_t t1 = min(static_cast<int64_t>(t0) + kWarps, a.num_tokens);
        const SignalCtx sig = a.sig;
        for (int r = 0; r < R && s_ok; ++r) {
          int32_t need = 0;  // rows at r below `need` hold every partial of the batch
          for (int64_t t = static_cast<int64_t>(t0); t < t1; ++t) need = max(need, a.token_rows[t * R + r] + 1);
          if (need > 0) s_ok = wait_combine(sig, r, epoch, static_cast<uint64_t>(need), 200);
        }
      }
    }
    __syncthreads();
    const int64_t t = static_cast<int64_t>(s_t0) + warp;
    const bool done = s_t0 >= static_cast<unsigned long long>(a.num_tokens) || !s_ok;
    if (!done && t < a.num_tokens) reduce_token<kFormat, kOwner>(a, topk_ids, y, t, 0, combine_reduce_rounds(kFormat, H), lane);
    __syncthreads();  // s_t0 / s_ok are rewritten
    if (done) break;
  }
  // acq_rel: the last taker sees every other CTA's last next_token increment before it resets it.
  if (threadIdx.x == 0 && atomic_add_acq_rel_gpu(reinterpret_cast<uint64_t*>(&cc->done), 1) + 1 == gridDim.x) {
    cc->next_token = 0;
    cc->done = 0;
    cc->published = 0;
  }
}


}  // namespace kernels
}  // namespace megamoe
