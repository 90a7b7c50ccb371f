// Combine kernels of the EP transport (sm_90a).
//
// Progress cells: owner r raises [r][kSlotCombine] in source d's copy (red.max) to epoch << 20 |
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
#include "kernels/common/sm90_quant.cuh"
#include "kernels/transport/sm90_transport_args.cuh"

namespace megamoe {
namespace kernels {

template <typename InT>
__device__ __forceinline__ void load_row_values(const InT* row, int64_t first, float* v, int n);

template <>
__device__ __forceinline__ void load_row_values<float>(const float* row, int64_t first, float* v, int n) {
  for (int i = 0; i < n; i += 4) {
    const float4 q = *reinterpret_cast<const float4*>(row + first + i);
    v[i] = q.x;
    v[i + 1] = q.y;
    v[i + 2] = q.z;
    v[i + 3] = q.w;
  }
}

template <>
__device__ __forceinline__ void load_row_values<uint16_t>(const uint16_t* row, int64_t first, float* v, int n) {
  for (int i = 0; i < n; i += 8) {
    const uint4 q = *reinterpret_cast<const uint4*>(row + first + i);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    for (int m = 0; m < 4; ++m) {
      v[i + 2 * m] = fmt::bf16_to_float(static_cast<uint16_t>(w[m] & 0xFFFFu));
      v[i + 2 * m + 1] = fmt::bf16_to_float(static_cast<uint16_t>(w[m] >> 16));
    }
  }
}

// e4m3 code of x / s by the codec (the mxfp8 blocks whose scale has no exact fp32 reciprocal path).
__device__ __forceinline__ uint32_t mx_encode(float x, float s) { return fmt::float_to_e4m3(fmt::div_rn(x, s)); }

// kHwNaNNote: the hot loops below use the raw __fmul_rn / __fadd_rn where the codecs say mul_rn:
// the hardware already returns the canonical NaN 0x7FFFFFFF for every NaN result, so the codec's
// canonicalize_nan would change nothing (FormatsDevice.HardwareNaNResultsAreCanonical checks it),
// and with only canonical NaNs, cvt.rn.bf16x2 gives float_to_bf16's codes (cvt_bf16x2).

// max over the finite |v[i]| (fmt::finite_abs), for a block whose plain max hit an inf.
template <int kN>
__device__ __forceinline__ float finite_amax(const float (&v)[kN]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kN; ++i) m = fmaxf(m, fmt::finite_abs(v[i]));
  return m;
}

// v = w * in[first, first + kN) (fmt::mul_rn, see kHwNaNNote); returns the block's max finite |v|.
template <typename InT, int kN>
__device__ __forceinline__ float load_weighted_block(const InT* __restrict__ in, int64_t first, float w, float (&v)[kN]) {
  load_row_values<InT>(in, first, v, kN);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    v[i] = __fmul_rn(w, v[i]);
    amax = fmaxf(amax, fabsf(v[i]));  // fmaxf skips NaN
  }
  return amax == __int_as_float(0x7F800000) ? finite_amax(v) : amax;  // an inf: the finite-only max
}

// Max |x| over the finite values of a row of H (a multiple of 8), by the whole warp: compared as
// integer bits (the order of non-negative floats), 4 16-byte loads in flight per lane.
template <typename InT>
__device__ __forceinline__ float row_finite_amax(const InT* __restrict__ in, int64_t H, int lane) {
  constexpr int kPerVec = 16 / sizeof(InT);
  constexpr int kUnroll = 4;
  const int64_t vecs = H / kPerVec;
  uint32_t m = 0;
  for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
    uint4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      q[u] = v0 + 32 * u < vecs ? ld_nc_v4(in + (v0 + 32 * u) * kPerVec) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t w4[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (sizeof(InT) == 2) {  // bf16 pairs: 0x7F80 and above is inf / NaN
          const uint32_t lo = w4[i] & 0x7FFFu, hi = (w4[i] >> 16) & 0x7FFFu;
          m = max(m, max(lo < 0x7F80u ? lo : 0u, hi < 0x7F80u ? hi : 0u));
        } else {
          const uint32_t a = w4[i] & 0x7FFFFFFFu;
          m = max(m, a < 0x7F800000u ? a : 0u);
        }
      }
    }
  }
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  return __uint_as_float(sizeof(InT) == 2 ? m << 16 : m);
}

