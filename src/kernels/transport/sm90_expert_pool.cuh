// Expert-pool build (owner side, local memory only), after dispatch_kernel has seen every source's
// epoch. Produces expert_offsets, pool_src and pool_x(_scales) exactly as the CPU reference does:
// rows expert-major, ordered by (local expert, source rank, recv row), each expert's segment padded to
// a multiple of segment_align (1 in layers: no padding) with rows whose pool_src = -1 and whose pool_x bytes (and scales) are zero.
//
// pool_rank_kernel    warp per 32 recv rows of one source: for each (row, slot) the number of earlier
//                     rows of the chunk holding the same local expert (pool_intra), and the chunk's
//                     rows per expert (pool_hist). Deterministic: no atomics. Each lane compares its
//                     kK slots with every slot of the chunk's live rows only (kK = top_k rounded up to
//                     4, 8 or 16): a decode chunk of 1 row does 1 x kK x kK compares, not 32 x 16 x 16.
// pool_offsets_kernel warp per expert: turns pool_hist into exclusive bases over (source, chunk),
//                     recv_expert_counts[source][expert] (the rows from each source that name the
//                     expert: the dispatch does not send them) and seg_total; the last CTA (ticket)
//                     block-scans the padded segment sizes into expert_offsets.
// pool_scatter_kernel warp per recv row: pool row = offsets[e] + base[s][chunk][e] + intra; copies the
//                     wire row (16-byte vectors) and scales, writes pool_src and the row's combine
//                     destination (pool_dst, pool_weight: what an FC2 epilogue needs to write the
//                     weighted partial into the source's combine region) and, with the owner
//                     reduce, recv_pool_row (the inverse of pool_src: the combine sums a recv row's
//                     pool rows); then warps zero the padding rows. pool_scatter_scaled_kernel: the
//                     same, with each row weight times its local expert's scale (nvfp4 weights).
#pragma once

#include <cub/block/block_scan.cuh>

#include "kernels/common/pdl.cuh"
#include "kernels/transport/sm90_transport_args.cuh"

namespace megamoe {
namespace kernels {

constexpr int kPoolOffsetsThreads = 256;

__device__ __forceinline__ const int32_t* meta_experts(const TransportArgs& a, int64_t recv_row) {
  return reinterpret_cast<const int32_t*>(a.sig.own_base + a.layout.recv_meta.offset + recv_row * a.layout.meta_bytes) + 1;
}

// Local expert of (recv row, slot), -1 when none or out of range (never trusted blindly).
__device__ __forceinline__ int32_t meta_expert(const TransportArgs& a, const int32_t* experts, int j) {
  const int32_t e = experts[j];
  return (e >= 0 && e < a.experts_per_rank()) ? e : -1;
}

template <int kK>
__global__ void __launch_bounds__(256) pool_rank_kernel(TransportArgs a) {
  pdl_enter();  // launched with launch_pdl (sm90_dispatch.cu)
  const int R = a.sig.num_ranks;
  const int64_t k = a.top_k(), El = a.experts_per_rank(), T_max = a.t_max(), chunks = a.num_chunks();
  const int lane = threadIdx.x & 31;
  const int32_t* recv_counts = a.own<int32_t>(a.layout.recv_token_counts);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < R * chunks; w += warps) {
    const int s = static_cast<int>(w / chunks);
    const int64_t chunk = w % chunks;
    const int64_t n = min(static_cast<int64_t>(recv_counts[s]), T_max);
    if (chunk * kPoolChunkRows >= n) continue;  // warp-uniform
    int32_t* hist = a.pool_hist + (s * chunks + chunk) * El;
    for (int64_t e = lane; e < El; e += 32) hist[e] = 0;
    __syncwarp();
    const int64_t i = chunk * kPoolChunkRows + lane;
    const bool live = i < n;
    const int64_t recv_row = s * T_max + i;
    int32_t mine[kK];
    int before[kK], after[kK];
    const int32_t* experts = live ? meta_experts(a, recv_row) : nullptr;
#pragma unroll
    for (int j = 0; j < kK; ++j) {
      mine[j] = (live && j < k) ? meta_expert(a, experts, j) : -1;
      before[j] = after[j] = 0;
    }
    // Rows past n hold no expert (mine = -1, never counted): the loop stops at the live ones.
    const int live_rows = static_cast<int>(min(static_cast<int64_t>(kPoolChunkRows), n - chunk * kPoolChunkRows));
    for (int other = 0; other < live_rows; ++other) {
      int32_t theirs[kK];
#pragma unroll
      for (int jj = 0; jj < kK; ++jj) theirs[jj] = __shfl_sync(0xFFFFFFFFu, mine[jj], other);
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        bool holds = false;
#pragma unroll
        for (int jj = 0; jj < kK; ++jj) holds |= (theirs[jj] == mine[j]);
        before[j] += (other < lane) && holds;
        after[j] += (other > lane) && holds;
      }
    }
    if (live) {
      // Unrolled over kK: indexed by a runtime bound, mine / before / after lived in local memory
      // (a stack frame of 12 x kK bytes) and every compare above loaded and stored them there.
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        if (j >= k) break;
        a.pool_intra[recv_row * k + j] = mine[j] >= 0 ? before[j] : -1;
        if (mine[j] >= 0 && after[j] == 0) hist[mine[j]] = before[j] + 1;  // the chunk's last row with it
      }
    }
  }
}

