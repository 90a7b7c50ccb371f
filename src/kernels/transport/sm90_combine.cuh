// Combine kernels of the EP transport (sm_90a).
//
// combine_send_kernel (owner; what an FC2 epilogue does, here for tests, benchmarks and backends whose
//   FC2 writes a local [pool_rows, H] buffer): partial = weight * out[p] (one fp32 multiply, weight
//   from recv_meta) for every real pool row p, encoded in the combine wire format (bf16 | mxfp8 |
//   nvfp4, fmt:: codecs) and stored through the LSA pointer into row t*k+j of the source rank's
//   combine region. bf16 wire: work item = (pool row, part of the row), a lane loads
//   kCombineLoadRounds 16-byte chunks before it stores them (small T still fills the GPU); mxfp8 /
//   nvfp4: a warp per row. No signal here: the epoch is published by combine_reduce_kernel, which
//   follows in stream order (so an FC2 epilogue that writes the rows itself needs nothing else).
// combine_kernel (both in one launch, for callers with a local FC2 output): send, a ticket per CTA,
//   the last CTA publishes the epoch, every CTA waits and reduces. Saves a kernel boundary and lets
//   the peers start reducing as soon as this rank's last row is out.
// combine_reduce_kernel (source): CTA 0 fences and publishes the epoch in every rank's
//   [me][kSlotCombine] cell; every CTA waits (bounded) until all ranks have published it here; then
//   the valid slots of each token are summed in slot order in fp32 (acc starts at +0) and written as
//   bf16 (RNE). bf16 wire: work item = (token, part of the row), up to 8 slots' chunks loaded before
//   they are summed; mxfp8 / nvfp4: a warp per token. Slots with ids outside [0, E) or repeated are
//   skipped, as in dispatch.
#pragma once

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

// e4m3 code of x / s for an mxfp8 block scale s = 2^(code - 127): a multiply by the exact reciprocal
// where it is a normal float (the same correctly rounded quotient), the IEEE division elsewhere.
__device__ __forceinline__ uint32_t mx_encode(float x, float s, float inv, bool use_inv) {
  return fmt::float_to_e4m3(use_inv ? __fmul_rn(x, inv) : fmt::div_rn(x, s));
}

constexpr int kCombineThreads = 256;
constexpr int kCombineLoadRounds = 4;  // 32-chunk rounds a lane of combine_send loads before it stores

// bf16 wire, one part (rounds [rb, re) of 32 8-element chunks) of pool row `in` -> `dst`.
template <typename InT>
__device__ __forceinline__ void send_bf16_part(const InT* __restrict__ in, char* dst, float w, int64_t chunks,
                                               int64_t rb, int64_t re, int lane) {
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
        o[m] = fmt::float_to_bf16(fmt::mul_rn(w, v[2 * m])) |
               (static_cast<uint32_t>(fmt::float_to_bf16(fmt::mul_rn(w, v[2 * m + 1]))) << 16);
      st_v4(dst + c * 16, make_uint4(o[0], o[1], o[2], o[3]));
    }
  }
}