// What a send encodes, row by row. Both give block(first, v): v = the row's values [first, first +
// kN), returning their max finite |v|; and row_amax(H, lane): the max finite |v| over the whole row,
// by the whole warp.
//
// SlotPartial: one pool row's partial, w * out[p] (one fp32 multiply): a per-slot combine row.
template <typename InT>
struct SlotPartial {
  const InT* __restrict__ in;  // the pool row's FC2 output
  float w;                     // its routing weight

  template <int kN>
  __device__ __forceinline__ float block(int64_t first, float (&v)[kN]) const {
    return load_weighted_block<InT, kN>(in, first, w, v);
  }
  __device__ __forceinline__ float row_amax(int64_t H, int lane) const {
    // Max over the finite partials |w * x|: RN is monotone and odd, so it is RN(|w| * max finite
    // |x|) from the raw values, whenever that product is finite (it is not when w is inf / NaN or the
    // product overflows: then the partials themselves, as the codec does).
    float amax = fmt::mul_rn(fabsf(w), row_finite_amax<InT>(in, H, lane));
    if (!(amax <= 3.402823466e38f)) {  // warp-uniform
      amax = 0.f;
      for (int64_t c = lane; c < H / 8; c += 32) {
        float v[8];
        load_row_values<InT>(in, c * 8, v, 8);
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fmt::finite_abs(fmt::mul_rn(w, v[i])));
      }
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    }
    return amax;
  }
};

// OwnerSum (the owner reduce): a received token's partials here summed in slot order, acc = +0,
// acc = acc + w_j * out[p_j] for its local slots j (each product and sum rounded to fp32, the
// reference's order): one combine row per (token, owner).
template <typename InT>
struct OwnerSum {
  const InT* __restrict__ out;  // expert_out [pool rows, H]
  int64_t H;
  const int32_t* rows;  // the n pool rows, in slot order (the warp's shared staging)
  const float* w;       // their routing weights
  int n;