__global__ void __launch_bounds__(kPoolOffsetsThreads) pool_offsets_kernel(TransportArgs a) {
  pdl_enter();  // launched with launch_pdl (sm90_dispatch.cu)
  using Scan = cub::BlockScan<int64_t, kPoolOffsetsThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int64_t s_carry;
  __shared__ bool s_last;
  const int R = a.sig.num_ranks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps_per_cta = kPoolOffsetsThreads / 32;
  const int64_t El = a.experts_per_rank(), T_max = a.t_max(), chunks = a.num_chunks(), BM = a.layout.params.segment_align;
  const int32_t* recv_counts = a.own<int32_t>(a.layout.recv_token_counts);
  int32_t* offsets = a.own<int32_t>(a.layout.expert_offsets);
  int32_t* expert_counts = a.own<int32_t>(a.layout.recv_expert_counts);
  // This forward's later kernels' counters (the GEMMs', the combine's) start from zero whatever an
  // earlier forward left (sm90_launch.h); no later kernel of the forward runs before this one ends.
  if (blockIdx.x == 0) {
    if (threadIdx.x < kBackendCounterWords && a.backend_counters) a.backend_counters[threadIdx.x] = 0;
    if (threadIdx.x == 32) *a.sig.own_cell(a.sig.rank, kLocalCombineTicket) = 0;
    if (threadIdx.x == 64) *a.combine_counters = CombineCounters{};
  }

  // A warp per expert: exclusive bases over (source, chunk) in place, 32 chunks per warp scan.
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * warps_per_cta + warp; e < El;
       e += static_cast<int64_t>(gridDim.x) * warps_per_cta) {
    int64_t running = 0;
    for (int s = 0; s < R; ++s) {
      const int64_t n = min(static_cast<int64_t>(recv_counts[s]), T_max);
      const int64_t used = (n + kPoolChunkRows - 1) / kPoolChunkRows;
      const int64_t from_earlier = running;
      int32_t* hist = a.pool_hist + s * chunks * El + e;
      for (int64_t c0 = 0; c0 < used; c0 += 32) {
        const int64_t c = c0 + lane;
        const int32_t h = c < used ? hist[c * El] : 0;
        int32_t incl = h;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
          if (lane >= o) incl += v;
        }
        if (c < used) hist[c * El] = static_cast<int32_t>(running + incl - h);
        running += __shfl_sync(0xFFFFFFFFu, incl, 31);
      }
      if (lane == 0) expert_counts[s * El + e] = static_cast<int32_t>(running - from_earlier);  // zeros too
    }
    if (lane == 0) a.seg_total[e] = static_cast<int32_t>(running);
  }

  // The last CTA to finish turns the padded segment sizes into expert_offsets.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    uint64_t* ticket = a.sig.own_cell(a.sig.rank, kLocalPoolTicket);
    const uint64_t old = atomic_add_acq_rel_gpu(ticket, 1);
    s_last = old + 1 == gridDim.x;
    if (s_last) *ticket = 0;  // the next launch starts after this kernel ends (stream order)
    s_carry = 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int64_t e0 = 0; e0 < El; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    const int64_t seg = e < El ? static_cast<int64_t>(__ldcg(a.seg_total + e)) : 0;
    const int64_t padded = (seg + BM - 1) / BM * BM;
    int64_t excl, agg;
    Scan(scan_tmp).ExclusiveSum(padded, excl, agg);
    if (e < El) offsets[e] = static_cast<int32_t>(s_carry + excl);
    __syncthreads();
    if (threadIdx.x == 0) s_carry += agg;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int64_t end = s_carry;
    if (end > a.layout.pool_rows) {  // inconsistent counts: never write past the pool
      a.input_status->pool_overflow += 1;
      end = a.layout.pool_rows;
    }
    offsets[El] = static_cast<int32_t>(end);
    s_carry = end;
  }
  if (a.gate_rows < 0) return;
  // The tile bucket on the device: the copy for the larger tiles gets the offsets when the pool's real
  // rows reach gate_rows, the other one zeros (its kernel finds no rows).
  __syncthreads();
  const int chosen = gated_copy_for(s_carry, a.gate_rows);
  for (int64_t e = threadIdx.x; e <= El; e += blockDim.x) {
    a.gated_offsets[chosen * (El + 1) + e] = e < El ? offsets[e] : static_cast<int32_t>(s_carry);
    a.gated_offsets[(1 - chosen) * (El + 1) + e] = 0;
  }
}

