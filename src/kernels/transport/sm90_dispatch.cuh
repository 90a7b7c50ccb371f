// Dispatch kernel of the EP transport (sm_90a, NCCL symmetric memory, NVLink stores): the layout
// (rows, counts, id checks) and the copy fused into one launch.
//
// dispatch_kernel (grid G x 512 threads; CTA b owns tokens [b*TPC, min(T, (b+1)*TPC)), TPC <= 512):
//   layout   every CTA counts, per destination rank, the tokens before its chunk that go there
//            (redundantly: ids are read from L2, no grid-wide scan or barrier), then ranks its own
//            chunk's tokens with warp ballots: row i at destination r = the i-th token of this rank
//            sent to r, in token order (the CPU reference's compaction). The ids of the chunk are
//            checked (bad ones counted, the first recorded, treated as -1), one lane per slot. The
//            last CTA's "before" covers every other chunk, so it publishes recv_token_counts[me] in
//            every destination right there (zeros included: a rank with 0 tokens still writes them).
//            The per-expert counts are not sent: the owner derives them from the metadata rows in
//            its pool build (pool_offsets_kernel), which reads those rows anyway.
//   copy     work item = (token, part): a part is a contiguous range of 32-chunk rounds of the row,
//            so a small T still spreads over many warps. Each lane loads the next round while it
//            quantises and stores the current one (latency hiding), and sends the token once per
//            destination rank (not once per expert) to row me*T_max + i of the owner's recv_tokens
//            (+ recv_scales, + recv_meta):
//            16-byte stores for rows and metadata; a round's 4 block scales gathered into a float4
//            that one lane keeps, so a row's scales go out as one coalesced warp store.
//            bf16 -> e4m3 1x128 on the fly: e4m3(div_rn(x, s)) (quantize_e4m3_pair_div).
//   signal   each CTA fences its stores and adds its share to this source's [me][kSlotDispatch]
//            counter in every destination (the shares of one launch sum to 2^32: the counter's high
//            word counts launches), so no CTA waits for another before its signal leaves. Then it
//            takes a ticket; the last one records bad input, bumps the launch epoch and waits
//            (bounded) until every source's counter reaches epoch << 32, so when the kernel ends
//            this rank's receive regions are complete.
#pragma once

#include "kernels/common/pdl.cuh"
#include "kernels/common/sm90_quant.cuh"
#include "kernels/transport/sm90_transport_args.cuh"