  template <int kN>
  __device__ __forceinline__ float block(int64_t first, float (&v)[kN]) const {
    // slots whose values are loaded before the adds (an mxfp8 block of 32 already has 4-8 loads in
    // flight per slot, and two slots' 64 values made the kernel 194 registers: one CTA per SM)
    constexpr int kBatch = kN >= 32 ? 1 : kN >= 16 ? 4 : 8;
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = 0.f;
    for (int j0 = 0; j0 < n; j0 += kBatch) {
      float x[kBatch][kN];
#pragma unroll
      for (int jj = 0; jj < kBatch; ++jj)
        if (j0 + jj < n) load_row_values<InT>(out + static_cast<int64_t>(rows[j0 + jj]) * H, first, x[jj], kN);
#pragma unroll
      for (int jj = 0; jj < kBatch; ++jj) {
        if (j0 + jj >= n) break;
        const float wj = w[j0 + jj];
#pragma unroll
        for (int i = 0; i < kN; ++i) v[i] = __fadd_rn(v[i], __fmul_rn(wj, x[jj][i]));  // see kHwNaNNote
      }
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kN; ++i) amax = fmaxf(amax, fabsf(v[i]));  // fmaxf skips NaN
    return amax == __int_as_float(0x7F800000) ? finite_amax(v) : amax;
  }
  __device__ __forceinline__ float row_amax(int64_t H_, int lane) const {
    float amax = 0.f;
    for (int64_t c = lane; c < H_ / 16; c += 32) {
      float v[16];
      amax = fmaxf(amax, block<16>(c * 16, v));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    return amax;
  }
};

constexpr int kCombineThreads = 256;
constexpr int kCombineLoadRounds = 4;  // 32-chunk rounds a lane of combine_send loads before it stores
constexpr int kOwnerSendStepRounds = 2;  // rounds of an owner-reduce bf16 send step (its slots' loads in flight)

// bf16 wire, one part (rounds [rb, re) of 32 8-element chunks) of pool row `in` -> `dst`.
template <typename InT>
__device__ __forceinline__ void send_bf16_part(const SlotPartial<InT>& src, char* dst, int64_t chunks, int64_t rb,
                                               int64_t re, int lane) {
  const InT* __restrict__ in = src.in;
  const float w = src.w;
  constexpr int kVec = sizeof(InT) * 8 / 16;  // 16-byte loads per 8-element chunk
  for (int64_t r0 = rb; r0 < re; r0 += kCombineLoadRounds) {
    uint4 raw[kCombineLoadRounds][kVec];
#pragma unroll
    for (int u = 0; u < kCombineLoadRounds; ++u) {
      const int64_t c = (r0 + u) * 32 + lane;
#pragma unroll
      for (int h = 0; h < kVec; ++h)
        raw[u][h] = (r0 + u < re && c < chunks) ? ld_nc_v4(reinterpret_cast<const char*>(in + c * 8) + 16 * h)
                                                : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kCombineLoadRounds; ++u) {
      const int64_t c = (r0 + u) * 32 + lane;
      if (r0 + u >= re || c >= chunks) continue;
      float v[8];
      if constexpr (sizeof(InT) == 4) {
        const float* f = reinterpret_cast<const float*>(raw[u]);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = f[i];
      } else {
        const uint32_t ww[4] = {raw[u][0].x, raw[u][0].y, raw[u][0].z, raw[u][0].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          v[2 * m] = fmt::bf16_to_float(static_cast<uint16_t>(ww[m] & 0xFFFFu));
          v[2 * m + 1] = fmt::bf16_to_float(static_cast<uint16_t>(ww[m] >> 16));
        }
      }
      uint32_t o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m)
        o[m] = cvt_bf16x2(__fmul_rn(w, v[2 * m]), __fmul_rn(w, v[2 * m + 1]));  // see kHwNaNNote
      st_v4(dst + c * 16, make_uint4(o[0], o[1], o[2], o[3]));
    }
  }
}

// A lane's chunks (16 wire bytes of bf16 each) of rounds [r0, r0 + kR), and which of them lie in
// [.., re) and in the row's `chunks`.
template <int kR>
struct StepChunks {
  int64_t c[kR];
  bool on[kR];
  __device__ __forceinline__ StepChunks(int64_t r0, int64_t re, int64_t chunks, int lane) {
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      c[u] = (r0 + u) * 32 + lane;
      on[u] = r0 + u < re && c[u] < chunks;
    }
  }
};

// 8 fp32 values -> 8 bf16 (RNE; NaN canonical, see kHwNaNNote) in one 16-byte store.
__device__ __forceinline__ void store_bf16x8(void* dst, const float (&v)[8]) {
  uint32_t o[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) o[m] = cvt_bf16x2(v[2 * m], v[2 * m + 1]);
  st_v4(dst, make_uint4(o[0], o[1], o[2], o[3]));
}

// The 8 values of one chunk loaded raw (one 16-byte vector of bf16, two of fp32).
template <typename InT>
__device__ __forceinline__ void raw_chunk_values(const uint4 (&raw)[sizeof(InT) * 8 / 16], float (&v)[8]) {
  if constexpr (sizeof(InT) == 4) {
    const float* f = reinterpret_cast<const float*>(raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = f[i];
  } else {
    const uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      v[2 * m] = fmt::bf16_to_float(static_cast<uint16_t>(w[m] & 0xFFFFu));
      v[2 * m + 1] = fmt::bf16_to_float(static_cast<uint16_t>(w[m] >> 16));
    }
  }
}