// kExpertScale: pool_weight[p] = fp32(routing weight * expert_weight_scale[e]) for the local expert e
// of row p (nvfp4 weights on the bf16 GEMM: FC2's per-expert global scale folded into the row weight
// its epilogue applies); else the routing weight as received.
template <bool kExpertScale>
__device__ __forceinline__ void pool_scatter(const TransportArgs& a, const float* __restrict__ expert_weight_scale) {
  const int R = a.sig.num_ranks;
  const int64_t k = a.top_k(), El = a.experts_per_rank(), T_max = a.t_max(), chunks = a.num_chunks();
  const int64_t H = a.hidden();
  const bool fp8 = a.layout.params.dispatch_format == kWsFp8Block;
  const int64_t row_bytes = H * ws_elem_bytes(a.layout.params.dispatch_format);
  const int64_t scale_cols = H / fmt::kFp8BlockSize;
  const int lane = threadIdx.x & 31;
  const int32_t* recv_counts = a.own<int32_t>(a.layout.recv_token_counts);
  const int32_t* offsets = a.own<int32_t>(a.layout.expert_offsets);
  int32_t* pool_src = a.own<int32_t>(a.layout.pool_src);
  char* pool_x = a.own<char>(a.layout.pool_x);
  float* pool_scales = a.own<float>(a.layout.pool_x_scales);
  const char* recv_x = a.own<char>(a.layout.recv_tokens);
  const float* recv_scales = a.own<float>(a.layout.recv_scales);
  const int64_t pool_end = offsets[El];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t warp_id = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const bool owner_reduce = a.layout.params.owner_reduce != 0;

  for (int64_t w = warp_id; w < R * T_max; w += warps) {
    const int s = static_cast<int>(w / T_max);
    const int64_t i = w % T_max;
    if (i >= min(static_cast<int64_t>(recv_counts[s]), T_max)) continue;
    const int32_t* experts = meta_experts(a, w);
    const int64_t chunk = i / kPoolChunkRows;
    for (int j = 0; j < k; ++j) {
      const int32_t e = meta_expert(a, experts, j);
      int64_t p = -1;
      if (e >= 0) {
        p = offsets[e] + a.pool_hist[(s * chunks + chunk) * El + e] + a.pool_intra[w * k + j];
        if (p < 0 || p >= pool_end || p >= offsets[e] + a.seg_total[e]) p = -1;  // inconsistent input
      }
      if (owner_reduce && lane == 0) a.recv_pool_row[w * k + j] = static_cast<int32_t>(p);
      if (p < 0) continue;
      if (lane == 0) {
        pool_src[p] = static_cast<int32_t>(w * k + j);
        const int32_t* meta = experts - 1;
        const int64_t t = meta[0];
        a.pool_dst[p] = (t >= 0 && t < T_max) ? static_cast<int32_t>((s * T_max + t) * k + j) : -1;
        if constexpr (kExpertScale)
          a.pool_weight[p] = __fmul_rn(__int_as_float(meta[1 + k + j]), expert_weight_scale[e]);
        else
          a.pool_weight[p] = __int_as_float(meta[1 + k + j]);
      }
      for (int64_t c = lane; c < row_bytes / 16; c += 32)
        st_v4(pool_x + p * row_bytes + c * 16, *reinterpret_cast<const uint4*>(recv_x + w * row_bytes + c * 16));
      if (fp8)
        for (int64_t c = lane; c < scale_cols; c += 32) pool_scales[p * scale_cols + c] = recv_scales[w * scale_cols + c];
    }
  }
  // Padding rows: pool_src = -1, zero bytes and scales (none when segments are unaligned).
  if (a.layout.params.segment_align <= 1) return;
  for (int64_t p = warp_id; p < pool_end; p += warps) {
    int lo = 0, hi = static_cast<int>(El) - 1;  // last expert with offsets[e] <= p
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= p) lo = mid;
      else hi = mid - 1;
    }
    if (p < offsets[lo] + a.seg_total[lo]) continue;
    if (lane == 0) {
      pool_src[p] = -1;
      a.pool_dst[p] = -1;
    }
    for (int64_t c = lane; c < row_bytes / 16; c += 32) st_v4(pool_x + p * row_bytes + c * 16, make_uint4(0, 0, 0, 0));
    if (fp8)
      for (int64_t c = lane; c < scale_cols; c += 32) pool_scales[p * scale_cols + c] = 0.f;
  }
}

__global__ void __launch_bounds__(256) pool_scatter_kernel(TransportArgs a) {
  pdl_enter();  // launched with launch_pdl (sm90_dispatch.cu)
  pool_scatter<false>(a, nullptr);
}

// expert_weight_scale: fp32 [experts_per_rank] (see pool_scatter).
__global__ void __launch_bounds__(256) pool_scatter_scaled_kernel(TransportArgs a, const float* expert_weight_scale) {
  pdl_enter();  // launched with launch_pdl (sm90_dispatch.cu)
  pool_scatter<true>(a, expert_weight_scale);
}

}  // namespace kernels
}  // namespace megamoe