namespace megamoe {
namespace kernels {

constexpr int kDispatchThreads = 512;
constexpr int kDispatchWarps = kDispatchThreads / 32;
constexpr int kMaxTokensPerCta = kDispatchThreads;  // one token per thread in the ranking pass

// Host-chosen shape of one dispatch launch (launch_dispatch): grid = ceil(T / tokens_per_cta).
struct DispatchShape {
  int tokens_per_cta;  // TPC, in [1, kMaxTokensPerCta]
  int parts;           // work items per token, in [1, rounds of the row]
};

// Destination-rank mask of a token: bit r set when a slot holds an id in [0, E) owned by rank r.
// Repeated ids map to the same rank, so this equals the mask over the valid slots only.
__device__ __forceinline__ uint32_t token_dest_mask(const int32_t* ids, int k, uint32_t E, const ExactDiv16& el_div) {
  uint32_t mask = 0;
  for (int j = 0; j < k; ++j) {
    const uint32_t id = static_cast<uint32_t>(__ldg(ids + j));
    if (id < E) mask |= 1u << el_div.div(id);  // -1 and other negatives wrap to >= E
  }
  return mask;
}

// 4 destination bits -> four 16-bit counters of one u64 (counts <= T_max <= 65535 never carry).
__device__ __forceinline__ unsigned long long spread4(uint32_t m) {
  return static_cast<unsigned long long>(m & 1u) | (static_cast<unsigned long long>(m >> 1 & 1u) << 16) |
         (static_cast<unsigned long long>(m >> 2 & 1u) << 32) | (static_cast<unsigned long long>(m >> 3 & 1u) << 48);
}

__device__ __forceinline__ uint32_t packed_count(const unsigned long long* packed, int r) {
  return static_cast<uint32_t>((packed[r >> 2] >> (16 * (r & 3))) & 0xFFFFu);
}

// Shared state of one dispatch CTA of kThreads threads (chunks of at most kThreads tokens).
template <int kThreads>
struct DispatchSmemT {
  char* peer_base[kMaxTransportRanks];
  int32_t rows[kThreads][kMaxTransportRanks];           // row at destination r of each chunk token, or -1
  unsigned long long warp_counts[kThreads / 32][2];     // per warp, packed per destination like before
  unsigned long long before[2];  // packed per-destination counts of the tokens before the chunk
  unsigned long long total[2];   // ... of the chunk's tokens
  long long first_bad;           // the chunk's first bad (token * k + slot)
  int num_bad;
  int is_last;                   // this CTA took the last ticket: it records bad input and waits
};
using DispatchSmem = DispatchSmemT<kDispatchThreads>;

// A dispatch_layout hook that does nothing with the valid slots.
struct NoSlotHook {
  __device__ __forceinline__ void operator()(int32_t /*id*/) const {}
};

// Layout part of a CTA of kThreads threads (all of them call it): s.rows for its chunk [t_lo, t_hi)
// (t_hi - t_lo <= kThreads), the chunk's id checks (bad input added to dispatch_accum for the last CTA
// to record) and per-destination totals; the grid's last CTA publishes recv_token_counts[me] in every
// destination. on_valid(id) is called once per valid slot of the chunk (a fused kernel counts rows per
// expert with it).
template <int kThreads, class OnValid = NoSlotHook>
__device__ __forceinline__ void dispatch_layout(const TransportArgs& a, const int32_t* __restrict__ topk_ids,
                                                DispatchSmemT<kThreads>& s, int64_t t_lo, int64_t t_hi,
                                                const OnValid& on_valid = OnValid()) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int k = static_cast<int>(a.top_k());
  const uint32_t E = static_cast<uint32_t>(a.num_experts);
  if (tid < 2) s.before[tid] = s.total[tid] = 0;
  if (tid == 0) {
    s.first_bad = LLONG_MAX;
    s.num_bad = 0;
  }
  __syncthreads();

  // Tokens before the chunk, per destination (redundant across CTAs; the ids come from L2). A fused
  // kernel's grid may hold CTAs past the last token (t_lo >= T): their "before" is every token.
  unsigned long long packed0 = 0, packed1 = 0;
  const int64_t t_before = t_lo < a.num_tokens ? t_lo : a.num_tokens;
#pragma unroll 4
  for (int64_t t = tid; t < t_before; t += blockDim.x) {
    const uint32_t m = token_dest_mask(topk_ids + t * k, k, E, a.el_div);
    packed0 += spread4(m & 0xFu);
    packed1 += spread4(m >> 4);
  }
  for (int o = 16; o > 0; o >>= 1) {
    packed0 += __shfl_xor_sync(0xFFFFFFFFu, packed0, o);
    packed1 += __shfl_xor_sync(0xFFFFFFFFu, packed1, o);
  }
  if (lane == 0 && (packed0 | packed1)) {
    atomicAdd(&s.before[0], packed0);
    atomicAdd(&s.before[1], packed1);
  }