// bf16 wire, the owner's sum: two rounds per step, each lane's two chunks of up to 4 slots loaded
// (8 16-byte loads in flight for bf16 rows) before the slot-order adds; stores to a peer's rows may
// alias the loads, so nothing loads ahead of a store unless it is in the same step.
template <typename InT>
__device__ __forceinline__ void send_bf16_part(const OwnerSum<InT>& src, char* dst, int64_t chunks, int64_t rb,
                                               int64_t re, int lane) {
  constexpr int kR = kOwnerSendStepRounds, kSlots = 4;
  constexpr int kVec = sizeof(InT) * 8 / 16;  // 16-byte loads per 8-element chunk
  for (int64_t r0 = rb; r0 < re; r0 += kR) {
    const StepChunks<kR> st(r0, re, chunks, lane);
    const int64_t(&c)[kR] = st.c;
    const bool(&on)[kR] = st.on;
    float v[kR][8] = {};
    for (int j0 = 0; j0 < src.n; j0 += kSlots) {
      uint4 raw[kSlots][kR][kVec];  // raw, converted at the add: half the registers of floats for bf16 rows
#pragma unroll
      for (int jj = 0; jj < kSlots; ++jj) {
        const char* row = reinterpret_cast<const char*>(src.out + static_cast<int64_t>(src.rows[j0 + jj < src.n ? j0 + jj : j0]) * src.H);
#pragma unroll
        for (int u = 0; u < kR; ++u)
#pragma unroll
          for (int h = 0; h < kVec; ++h)
            raw[jj][u][h] = (j0 + jj < src.n && on[u]) ? ld_nc_v4(row + c[u] * 8 * sizeof(InT) + 16 * h) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int jj = 0; jj < kSlots; ++jj) {
        if (j0 + jj >= src.n) break;
        const float wj = src.w[j0 + jj];
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          float x[8];
          raw_chunk_values<InT>(raw[jj][u], x);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[u][i] = __fadd_rn(v[u][i], __fmul_rn(wj, x[i]));  // see kHwNaNNote
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kR; ++u)
      if (on[u]) store_bf16x8(dst + c[u] * 16, v[u]);
  }
}

// Rounds a combine row splits into for the send (32 bf16 8-element chunks | 32 mxfp8 blocks of 32 |
// 32 nvfp4 blocks of 16 per round) and for the reduce (32 chunks of 8 (bf16) or 16 elements).
__host__ __device__ __forceinline__ int64_t combine_send_rounds(int32_t format, int64_t hidden) {
  const int64_t per_round = 32 * (format == kWsBf16 ? 8 : format == kWsMxfp8 ? fmt::kMxfp8BlockSize : fmt::kNvfp4BlockSize);
  return (hidden + per_round - 1) / per_round;
}
__host__ __device__ __forceinline__ int64_t combine_reduce_rounds(int32_t format, int64_t hidden) {
  const int64_t per_round = 32 * (format == kWsBf16 ? 8 : 16);
  return (hidden + per_round - 1) / per_round;
}

// mxfp8 wire, rounds [rb, re) of 32 blocks, one block of 32 elements per lane; `scales` is the warp's
// 32-byte staging row.
template <typename Src>
__device__ __forceinline__ void send_mxfp8_part(const Src& src, char* dst, int64_t H, int64_t wire, int64_t rb,
                                                int64_t re, int lane, uint8_t* scales) {
  const int64_t nb = H / fmt::kMxfp8BlockSize;
  for (int64_t base = rb * 32; base < nb && base < re * 32; base += 32) {
    const int64_t c = base + lane;
    if (c < nb) {
      float v[32];
      const float amax = src.template block<32>(c * 32, v);
      const uint8_t code = fmt::mxfp8_scale_code(amax);
      const float sc = fmt::e8m0_to_float(code);
      uint32_t q[8];
      if (code >= 1 && code <= 253) {
        // s = 2^(code - 127) and 1 / s are exact, so v * (1 / s) is the correctly rounded v / s; the
        // instruction gives float_to_e4m3's code for every non-NaN value, and v is a mul_rn product,
        // whose NaN is the positive canonical one: code 0x7F, as the codec's.
        const float inv = __frcp_rn(sc);
#pragma unroll
        for (int m = 0; m < 8; ++m)
          q[m] = static_cast<uint32_t>(cvt_e4m3x2(__fmul_rn(v[4 * m], inv), __fmul_rn(v[4 * m + 1], inv))) |
                 (static_cast<uint32_t>(cvt_e4m3x2(__fmul_rn(v[4 * m + 2], inv), __fmul_rn(v[4 * m + 3], inv))) << 16);
      } else {
        for (int m = 0; m < 8; ++m)
          q[m] = mx_encode(v[4 * m], sc) | (mx_encode(v[4 * m + 1], sc) << 8) | (mx_encode(v[4 * m + 2], sc) << 16) |
                 (mx_encode(v[4 * m + 3], sc) << 24);
      }
      if (wire % 16 == 0 && base + 32 <= nb) {
        // Rows 16-byte aligned (H % 512 == 0) and a whole round of 32 blocks (1 KiB of codes): lane l
        // stores bytes [16 l, 16 l + 16) of each half of the round, so every store instruction writes
        // 512 contiguous bytes. A lane storing its own block's 32 bytes made each instruction write
        // half of 32 sectors, which the peer's NVLink took as twice the packets (mxfp8 sends ran at
        // ~200 GB/s where bf16 rows, written contiguously, reach the link's ~335).
        const int src0 = lane >> 1, src1 = 16 + (lane >> 1);
        const bool hi = (lane & 1) != 0;
        uint32_t o0[4], o1[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const uint32_t a0 = __shfl_sync(0xFFFFFFFFu, q[m], src0), b0 = __shfl_sync(0xFFFFFFFFu, q[m + 4], src0);
          const uint32_t a1 = __shfl_sync(0xFFFFFFFFu, q[m], src1), b1 = __shfl_sync(0xFFFFFFFFu, q[m + 4], src1);
          o0[m] = hi ? b0 : a0;
          o1[m] = hi ? b1 : a1;
        }
        st_v4(dst + base * 32 + lane * 16, make_uint4(o0[0], o0[1], o0[2], o0[3]));
        st_v4(dst + base * 32 + 512 + lane * 16, make_uint4(o1[0], o1[1], o1[2], o1[3]));
      } else if (wire % 16 == 0) {  // a partial round: each lane its own block, two vector stores
        st_v4(dst + c * 32, make_uint4(q[0], q[1], q[2], q[3]));
        st_v4(dst + c * 32 + 16, make_uint4(q[4], q[5], q[6], q[7]));
      } else {
        uint32_t* d = reinterpret_cast<uint32_t*>(dst + c * 32);
        for (int m = 0; m < 8; ++m) d[m] = q[m];
      }
      scales[lane] = code;
    }
    __syncwarp();
    const int64_t n = nb - base < 32 ? nb - base : 32;
    if (lane * 4 < n) reinterpret_cast<uint32_t*>(dst + H + base)[lane] = reinterpret_cast<uint32_t*>(scales)[lane];
    __syncwarp();
  }
}

// nvfp4 wire, rounds [rb, re) of 32 blocks of 16, one block per lane; `scales` is the warp's 32-byte
// staging row. Every part reads the whole row for its global amax (parts > 1 only at small T).
template <typename Src>
__device__ __forceinline__ void send_nvfp4_part(const Src& src, char* dst, int64_t H, int64_t rb, int64_t re, int lane,
                                                uint8_t* scales) {
  const float amax = src.row_amax(H, lane);  // the global amax, over the finite values
  const float g = fmt::nvfp4_global_scale(amax);
  const int64_t nb = H / fmt::kNvfp4BlockSize;
  for (int64_t base = rb * 32; base < nb && base < re * 32; base += 32) {
    const int64_t c = base + lane;
    if (c < nb) {
      float v[16];
      const float bamax = src.template block<16>(c * 16, v);
      const uint8_t code = fmt::nvfp4_block_scale_code(bamax, g);
      const float divisor = fmt::nvfp4_block_divisor(code, g);
      uint32_t q[2] = {0u, 0u};
      for (int i = 0; i < 16; ++i)
        q[i / 8] |= static_cast<uint32_t>(fmt::nvfp4_encode_element(v[i], divisor)) << (4 * (i % 8));
      uint32_t* d = reinterpret_cast<uint32_t*>(dst + c * 8);
      d[0] = q[0];
      d[1] = q[1];
      scales[lane] = code;
    }
    __syncwarp();
    const int64_t n = nb - base < 32 ? nb - base : 32;
    if (lane * 4 < n) reinterpret_cast<uint32_t*>(dst + H / 2 + base)[lane] = reinterpret_cast<uint32_t*>(scales)[lane];
    __syncwarp();
  }
  if (lane == 0 && rb == 0) *reinterpret_cast<float*>(dst + H / 2 + H / 16) = g;
}

// Rounds [rb, re) (combine_send_rounds) of `src` (a SlotPartial or an OwnerSum) -> `dst` in the wire format.
template <int kFormat, typename Src>
__device__ __forceinline__ void send_row(const TransportArgs& a, const Src& src, char* dst, int64_t rb, int64_t re,
                                         int lane, uint8_t* scales) {
  const int64_t H = a.hidden();
  if constexpr (kFormat == kWsBf16) send_bf16_part(src, dst, H / 8, rb, re, lane);
  else if constexpr (kFormat == kWsMxfp8) send_mxfp8_part(src, dst, H, a.layout.wire_row_bytes, rb, re, lane, scales);
  else send_nvfp4_part(src, dst, H, rb, re, lane, scales);
}

// Where pool row p's partial goes, from pool_src and its recv row's metadata: false for padding
// rows and rows whose source or token is out of range.
struct RowTarget {
  int s;          // source rank
  int64_t i;      // recv row within the source's region (the source's i-th token sent here)
  int64_t t, j;   // source token and slot
  float w;
};
__device__ __forceinline__ bool row_target(const TransportArgs& a, int64_t p, RowTarget* rt) {
  const int32_t src = a.own<int32_t>(a.layout.pool_src)[p];
  if (src < 0) return false;
  const int64_t k = a.top_k(), T_max = a.t_max();
  // 32-bit divisions (src < R * T_max * k < 2^24): a 64-bit one is a call of ~70 instructions.
  const uint32_t uk = static_cast<uint32_t>(k), utm = static_cast<uint32_t>(T_max);
  const uint32_t recv_row = static_cast<uint32_t>(src) / uk, s = recv_row / utm;
  rt->j = static_cast<uint32_t>(src) - recv_row * uk;
  rt->s = static_cast<int>(s);
  rt->i = recv_row - s * utm;
  if (rt->s >= a.sig.num_ranks) return false;
  const int32_t* meta = reinterpret_cast<const int32_t*>(a.sig.own_base + a.layout.recv_meta.offset +
                                                         recv_row * a.layout.meta_bytes);
  rt->t = meta[0];
  if (rt->t < 0 || rt->t >= T_max) return false;
  rt->w = __int_as_float(meta[1 + k + rt->j]);
  return true;
}

// Owner reduce: the received tokens in (source, recv row) order. start[s] = received tokens of the
// sources before s (clamped to T_max), start[R] = all; by one thread, into shared memory.
__device__ __forceinline__ void recv_row_starts(const TransportArgs& a, int32_t* start) {
  const int32_t* counts = a.own<int32_t>(a.layout.recv_token_counts);
  const int32_t T_max = static_cast<int32_t>(a.t_max());
  int32_t acc = 0;
  start[0] = 0;
  for (int s = 0; s < a.sig.num_ranks; ++s) {
    acc += min(max(counts[s], 0), T_max);
    start[s + 1] = acc;
  }
}

// The u-th received token (u < start[R]): its source and recv row within the source's region.
__device__ __forceinline__ void locate_recv_row(const int32_t* start, int R, uint32_t u, int* s, uint32_t* i) {
  int r = 0;
  while (r + 1 < R && u >= static_cast<uint32_t>(start[r + 1])) ++r;
  *s = r;
  *i = u - static_cast<uint32_t>(start[r]);
}

// Owner reduce, by the whole warp: the pool rows and weights of recv row w's local slots, in slot
// order, into the warp's staging; returns how many (warp-uniform; 0 only for inconsistent input).
__device__ __forceinline__ int owner_slots(const TransportArgs& a, int64_t w, int lane, int32_t* rows, float* weights) {
  const int k = static_cast<int>(a.top_k());
  const int32_t* meta = reinterpret_cast<const int32_t*>(a.sig.own_base + a.layout.recv_meta.offset + w * a.layout.meta_bytes);
  const int32_t p = lane < k ? a.recv_pool_row[w * k + lane] : -1;
  const float wt = lane < k ? __int_as_float(meta[1 + k + lane]) : 0.f;
  const uint32_t on = __ballot_sync(0xFFFFFFFFu, p >= 0);
  __syncwarp();  // the previous row's staging is read by every lane before it is rewritten
  if (p >= 0) {
    const int at = __popc(on & ((1u << lane) - 1u));
    rows[at] = p;
    weights[at] = wt;
  }
  __syncwarp();
  return __popc(on);
}

// Owner reduce: the source token of recv row w, or -1 when out of range.
__device__ __forceinline__ int64_t recv_row_token(const TransportArgs& a, int64_t w) {
  const int32_t t = *reinterpret_cast<const int32_t*>(a.sig.own_base + a.layout.recv_meta.offset + w * a.layout.meta_bytes);
  return (t >= 0 && t < a.t_max()) ? t : -1;
}

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

// bf16 wire: one part (rounds [rb, re) of 32 8-element chunks) of token t's sum over its valid rows
// t * k + j (k: rows per token, slots or owner ranks).
__device__ __forceinline__ void reduce_bf16_part(const char* rows, int64_t wire, int64_t t, int k, uint32_t valid,
                                                 uint16_t* __restrict__ y_row, int64_t chunks, int64_t rb, int64_t re,
                                                 int lane) {
  constexpr int kSlotBatch = 8;
  for (int64_t rr = rb; rr < re; ++rr) {
    const int64_t c = rr * 32 + lane;
    if (c >= chunks) continue;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int j0 = 0; j0 < k; j0 += kSlotBatch) {
      uint4 q[kSlotBatch];
#pragma unroll
      for (int jj = 0; jj < kSlotBatch; ++jj) {
        const int j = j0 + jj;
        q[jj] = (j < k && (valid >> j & 1u)) ? *reinterpret_cast<const uint4*>(rows + (t * k + j) * wire + c * 16)
                                             : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int jj = 0; jj < kSlotBatch; ++jj) {
        const int j = j0 + jj;
        if (j >= k || !(valid >> j & 1u)) continue;  // in slot order; skipped slots add nothing
        const uint32_t w[4] = {q[jj].x, q[jj].y, q[jj].z, q[jj].w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          acc[2 * m] = __fadd_rn(acc[2 * m], fmt::bf16_to_float(static_cast<uint16_t>(w[m] & 0xFFFFu)));
          acc[2 * m + 1] = __fadd_rn(acc[2 * m + 1], fmt::bf16_to_float(static_cast<uint16_t>(w[m] >> 16)));
        }
      }
    }
    uint32_t o[4];
#pragma unroll
    for (int m = 0; m < 4; ++m)
      o[m] = cvt_bf16x2(acc[2 * m], acc[2 * m + 1]);  // acc's NaN is canonical (kHwNaNNote)
    st_v4(y_row + c * 8, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

// bf16 wire, the owner reduce: token t's rows t*R+r of the ranks r in `owners`, in rank order. Four
// rounds per step and two rows per batch, so a lane has 8 16-byte loads in flight with two owners
// (one round at a time gave it 2: the per-slot reduce has k).
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
// its valid slots, in rank order): rounds [rb, re) (combine_reduce_rounds) of the row. Every rank's
// partials of the token must have arrived (the caller waited). All 32 lanes call it.
template <int kFormat, bool kOwner>
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
    else reduce_bf16_part(rows, wire, t, k, valid, y + t * H, H / 8, rb, re, lane);
  } else {
    // 16-element chunks c of rounds [rb, re); up to 8 slots' codes and scales loaded before they are
    // summed in slot order (one slot at a time was a chain of dependent loads: 174 us for one token).
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

// Progress cell values (see the top of this file).
constexpr int kCombineBoundBits = 20;
constexpr uint64_t kCombineAllRows = (uint64_t(1) << kCombineBoundBits) - 1;  // > any recv row (T_max <= 65535)
__device__ __forceinline__ uint64_t combine_progress(uint64_t epoch, uint64_t bound) {
  return epoch << kCombineBoundBits | bound;
}

// Raises [me][kSlotCombine] in every rank's copy to (epoch, bound(s)) for source s, with release
// semantics: one fence, then relaxed reductions (as signal_all_ranks; a red.release.sys per rank
// would wait for the previous rank's update to land before issuing the next).
template <typename Bound>
__device__ __forceinline__ void publish_combine(const SignalCtx& sig, uint64_t epoch, Bound bound) {
  fence_acq_rel_sys();
  for (int s = 0; s < sig.num_ranks; ++s)
    red_max_relaxed_sys(sig.peer_cell(s, sig.rank, kSlotCombine), combine_progress(epoch, bound(s)));
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

// After rows written by earlier kernels (combine_send_kernel, or FC2's epilogue): CTA 0 fences and
// publishes all rows, every CTA waits (bounded) for every rank's, then reduces.
template <int kFormat, bool kOwner>
__global__ void __launch_bounds__(kCombineThreads)
    combine_reduce_kernel(TransportArgs a, const int32_t* __restrict__ topk_ids, uint16_t* __restrict__ y, int parts) {
  __shared__ bool s_ok;
  pdl_enter();  // launched with launch_pdl (sm90_combine.cu)
  if (threadIdx.x == 0) {
    const SignalCtx sig = a.sig;  // a local copy: the wait is not inlined
    const uint64_t epoch = sig.local_epoch();
    if (blockIdx.x == 0)  // its fence covers the rows this rank sent (earlier kernels)
      publish_combine(sig, epoch, [](int) { return kCombineAllRows; });
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
// invariant: the grid is co-resident (the launcher caps it at the occupancy limit): waiting CTAs
//   spin until CTAs of this and the other ranks have sent, so a CTA that never got an SM would hang
//   the group (the bounded wait would report it as a timeout).
template <int kFormat, typename InT, bool kOwner>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(TransportArgs a, const InT* __restrict__ expert_out, const int32_t* __restrict__ topk_ids,
                   uint16_t* __restrict__ y, CombineShape shape) {
  __shared__ bool s_ok;
  pdl_enter();  // launched with launch_pdl (sm90_combine.cu); see pdl.cuh on co-residency
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
          publish_combine(sig, epoch, [&](int s) {
            return last ? kCombineAllRows : static_cast<uint64_t>(((g + 1) * static_cast<int64_t>(counts[s]) + G - 1) / G);
          });
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
  }
}

}  // namespace kernels
}  // namespace megamoe
