// sm90_combine_reduce.cuh — the combine's source side as device building blocks: one token's partials
// summed in slot order in fp32 (reduce_token: bf16 / mxfp8 / nvfp4 rows, per slot or per owner rank) and the
// progress cells (publish_combine, wait_combine: see sm90_combine.cuh for their values).
#pragma once

#include "kernels/transport/sm90_combine_wire.cuh"

namespace megamoe {
namespace kernels {

// bf16 wire: one part (rounds [rb, re) of 32 8-element chunks) of token t's sum over its valid rows
// t * k + j (k: rows per token, slots or owner ranks). kRounds rounds per step: a lane has kRounds x 8
// 16-byte loads in flight (a grid with few warps per SM needs more than one round's).
template <int kRounds = 1>
__device__ __forceinline__ void reduce_bf16_part(const char* rows, int64_t wire, int64_t t, int k, uint32_t valid,
                                                 uint16_t* __restrict__ y_row, int64_t chunks, int64_t rb, int64_t re,
                                                 int lane) {
  constexpr int kSlotBatch = 8;
  for (int64_t r0 = rb; r0 < re; r0 += kRounds) {
    const StepChunks<kRounds> st(r0, re, chunks, lane);
    const int64_t(&c)[kRounds] = st.c;
    const bool(&on)[kRounds] = st.on;
    bool any = false;
#pragma unroll
    for (int u = 0; u < kRounds; ++u) any |= on[u];
    if (!any) continue;  // this lane's chunks end before the step (per lane: no shuffles below)
    float acc[kRounds][8];
#pragma unroll
    for (int u = 0; u < kRounds; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
    for (int j0 = 0; j0 < k; j0 += kSlotBatch) {
      uint4 q[kRounds][kSlotBatch];
#pragma unroll
      for (int u = 0; u < kRounds; ++u)
#pragma unroll
        for (int jj = 0; jj < kSlotBatch; ++jj) {
          const int j = j0 + jj;
          q[u][jj] = (on[u] && j < k && (valid >> j & 1u))
                         ? *reinterpret_cast<const uint4*>(rows + (t * k + j) * wire + c[u] * 16)
                         : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < kRounds; ++u)
#pragma unroll
        for (int jj = 0; jj < kSlotBatch; ++jj) {
          const int j = j0 + jj;
          if (j >= k || !(valid >> j & 1u)) continue;  // in slot order; skipped slots add nothing
          const uint32_t w[4] = {q[u][jj].x, q[u][jj].y, q[u][jj].z, q[u][jj].w};
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            acc[u][2 * m] = __fadd_rn(acc[u][2 * m], fmt::bf16_to_float(static_cast<uint16_t>(w[m] & 0xFFFFu)));
            acc[u][2 * m + 1] = __fadd_rn(acc[u][2 * m + 1], fmt::bf16_to_float(static_cast<uint16_t>(w[m] >> 16)));
          }
        }
    }
#pragma unroll
    for (int u = 0; u < kRounds; ++u)
      if (on[u]) store_bf16x8(y_row + c[u] * 8, acc[u]);  // acc's NaN is canonical (kHwNaNNote)
  }
}

// bf16 wire, the owner reduce: token t's rows t*R+r of the ranks r in `owners`, in rank order. Four
// rounds per step and two rows per batch, so a lane has 8 16-byte loads in flight with two owners
// (one round at a time gives it 2: the per-slot reduce has k).
__device__ __forceinline__ void reduce_bf16_owner_part(const char* rows, int64_t wire, int64_t t, int R, uint32_t owners,
                                                       uint16_t* __restrict__ y_row, int64_t chunks, int64_t rb,
                                                       int64_t re, int lane) {
  constexpr int kR = 4;
  for (int64_t r0 = rb; r0 < re; r0 += kR) {
    const StepChunks<kR> st(r0, re, chunks, lane);
    const int64_t(&c)[kR] = st.c;
    const bool(&on)[kR] = st.on;
    float acc[kR][8] = {};
    for (uint32_t m = owners; m != 0;) {  // warp-uniform
      const int ra = __ffs(m) - 1;
      m &= m - 1;
      const int rb2 = m != 0 ? __ffs(m) - 1 : -1;
      if (m != 0) m &= m - 1;
      uint4 qa[kR], qb[kR];
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        qa[u] = on[u] ? *reinterpret_cast<const uint4*>(rows + (t * R + ra) * wire + c[u] * 16) : make_uint4(0, 0, 0, 0);
        qb[u] = (on[u] && rb2 >= 0) ? *reinterpret_cast<const uint4*>(rows + (t * R + rb2) * wire + c[u] * 16)
                                    : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        const uint32_t wa[4] = {qa[u].x, qa[u].y, qa[u].z, qa[u].w}, wb[4] = {qb[u].x, qb[u].y, qb[u].z, qb[u].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // rank order: ra, then rb2
          acc[u][2 * q] = __fadd_rn(acc[u][2 * q], fmt::bf16_to_float(static_cast<uint16_t>(wa[q] & 0xFFFFu)));
          acc[u][2 * q + 1] = __fadd_rn(acc[u][2 * q + 1], fmt::bf16_to_float(static_cast<uint16_t>(wa[q] >> 16)));
        }
        if (rb2 < 0) continue;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[u][2 * q] = __fadd_rn(acc[u][2 * q], fmt::bf16_to_float(static_cast<uint16_t>(wb[q] & 0xFFFFu)));
          acc[u][2 * q + 1] = __fadd_rn(acc[u][2 * q + 1], fmt::bf16_to_float(static_cast<uint16_t>(wb[q] >> 16)));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kR; ++u)
      if (on[u]) store_bf16x8(y_row + c[u] * 8, acc[u]);
  }
}

// Token t's valid slots summed in slot order (fp32) into y (kOwner: the rows of the owner ranks of
// its valid slots, in rank order): rounds [rb, re) (combine_reduce_rounds) of the row, kBf16Rounds
// per step on the per-slot bf16 wire (reduce_bf16_part). Every rank's
// partials of the token must have arrived (the caller waited). All 32 lanes call it.
template <int kFormat, bool kOwner, int kBf16Rounds = 1>
__device__ __forceinline__ void reduce_token(const TransportArgs& a, const int32_t* __restrict__ topk_ids,
                                             uint16_t* __restrict__ y, int64_t t, int64_t rb, int64_t re, int lane) {
  const int64_t H = a.hidden(), wire = a.layout.wire_row_bytes;
  const char* rows = a.own<char>(a.layout.combine);
  int32_t my_id;
  bool my_valid;
  const int k_slots = static_cast<int>(a.top_k());
  const uint32_t valid_slots = warp_valid_slots(topk_ids + t * k_slots, k_slots, a.num_experts, lane, &my_id, &my_valid);
  // k: combine rows per token; valid: the ones this token has
  const int k = kOwner ? a.sig.num_ranks : k_slots;
  const uint32_t valid =
      kOwner ? __reduce_or_sync(0xFFFFFFFFu, my_valid ? 1u << a.el_div.div(static_cast<uint32_t>(my_id)) : 0u) : valid_slots;
  if constexpr (kFormat == kWsBf16) {
    if constexpr (kOwner) reduce_bf16_owner_part(rows, wire, t, k, valid, y + t * H, H / 8, rb, re, lane);
    else reduce_bf16_part<kBf16Rounds>(rows, wire, t, k, valid, y + t * H, H / 8, rb, re, lane);
  } else {
    // 16-element chunks c of rounds [rb, re); up to 8 slots' codes and scales loaded before they are
    // summed in slot order (one slot at a time is a chain of dependent loads: 174 us for one token).
    constexpr int kSlotBatch = 8;
    const int64_t chunks = H / 16, c_end = re * 32 < chunks ? re * 32 : chunks;
    for (int64_t c = rb * 32 + lane; c < c_end; c += 32) {
      float acc[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] = 0.f;
      for (int j0 = 0; j0 < k; j0 += kSlotBatch) {
        uint4 q[kSlotBatch];
        float sc[kSlotBatch];
#pragma unroll
        for (int jj = 0; jj < kSlotBatch; ++jj) {
          const int j = j0 + jj;
          const bool on = j < k && (valid >> j & 1u);
          const char* row = rows + (t * k + j) * wire;
          q[jj] = make_uint4(0, 0, 0, 0);
          sc[jj] = 0.f;
          if (on) {
            if constexpr (kFormat == kWsMxfp8) {
              if (wire % 16 == 0) {  // rows 16-byte aligned (H % 512 == 0); else 4-byte aligned
                q[jj] = *reinterpret_cast<const uint4*>(row + c * 16);
              } else {
                const uint32_t* p = reinterpret_cast<const uint32_t*>(row + c * 16);
                q[jj] = make_uint4(p[0], p[1], p[2], p[3]);
              }
              sc[jj] = fmt::e8m0_to_float(static_cast<uint8_t>(row[H + c / 2]));
            } else {  // nvfp4 rows (9H/16 + 4 bytes) are only 4-byte aligned
              const uint32_t* p = reinterpret_cast<const uint32_t*>(row + c * 8);
              q[jj].x = p[0];
              q[jj].y = p[1];
              sc[jj] = fmt::nvfp4_block_divisor(static_cast<uint8_t>(row[H / 2 + c]),
                                                *reinterpret_cast<const float*>(row + H / 2 + H / 16));
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kSlotBatch; ++jj) {
          const int j = j0 + jj;
          if (j >= k || !(valid >> j & 1u)) continue;  // in slot order; skipped slots add nothing
          const uint32_t w[4] = {q[jj].x, q[jj].y, q[jj].z, q[jj].w};
          if constexpr (kFormat == kWsMxfp8) {
#pragma unroll
            for (int m = 0; m < 8; ++m) {  // the codec's values (a NaN code: the product is the canonical NaN)
              const float2 f = e4m3x2_to_float2(static_cast<uint16_t>(w[m / 2] >> (16 * (m & 1))));
              acc[2 * m] = __fadd_rn(acc[2 * m], __fmul_rn(f.x, sc[jj]));  // = fmt::mul_rn (kHwNaNNote)
              acc[2 * m + 1] = __fadd_rn(acc[2 * m + 1], __fmul_rn(f.y, sc[jj]));
            }
          } else {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
              for (int b = 0; b < 8; ++b)
                acc[8 * m + b] = __fadd_rn(acc[8 * m + b],
                                           __fmul_rn(fmt::e2m1_to_float(static_cast<uint8_t>((w[m] >> (4 * b)) & 0xFu)), sc[jj]));
          }
        }
      }
      uint32_t o[8];
#pragma unroll
      for (int m = 0; m < 8; ++m)
        o[m] = cvt_bf16x2(acc[2 * m], acc[2 * m + 1]);  // acc's NaN is canonical (kHwNaNNote)
      st_v4(y + t * H + c * 16, make_uint4(o[0], o[1], o[2], o[3]));
      st_v4(y + t * H + c * 16 + 8, make_uint4(o[4], o[5], o[6], o[7]));
    }
  }
}

// Every token, as (token, part) items over the grid's warps.
template <int kFormat, bool kOwner>
__device__ __forceinline__ void combine_reduce_tokens(const TransportArgs& a, const int32_t* __restrict__ topk_ids,
                                                      uint16_t* __restrict__ y, int parts) {
  const int lane = threadIdx.x & 31;
  const int64_t rounds = combine_reduce_rounds(kFormat, a.hidden());
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // 32-bit item arithmetic: num_tokens * parts < 2^31 (T <= 65535, parts <= the row's rounds).
  const uint32_t uparts = static_cast<uint32_t>(parts), urounds = static_cast<uint32_t>(rounds);
  for (int64_t item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < a.num_tokens * parts; item += warps) {
    const uint32_t t = static_cast<uint32_t>(item) / uparts;
    const uint32_t part = static_cast<uint32_t>(item) - t * uparts;
    reduce_token<kFormat, kOwner>(a, topk_ids, y, t, urounds * part / uparts, urounds * (part + 1) / uparts, lane);
  }
}

// Progress cell values: combine_progress() (sm90_launch.h).

// Sets [me][kSlotCombine] in every rank's copy to (epoch, bound(s)) for source s, with release
// semantics: one fence, then relaxed stores (as signal_all_ranks). Stores, not a max: the cell runs
// forwards modulo 2^64 (cell_position), which a max would not follow across the wrap.
// invariant: one rank's publishes of one epoch are ordered (one publisher, or the groups' publishers
// in group order: combine_kernel), and epoch e + 1's come after every rank has seen epoch e's (its
// dispatch needs theirs), so every cell only runs forwards.
template <typename Bound>
__device__ __forceinline__ void publish_combine(const SignalCtx& sig, uint64_t epoch, Bound bound) {
  fence_acq_rel_sys();
  for (int s = 0; s < sig.num_ranks; ++s)
    st_relaxed_sys(sig.peer_cell(s, sig.rank, kSlotCombine), combine_progress(epoch, bound(s)));
}

// Until owner r has published at least `bound` for this rank (this epoch). One thread.
__device__ __forceinline__ bool wait_combine(const SignalCtx& sig, int r, uint64_t epoch, uint64_t bound,
                                             uint32_t sleep_ns = 0) {
  return wait_for_range(sig, sig.own_cell(r, kSlotCombine), combine_progress(epoch, bound),
                        combine_progress(epoch + 1, 0), kStageCombineDone, r, kCombineBoundBits, sleep_ns);
}

__device__ __forceinline__ bool wait_combine_all(const SignalCtx& sig, uint64_t epoch) {
  for (int r = 0; r < sig.num_ranks; ++r)
    if (!wait_combine(sig, r, epoch, kCombineAllRows)) return false;
  return true;
}

}  // namespace kernels
}  // namespace megamoe