  {
    // The chunk's id checks and totals. Lane l of a warp takes slot l % k of token
    // t0 + l / k (32 / k tokens per warp step, one coalesced load of their ids): a token's slots are
    // checked in parallel (__match_any_sync finds repeated ids and ranks, keyed by token) instead of
    // by one thread's chain of dependent loads.
    const int tpw = 32 / k;  // tokens per warp step (k <= kMaxTopK = 16)
    const int sub = lane / k, j = lane % k;
    const uint32_t lanes_below = (1u << lane) - 1u;
    long long first_bad = LLONG_MAX;
    int num_bad = 0;
    unsigned long long total0 = 0, total1 = 0;
    for (int64_t t0 = t_lo + static_cast<int64_t>(warp) * tpw; t0 < t_hi; t0 += static_cast<int64_t>(kWarps) * tpw) {
      const int64_t t = t0 + sub;
      const bool live = sub < tpw && t < t_hi;
      const int32_t id = live ? __ldg(topk_ids + t * k + j) : -1;
      // valid: in [0, E) and no lower slot of the same token holds the same id
      const uint32_t same = __match_any_sync(0xFFFFFFFFu, (static_cast<uint64_t>(sub) << 32) | static_cast<uint32_t>(id));
      const bool valid = live && id >= 0 && id < a.num_experts && (same & lanes_below) == 0;
      const uint32_t r = valid ? a.el_div.div(static_cast<uint32_t>(id)) : 0xFFFFFFFFu;
      // the token counts once per destination: its first valid slot of each rank
      const uint32_t same_r = __match_any_sync(0xFFFFFFFFu, (static_cast<uint64_t>(sub) << 32) | r);
      if (valid) {
        on_valid(id);
        if ((same_r & lanes_below) == 0) {
          total0 += spread4((1u << r) & 0xFu);
          total1 += spread4((1u << r) >> 4);
        }
      } else if (live && id != -1) {
        ++num_bad;
        first_bad = min(first_bad, static_cast<long long>(t * k + j));
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      total0 += __shfl_xor_sync(0xFFFFFFFFu, total0, o);
      total1 += __shfl_xor_sync(0xFFFFFFFFu, total1, o);
      num_bad += __shfl_xor_sync(0xFFFFFFFFu, num_bad, o);
      first_bad = min(first_bad, __shfl_xor_sync(0xFFFFFFFFu, first_bad, o));
    }
    if (lane == 0) {
      if (total0 | total1) {
        atomicAdd(&s.total[0], total0);
        atomicAdd(&s.total[1], total1);
      }
      if (num_bad) {
        atomicAdd(&s.num_bad, num_bad);
        atomicMin(&s.first_bad, first_bad);
      }
    }
  }

  // The chunk: thread i ranks token t_lo + i; ballots count the earlier tokens of its warp.
  const int64_t t = t_lo + tid;
  const uint32_t m = t < t_hi ? token_dest_mask(topk_ids + t * k, k, E, a.el_div) : 0u;
  uint32_t lane_before[kMaxTransportRanks];
  unsigned long long wc[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < kMaxTransportRanks; ++r) {
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, m >> r & 1u);
    lane_before[r] = __popc(ballot & ((1u << lane) - 1u));
    wc[r >> 2] |= static_cast<unsigned long long>(__popc(ballot)) << (16 * (r & 3));
  }
  if (lane == 0) {
    s.warp_counts[warp][0] = wc[0];
    s.warp_counts[warp][1] = wc[1];
  }
  __syncthreads();
  if (t < t_hi) {
    // The earlier warps' counts, every destination at once (packed 16-bit sums <= 512).
    unsigned long long earlier[2] = {s.before[0], s.before[1]};
#pragma unroll 1
    for (int w = 0; w < warp; ++w) {
      earlier[0] += s.warp_counts[w][0];
      earlier[1] += s.warp_counts[w][1];
    }
#pragma unroll
    for (int r = 0; r < kMaxTransportRanks; ++r) {
      int32_t row = -1;
      if (r < a.sig.num_ranks && (m >> r & 1u)) row = static_cast<int32_t>(packed_count(earlier, r) + lane_before[r]);
      s.rows[tid][r] = row;
      if (r < a.sig.num_ranks) a.token_rows[t * a.sig.num_ranks + r] = row;  // the fused combine's waits
    }
  }