// The send part: every real pool row's weighted partial, encoded, into the source rank's combine row.
// Ends with a CTA barrier and one system-scope fence by thread 0 (the CTA's rows ordered before
// whatever thread 0 does next: a ticket, or nothing and the next kernel publishes).
template <int kFormat, typename InT>
__device__ __forceinline__ void combine_send_rows(const TransportArgs& a, const InT* __restrict__ expert_out, int parts) {
  __shared__ char* s_peer_base[kMaxTransportRanks];
  __shared__ uint8_t s_scales[8][32];
  const int R = a.sig.num_ranks;
  if (threadIdx.x < R) s_peer_base[threadIdx.x] = a.sig.peer_ptr(threadIdx.x, a.layout.combine.offset);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t k = a.top_k(), El = a.experts_per_rank(), T_max = a.t_max(), H = a.hidden();
  const int64_t wire = a.layout.wire_row_bytes;
  const int32_t* pool_src = a.own<int32_t>(a.layout.pool_src);
  const int64_t pool_end = a.own<int32_t>(a.layout.expert_offsets)[El];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // bf16: items (row, part); mxfp8 / nvfp4: parts == 1.
  const int64_t bf16_chunks = H / 8, bf16_rounds = (bf16_chunks + 31) / 32;
  for (int64_t item = blockIdx.x * (blockDim.x / 32) + warp; item < pool_end * parts; item += warps) {
    const int64_t p = item / parts;
    const int part = static_cast<int>(item % parts);
    const int32_t src = pool_src[p];
    if (src < 0) continue;
    const int64_t recv_row = src / k, j = src % k;
    const int s = static_cast<int>(recv_row / T_max);
    if (s >= R) continue;
    const int32_t* meta = reinterpret_cast<const int32_t*>(a.sig.own_base + a.layout.recv_meta.offset +
                                                           recv_row * a.layout.meta_bytes);
    const int64_t t = meta[0];
    if (t < 0 || t >= T_max) continue;
    const float w = __int_as_float(meta[1 + k + j]);
    const InT* in = expert_out + p * H;
    char* dst = s_peer_base[s] + (t * k + j) * wire;
    if constexpr (kFormat == kWsBf16) {
      send_bf16_part<InT>(in, dst, w, bf16_chunks, bf16_rounds * part / parts, bf16_rounds * (part + 1) / parts, lane);
    } else if constexpr (kFormat == kWsMxfp8) {
      const int64_t nb = H / fmt::kMxfp8BlockSize;
      for (int64_t base = 0; base < nb; base += 32) {
        const int64_t c = base + lane;
        if (c < nb) {
          float v[32];
          load_row_values<InT>(in, c * 32, v, 32);
          float amax = 0.f;
          for (int i = 0; i < 32; ++i) {
            v[i] = fmt::mul_rn(w, v[i]);
            amax = fmaxf(amax, fmt::finite_abs(v[i]));
          }
          const uint8_t code = fmt::mxfp8_scale_code(amax);
          const float sc = fmt::e8m0_to_float(code);
          const bool use_inv = code >= 1 && code <= 253;
          const float inv = use_inv ? __frcp_rn(sc) : 0.f;
          uint32_t q[8];
          for (int m = 0; m < 8; ++m)
            q[m] = mx_encode(v[4 * m], sc, inv, use_inv) | (mx_encode(v[4 * m + 1], sc, inv, use_inv) << 8) |
                   (mx_encode(v[4 * m + 2], sc, inv, use_inv) << 16) | (mx_encode(v[4 * m + 3], sc, inv, use_inv) << 24);
          if (wire % 16 == 0) {  // rows 16-byte aligned (H % 512 == 0): two vector stores
            st_v4(dst + c * 32, make_uint4(q[0], q[1], q[2], q[3]));
            st_v4(dst + c * 32 + 16, make_uint4(q[4], q[5], q[6], q[7]));
          } else {
            uint32_t* d = reinterpret_cast<uint32_t*>(dst + c * 32);
            for (int m = 0; m < 8; ++m) d[m] = q[m];
          }
          s_scales[warp][lane] = code;
        }
        __syncwarp();
        const int64_t n = nb - base < 32 ? nb - base : 32;
        if (lane * 4 < n) reinterpret_cast<uint32_t*>(dst + H + base)[lane] = reinterpret_cast<uint32_t*>(s_scales[warp])[lane];
        __syncwarp();
      }
    } else {  // nvfp4
      float amax = 0.f;
      for (int64_t c = lane; c < H / 8; c += 32) {
        float v[8];
        load_row_values<InT>(in, c * 8, v, 8);
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fmt::finite_abs(fmt::mul_rn(w, v[i])));
      }
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      const float g = fmt::nvfp4_global_scale(amax);
      const int64_t nb = H / fmt::kNvfp4BlockSize;
      for (int64_t base = 0; base < nb; base += 32) {
        const int64_t c = base + lane;
        if (c < nb) {
          float v[16];
          load_row_values<InT>(in, c * 16, v, 16);
          float bamax = 0.f;
          for (int i = 0; i < 16; ++i) {
            v[i] = fmt::mul_rn(w, v[i]);
            bamax = fmaxf(bamax, fmt::finite_abs(v[i]));
          }
          const uint8_t code = fmt::nvfp4_block_scale_code(bamax, g);
          const float divisor = fmt::nvfp4_block_divisor(code, g);
          uint32_t q[2] = {0u, 0u};
          for (int i = 0; i < 16; ++i)
            q[i / 8] |= static_cast<uint32_t>(fmt::nvfp4_encode_element(v[i], divisor)) << (4 * (i % 8));
          uint32_t* d = reinterpret_cast<uint32_t*>(dst + c * 8);
          d[0] = q[0];
          d[1] = q[1];
          s_scales[warp][lane] = code;
        }
        __syncwarp();
        const int64_t n = nb - base < 32 ? nb - base : 32;
        if (lane * 4 < n)
          reinterpret_cast<uint32_t*>(dst + H / 2 + base)[lane] = reinterpret_cast<uint32_t*>(s_scales[warp])[lane];
        __syncwarp();
      }
      if (lane == 0) *reinterpret_cast<float*>(dst + H / 2 + H / 16) = g;
    }
  }
  // One fence per CTA, after the barrier (a fence per thread serialises).
  __syncthreads();
  if (threadIdx.x == 0) fence_acq_rel_sys();
}

