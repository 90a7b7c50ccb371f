// sm90_combine_wire.cuh — the combine wire's encode side as device building blocks: what a row's partial
// is (SlotPartial: w * one FC2 row; OwnerSum: an owner's slots summed in slot order) and its encoding into
// one combine row, bf16 / mxfp8 / nvfp4 (send_row and the per-format parts; fmt:: codecs' bits). Used by the
// transport's combine kernels (sm90_combine.cuh) and by any FC2 epilogue that sends its rows itself.
#pragma once

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
    // flight per slot, and two slots' 64 values make the kernel 194 registers: one CTA per SM)
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
        // 512 contiguous bytes. A lane storing its own block's 32 bytes would make each instruction
        // write half of 32 sectors, which the peer's NVLink takes as twice the packets (mxfp8 sends at
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

}  // namespace kernels
}  // namespace megamoe