  if (tid == 0 && s.num_bad > 0) {
    DispatchAccum* acc = a.dispatch_accum;
    atomicAdd(&acc->num_bad, s.num_bad);
    atomicMax(&acc->first_bad, ~0ull - static_cast<unsigned long long>(s.first_bad));
  }
  // The last chunk's "before" covers every other chunk: the totals are complete here. Ordered
  // before the signal by the CTA's fence like its rows.
  if (blockIdx.x == gridDim.x - 1 && tid < a.sig.num_ranks) {
    const unsigned long long total[2] = {s.before[0] + s.total[0], s.before[1] + s.total[1]};
    reinterpret_cast<int32_t*>(s.peer_base[tid] + a.layout.recv_token_counts.offset)[a.sig.rank] =
        static_cast<int32_t>(packed_count(total, tid));
  }
  __syncthreads();
}

// Calls f(r, recv_row) for every destination r the token goes to (rows[r] >= 0). Not unrolled: the
// body is the store path, and 8 copies of it at every call site make the kernel's code too large for
// the instruction cache (a launch of a few tokens then spends most of its time fetching instructions).
template <typename F>
__device__ __forceinline__ void for_each_dest(const int32_t* rows, int R, int64_t row0, F&& f) {
#pragma unroll 1
  for (int r = 0; r < kMaxTransportRanks; ++r) {
    if (r >= R) break;
    if (rows[r] >= 0) f(r, row0 + rows[r]);
  }
}

// One warp's share (rounds [rb, re) of 32 chunks, plus the metadata row for part 0) of token t.
template <int kMode>
__device__ __forceinline__ void dispatch_part(const TransportArgs& a, char* const* peer_base, const int32_t* rows,
                                              int64_t t, int part, int parts, const void* __restrict__ x,
                                              const float* __restrict__ x_scale, const int32_t* __restrict__ topk_ids,
                                              const float* __restrict__ topk_weights, int lane) {
  const int64_t H = a.hidden(), k = a.top_k(), El = a.experts_per_rank();
  const int R = a.sig.num_ranks;
  const int64_t row0 = a.sig.rank * a.t_max();
  constexpr bool kFp8Wire = (kMode == kBf16ToFp8 || kMode == kFp8Copy);
  const int64_t row_bytes = kFp8Wire ? H : 2 * H;
  const int64_t scale_cols = H / fmt::kFp8BlockSize;
  const bool scales_v4 = scale_cols % 4 == 0;  // scale rows 16-byte aligned
  const int64_t tok_off = a.layout.recv_tokens.offset, scale_off = a.layout.recv_scales.offset;
  // Chunk = one lane's 16 wire bytes (8 for fp8 -> bf16's input); a round = 32 chunks.
  const int64_t chunks = (kMode == kFp8ToBf16 || kMode == kBf16Copy) ? H / 8 : H / 16;
  const int64_t rounds = (chunks + 31) / 32;
  const int64_t rb = static_cast<uint32_t>(rounds) * part / static_cast<uint32_t>(parts),  // 32-bit: small values
      re = static_cast<uint32_t>(rounds) * (part + 1) / static_cast<uint32_t>(parts);

  if constexpr (kMode == kBf16ToFp8) {
    const char* src = static_cast<const char*>(x) + t * H * 2;
    const bool pow2 = a.pow2_scales;
    // Scales (H % 512 == 0): lane i keeps the float4 of round win + i; a window of up to 32 rounds
    // goes out as one coalesced store per destination (a 16-byte store per round per destination
    // would be 14 small NVLink writes per token at H = 7168).
    float4 my_sc = make_float4(0.f, 0.f, 0.f, 0.f);
    int64_t win = rb;
    const auto flush_scales = [&](int64_t end) {
      if (lane < end - win)
        for_each_dest(rows, R, row0, [&](int r, int64_t row) {
          *reinterpret_cast<float4*>(reinterpret_cast<float*>(peer_base[r] + scale_off) + row * scale_cols + (win + lane) * 4) = my_sc;
        });
      win = end;
    };
    // One round ahead: round rr + 1's loads are in flight while round rr is quantised and stored.
    const auto load_round = [&](int64_t rr, uint4 (&v)[2]) {
      const int64_t c = rr * 32 + lane;
      if (rr < re && c < chunks) {
        v[0] = ld_nc_v4(src + c * 32);
        v[1] = ld_nc_v4(src + c * 32 + 16);
      } else {
        v[0] = v[1] = make_uint4(0, 0, 0, 0);
      }
    };
    uint4 cur[2];
    load_round(rb, cur);
#pragma unroll 1
    for (int64_t rr = rb; rr < re; ++rr) {
      uint4 nxt[2];
      load_round(rr + 1, nxt);
      const int64_t c = rr * 32 + lane;
      const uint32_t w[8] = {cur[0].x, cur[0].y, cur[0].z, cur[0].w, cur[1].x, cur[1].y, cur[1].z, cur[1].w};
      float v[16];
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[2 * i] = fmt::bf16_to_float(static_cast<uint16_t>(w[i] & 0xFFFFu));
        v[2 * i + 1] = fmt::bf16_to_float(static_cast<uint16_t>(w[i] >> 16));
        amax = fmaxf(amax, fmt::finite_abs(v[2 * i]));
        amax = fmaxf(amax, fmt::finite_abs(v[2 * i + 1]));
      }
      // The 8 lanes of a 128-block (lane & ~7) reduce their amax; chunks % 8 == 0, so a block's
      // lanes are all active or all inactive.
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 4));
      const float s = fmt::fp8_block_scale(amax, pow2);
      uint32_t q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        q[i] = quantize_e4m3_pair_div(v[4 * i], v[4 * i + 1], s) | (quantize_e4m3_pair_div(v[4 * i + 2], v[4 * i + 3], s) << 16);
      const uint4 out = make_uint4(q[0], q[1], q[2], q[3]);
      const float s1 = __shfl_sync(0xFFFFFFFFu, s, 8), s2 = __shfl_sync(0xFFFFFFFFu, s, 16),
                  s3 = __shfl_sync(0xFFFFFFFFu, s, 24);
      const int64_t block0 = rr * 4;  // first 128-block of the round
      const int64_t nb = scale_cols - block0 < 4 ? scale_cols - block0 : 4;
      if (scales_v4) {
        const float s0 = __shfl_sync(0xFFFFFFFFu, s, 0);
        if (lane == rr - win) my_sc = make_float4(s0, s1, s2, s3);
      }
      for_each_dest(rows, R, row0, [&](int r, int64_t row) {
        if (c < chunks) st_v4(peer_base[r] + tok_off + row * row_bytes + c * 16, out);
        if (!scales_v4 && lane == 0) {
          float* d = reinterpret_cast<float*>(peer_base[r] + scale_off) + row * scale_cols + block0;
          const float sv[4] = {s, s1, s2, s3};
#pragma unroll
          for (int b = 0; b < 4; ++b)
            if (b < nb) d[b] = sv[b];
        }
      });
      if (scales_v4 && rr + 1 - win == 32) flush_scales(rr + 1);
      cur[0] = nxt[0];
      cur[1] = nxt[1];
    }
    if (scales_v4 && win < re) flush_scales(re);
  } else if constexpr (kMode == kFp8Copy || kMode == kBf16Copy) {
    const char* src = static_cast<const char*>(x) + t * row_bytes;
    // x_scale 16-byte aligned too (the host does not require it)
    const bool gather_scales = kMode == kFp8Copy && scales_v4 && (reinterpret_cast<uintptr_t>(x_scale) & 15u) == 0;
    if (gather_scales) {
      // The part's scales first, lane i the float4 of round rb + i: one coalesced store per
      // destination for up to 32 rounds (4 lanes' 4-byte stores per round would be 14 small NVLink
      // writes per token at H = 7168).
      for (int64_t w0 = rb; w0 < re; w0 += 32) {
        const int64_t rr = w0 + lane;
        if (rr >= re) continue;
        const float4 sv = *reinterpret_cast<const float4*>(x_scale + t * scale_cols + rr * 4);
        for_each_dest(rows, R, row0, [&](int r, int64_t row) {
          *reinterpret_cast<float4*>(reinterpret_cast<float*>(peer_base[r] + scale_off) + row * scale_cols + rr * 4) = sv;
        });
      }
    }
    // One round ahead, as above.
    const auto load_round = [&](int64_t rr) {
      const int64_t c = rr * 32 + lane;
      return rr < re && c < chunks ? ld_nc_v4(src + c * 16) : make_uint4(0, 0, 0, 0);
    };
    uint4 cur = load_round(rb);
#pragma unroll 1
    for (int64_t rr = rb; rr < re; ++rr) {
      const uint4 nxt = load_round(rr + 1);
      const int64_t c = rr * 32 + lane;
      if (kMode == kFp8Copy && !gather_scales) {  // the round's 4 blocks' scales, by lanes 0..3
        const int64_t b = rr * 4 + lane;
        const float sv = (lane < 4 && b < scale_cols) ? x_scale[t * scale_cols + b] : 0.f;
        for_each_dest(rows, R, row0, [&](int r, int64_t row) {
          if (c < chunks) st_v4(peer_base[r] + tok_off + row * row_bytes + c * 16, cur);
          if (lane < 4 && b < scale_cols) reinterpret_cast<float*>(peer_base[r] + scale_off)[row * scale_cols + b] = sv;
        });
      } else {
        for_each_dest(rows, R, row0, [&](int r, int64_t row) {
          if (c < chunks) st_v4(peer_base[r] + tok_off + row * row_bytes + c * 16, cur);
        });
      }
      cur = nxt;
    }
  } else {  // kFp8ToBf16: 8 elements per chunk
    const uint8_t* src = static_cast<const uint8_t*>(x) + t * H;
    for (int64_t rr = rb; rr < re; ++rr) {
      const int64_t c = rr * 32 + lane;
      if (c >= chunks) continue;
      const uint2 q = *reinterpret_cast<const uint2*>(src + c * 8);
      const float s = x_scale[t * scale_cols + (c * 8) / fmt::kFp8BlockSize];
      const uint32_t w[2] = {q.x, q.y};
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint8_t c0 = static_cast<uint8_t>(w[i / 2] >> (16 * (i & 1)));
        const uint8_t c1 = static_cast<uint8_t>(w[i / 2] >> (16 * (i & 1) + 8));
        o[i] = fmt::float_to_bf16(fmt::mul_rn(fmt::e4m3_to_float(c0), s)) |
               (static_cast<uint32_t>(fmt::float_to_bf16(fmt::mul_rn(fmt::e4m3_to_float(c1), s))) << 16);
      }
      const uint4 out = make_uint4(o[0], o[1], o[2], o[3]);
      for_each_dest(rows, R, row0, [&](int r, int64_t row) { st_v4(peer_base[r] + tok_off + row * row_bytes + c * 16, out); });
    }
  }

  // Metadata row (part 0): src_token, local_expert[k], weight[k], zero padding; lane l writes words
  // 4l..4l+3 with one 16-byte store per destination (meta_bytes is a multiple of 16).
  if (part == 0) {  // warp-uniform
    // Lane j < k reads slot j (id, weight) and decides its validity (__match_any_sync finds a repeat
    // of a lower slot); the lanes writing the row's words then gather them by shuffles. All global
    // reads happen before the stores.
    int32_t my_id;
    bool my_valid;
    (void)warp_valid_slots(topk_ids + t * k, static_cast<int>(k), a.num_experts, lane, &my_id, &my_valid);
    const float my_w = lane < k ? __ldg(topk_weights + t * k + lane) : 0.f;
    int32_t w_id[4];
    float w_wt[4];
    bool w_ok[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t wi = 4 * lane + q;
      const int src = wi >= 1 && wi <= k ? static_cast<int>(wi - 1) : (wi > k && wi <= 2 * k ? static_cast<int>(wi - 1 - k) : 0);
      w_id[q] = __shfl_sync(0xFFFFFFFFu, my_id, src);
      w_wt[q] = __shfl_sync(0xFFFFFFFFu, my_w, src);
      w_ok[q] = __shfl_sync(0xFFFFFFFFu, my_valid ? 1 : 0, src) != 0;
    }
    if (lane * 16 < a.layout.meta_bytes) for_each_dest(rows, R, row0, [&](int r, int64_t row) {
      uint32_t word[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t wi = 4 * lane + q;
        const bool here = w_ok[q] && static_cast<int>(a.el_div.div(static_cast<uint32_t>(w_id[q]))) == r;
        uint32_t v = 0;
        if (wi == 0) v = static_cast<uint32_t>(t);
        else if (wi <= k) v = static_cast<uint32_t>(here ? static_cast<int32_t>(w_id[q] - r * El) : -1);
        else if (wi <= 2 * k) v = here ? __float_as_uint(w_wt[q]) : 0u;
        word[q] = v;
      }
      st_v4(peer_base[r] + a.layout.recv_meta.offset + row * a.layout.meta_bytes + lane * 16,
            make_uint4(word[0], word[1], word[2], word[3]));
    });
  }
}