// Send only: the epoch is published by combine_reduce_kernel, which follows in stream order.
template <int kFormat, typename InT>
__global__ void __launch_bounds__(kCombineThreads)
    combine_send_kernel(TransportArgs a, const InT* __restrict__ expert_out, int parts) {
  combine_send_rows<kFormat, InT>(a, expert_out, parts);
}

// bf16 wire: one part (rounds [rb, re) of 32 8-element chunks) of token t's sum over its valid slots.
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
      o[m] = fmt::float_to_bf16(acc[2 * m]) | (static_cast<uint32_t>(fmt::float_to_bf16(acc[2 * m + 1])) << 16);
    st_v4(y_row + c * 8, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

// The reduce part: token t's valid slots summed in slot order (fp32) into y. Every rank's partials
// for this rank must have arrived (the caller waited).
template <int kFormat>
__device__ __forceinline__ void combine_reduce_tokens(const TransportArgs& a, const int32_t* __restrict__ topk_ids,
                                                      uint16_t* __restrict__ y, int parts) {
  const int lane = threadIdx.x & 31;
  const int64_t k = a.top_k(), H = a.hidden(), wire = a.layout.wire_row_bytes;
  const char* rows = a.own<char>(a.layout.combine);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // bf16: items (token, part); mxfp8 / nvfp4: parts == 1.
  const int64_t bf16_chunks = H / 8, bf16_rounds = (bf16_chunks + 31) / 32;
  for (int64_t item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < a.num_tokens * parts; item += warps) {
    const int64_t t = item / parts;
    const int part = static_cast<int>(item % parts);
    int32_t my_id;
    bool my_valid;
    const uint32_t valid = warp_valid_slots(topk_ids + t * k, static_cast<int>(k), a.num_experts, lane, &my_id, &my_valid);
    if constexpr (kFormat == kWsBf16) {
      reduce_bf16_part(rows, wire, t, static_cast<int>(k), valid, y + t * H, bf16_chunks,
                       bf16_rounds * part / parts, bf16_rounds * (part + 1) / parts, lane);
    } else {
      for (int64_t c = lane; c < H / 16; c += 32) {
        float acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = 0.f;
        for (int j = 0; j < k; ++j) {
          if (!(valid >> j & 1u)) continue;
          const char* row = rows + (t * k + j) * wire;
          if constexpr (kFormat == kWsMxfp8) {
            const uint32_t* qw = reinterpret_cast<const uint32_t*>(row + c * 16);
            const float sc = fmt::e8m0_to_float(static_cast<uint8_t>(row[H + c / 2]));
            for (int m = 0; m < 4; ++m) {
              const uint32_t q = qw[m];
              for (int b = 0; b < 4; ++b)
                acc[4 * m + b] = __fadd_rn(acc[4 * m + b],
                                           fmt::mul_rn(fmt::e4m3_to_float(static_cast<uint8_t>(q >> (8 * b))), sc));
            }
          } else {
            const uint32_t* qw = reinterpret_cast<const uint32_t*>(row + c * 8);
            const float g = *reinterpret_cast<const float*>(row + H / 2 + H / 16);
            const float divisor = fmt::nvfp4_block_divisor(static_cast<uint8_t>(row[H / 2 + c]), g);
            for (int m = 0; m < 2; ++m) {
              const uint32_t q = qw[m];
              for (int b = 0; b < 8; ++b)
                acc[8 * m + b] = __fadd_rn(acc[8 * m + b],
                                           fmt::mul_rn(fmt::e2m1_to_float(static_cast<uint8_t>((q >> (4 * b)) & 0xFu)), divisor));
            }
          }
        }
        uint32_t o[8];
        for (int m = 0; m < 8; ++m)
          o[m] = fmt::float_to_bf16(acc[2 * m]) | (static_cast<uint32_t>(fmt::float_to_bf16(acc[2 * m + 1])) << 16);
        st_v4(y + t * H + c * 16, make_uint4(o[0], o[1], o[2], o[3]));
        st_v4(y + t * H + c * 16 + 8, make_uint4(o[4], o[5], o[6], o[7]));
      }
    }
  }
}

// After rows written by earlier kernels (combine_send_kernel, or FC2's epilogue): CTA 0 fences and
// publishes the epoch, every CTA waits (bounded) for every rank's, then reduces.
template <int kFormat>
__global__ void __launch_bounds__(kCombineThreads)
    combine_reduce_kernel(TransportArgs a, const int32_t* __restrict__ topk_ids, uint16_t* __restrict__ y, int parts) {
  __shared__ bool s_ok;
  if (threadIdx.x == 0) {
    const SignalCtx sig = a.sig;  // a local copy: the wait is not inlined
    const uint64_t epoch = sig.local_epoch();
    if (blockIdx.x == 0) {
      fence_acq_rel_sys();  // the rows this rank sent (earlier kernels)
      signal_all_ranks(sig, kSlotCombine, epoch);
    }
    s_ok = wait_all_ranks(sig, kSlotCombine, epoch, kStageCombineDone);
  }
  __syncthreads();
  if (!s_ok) return;
  combine_reduce_tokens<kFormat>(a, topk_ids, y, parts);
}

// Send and reduce in one launch: each CTA sends its rows, fences and takes a ticket; the last one
// publishes the epoch (so the peers' reduce starts as soon as this rank's last row is out, with no
// kernel boundary in between); every CTA then waits for every rank's epoch and reduces.
// invariant: every CTA takes exactly one ticket; the last resets it (the next launch is stream-ordered).
// invariant: the grid is co-resident (the launcher caps it at the occupancy limit): CTAs that took
// their ticket spin until the last one has sent, so a CTA that never got an SM would hang the group
// (the bounded wait would report it as a timeout).
template <int kFormat, typename InT>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(TransportArgs a, const InT* __restrict__ expert_out, const int32_t* __restrict__ topk_ids,
                   uint16_t* __restrict__ y, int send_parts, int reduce_parts) {
  __shared__ bool s_ok;
  combine_send_rows<kFormat, InT>(a, expert_out, send_parts);  // ends with a barrier; thread 0 fenced
  if (threadIdx.x == 0) {
    const SignalCtx sig = a.sig;
    const uint64_t epoch = sig.local_epoch();
    uint64_t* ticket = sig.own_cell(sig.rank, kLocalCombineTicket);
    // acq_rel: the last taker's release to the peers carries every CTA's fenced rows.
    if (atomic_add_acq_rel_gpu(ticket, 1) + 1 == gridDim.x) {
      *ticket = 0;
      signal_all_ranks(sig, kSlotCombine, epoch);
    }
    s_ok = wait_all_ranks(sig, kSlotCombine, epoch, kStageCombineDone);
  }
  __syncthreads();
  if (!s_ok) return;
  combine_reduce_tokens<kFormat>(a, topk_ids, y, reduce_parts);
}

}  // namespace kernels
}  // namespace megamoe