// Moves the launch's bad-input accumulators (every CTA's dispatch_layout) into input_status and
// clears them. One thread, once every CTA's accumulation is visible to it.
__device__ __forceinline__ void record_bad_input(const TransportArgs& a, const int32_t* __restrict__ topk_ids) {
  DispatchAccum* acc = a.dispatch_accum;
  if (acc->num_bad > 0) {
    const long long first_bad = static_cast<long long>(~0ull - acc->first_bad);
    const int64_t k = a.top_k();
    InputStatus* st = a.input_status;
    if (st->bad_count == 0) {
      st->first_token = static_cast<int32_t>(first_bad / k);
      st->first_slot = static_cast<int32_t>(first_bad % k);
      st->first_value = topk_ids[first_bad];
    }
    st->bad_count += acc->num_bad;
    *acc = DispatchAccum{};
  }
}

template <int kMode>
__global__ void __launch_bounds__(kDispatchThreads, 2)
    dispatch_kernel(TransportArgs a, DispatchShape shape, const void* __restrict__ x, const float* __restrict__ x_scale,
                    const int32_t* __restrict__ topk_ids, const float* __restrict__ topk_weights) {
  __shared__ DispatchSmem s;
  pdl_enter();  // launched with launch_pdl (sm90_dispatch.cu)
  if (threadIdx.x < a.sig.num_ranks) s.peer_base[threadIdx.x] = a.sig.peer_ptr(threadIdx.x, 0);
  const int64_t t_lo = static_cast<int64_t>(blockIdx.x) * shape.tokens_per_cta;
  const int64_t t_hi = min(a.num_tokens, t_lo + shape.tokens_per_cta);
  dispatch_layout<kDispatchThreads>(a, topk_ids, s, t_lo, t_hi);  // ends with a CTA barrier

  const int lane = threadIdx.x & 31;
  const int items = (t_hi > t_lo ? static_cast<int>(t_hi - t_lo) : 0) * shape.parts;
  for (int i = threadIdx.x / 32; i < items; i += kDispatchWarps) {
    const int ct = i / shape.parts, part = i % shape.parts;
    dispatch_part<kMode>(a, s.peer_base, s.rows[ct], t_lo + ct, part, shape.parts, x, x_scale, topk_ids, topk_weights, lane);
  }

  // invariant: every CTA adds exactly one share and takes exactly one ticket, whatever happened above.
  // One fence per CTA, after the barrier: the CTA's stores (rows, and the last CTA's token counts)
  // and its dispatch_accum atomics happen-before thread 0's system-scope fence, which orders them
  // before its share and its ticket (a fence per thread serialises, ~1 us each: tens of us).
  // The shares are RMWs of one cell, so the value a waiter acquires lies in the release sequence
  // of every CTA's fence + share: it sees every CTA's rows.
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    const uint64_t share = blockIdx.x == 0 ? (1ull << 32) - (gridDim.x - 1) : 1ull;  // G shares sum to 2^32
    for (int p = 0; p < a.sig.num_ranks; ++p) red_add_relaxed_sys(a.sig.peer_cell(p, a.sig.rank, kSlotDispatch), share);
    uint64_t* ticket = a.sig.own_cell(a.sig.rank, kLocalDispatchTicket);
    s.is_last = atomic_add_acq_rel_gpu(ticket, 1) + 1 == gridDim.x;
  }
  __syncthreads();
  if (!s.is_last || threadIdx.x != 0) return;
  // The last CTA's thread 0: every other CTA's accumulators are visible (their tickets released
  // them, this one acquired them).
  record_bad_input(a, topk_ids);
  *a.sig.own_cell(a.sig.rank, kLocalDispatchTicket) = 0;  // the next launch starts after this kernel ends
  // The launch epoch of this forward (combine reads it): bumped once, by the last CTA.
  uint64_t* epoch_cell = a.sig.own_cell(a.sig.rank, kLocalEpoch);
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(epoch_cell) + 1;
  *reinterpret_cast<volatile uint64_t*>(epoch_cell) = epoch;  // read by later kernels (stream order)
  const SignalCtx sig = a.sig;  // a local copy: the wait is not inlined
  wait_all_sources(sig, kSlotDispatch, dispatch_progress(epoch), dispatch_progress(epoch + 1), kStageDispatchDone, 32);
}

}  // namespace kernels
}  // namespace megamoe
