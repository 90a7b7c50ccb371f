// sm90_fp8_grouped_gemm.cuh — the Hopper grouped GEMM for the experts: the persistent kernel that
// composes the device building blocks (a fused kernel composes them its own way):
//   sm90_gemm_config.cuh    parameters, tile configuration, shared-memory carve, ring position, tables
//   sm90_gemm_producer.cuh  the TMA producer (produce_tile), end marker, tile order, clusters
//   sm90_gemm_math.cuh      the K loop of one tile (math_tile, math_tile_swapped), slot release
//   sm90_gemm_epilogue.cuh  bf16 rows through a Sink, SwiGLU + requant
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
//   (BLOCK_M 16 and 32, fp8 decode: the operands swapped, see "swapped operands" below; with mxfp4
//   weights one or two math warpgroups, GroupedGemmConfig::kFp4MathWG: two split every chunk's m64
//   halves between them)
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
#include <cstdint>
#include <type_traits>

#include "kernels/common/sm90_clock.cuh"
#include "kernels/gemm/sm90_gemm_config.cuh"
#include "kernels/gemm/sm90_gemm_epilogue.cuh"
#include "kernels/gemm/sm90_gemm_math.cuh"
#include "kernels/gemm/sm90_gemm_producer.cuh"

#if !defined(MEGAMOE_GEMM_TRACE)
#define MEGAMOE_GEMM_TRACE 0
#endif

namespace megamoe::gemm {

// The traced instantiations (kTrace below) exist: CMake's MEGAMOE_GEMM_TRACE, on where the tool is built.
constexpr bool kGemmTraceBuilt = MEGAMOE_GEMM_TRACE != 0;

// ---- the persistent kernel ---------------------------------------------------------------------------

// kTrace: the instantiation that stamps GroupedGemmParams::trace (bench tools); the other one has no
// trace code at all (its stamps cost the math loop registers and K-loop instructions).
template <class Cfg, bool kTrace>
__global__ void __launch_bounds__(Cfg::kNumThreads, Cfg::kCtasPerSm)
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
  if constexpr (Cfg::kWeightMxfp4) {  // the shift table, before build_schedule's barrier
    for (int i = threadIdx.x; i < Cfg::kFp4TableRows; i += blockDim.x) {
      uint32_t lo, hi;
      fmt::mxfp4_shift_table_row(i + fmt::kMxfp4MinShift, &lo, &hi);
      sm.fp4_table[i] = make_uint2(lo, hi);
    }
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
      // in the epilogue, costs +30 instructions per K block (1.5-8% slower; docs/perf-history/gemm.md,
      // session 7).
      const int4 info0 = sm.tile_info[2 * pipe.stage];
      const int32_t t = __shfl_sync(0xffffffffu, info0.x, 0);
      if (t < 0) break;
      // The tile as the producer resolved it (clusters: kLoneTile, the missing second tile of the last
      // pair, comes as a tile of no rows; a branch around a release loop for it instead costs the K
      // loop its uniform registers, +45 instructions per K block).
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
        if constexpr (Cfg::kSwapAB && Cfg::kEpilogue == GemmEpilogue::kStoreBf16)
          epilogue_store_swapped<Cfg>(sm, acc, tile, sink, p.row_weight);
        else if constexpr (Cfg::kSwapAB && !Cfg::kFp8)
          epilogue_swiglu_swapped_bf16<Cfg>(sm, acc, tile, p);
        else if constexpr (Cfg::kSwapAB)
          epilogue_swiglu_swapped<Cfg>(sm, acc, tile, p);
        else if constexpr (Cfg::kEpilogue == GemmEpilogue::kStoreBf16)
          epilogue_store_bf16<Cfg>(sm, acc, tile, wg, sink, p.row_weight, p.tma_store ? &tmap_d : nullptr);
        else
          epilogue_swiglu<Cfg>(acc, tile, wg, p);
      }
      if (uint64_t* rec = tile_rec(t)) rec[5] = kernels::globaltimer_ns();
    }
    // The TMA stores have read their staging before the CTA's shared memory goes away (every lane:
    // a no-op where nothing was issued).
    if constexpr (Cfg::kEpilogue == GemmEpilogue::kStoreBf16) ptx::bulk_wait_all();
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
  static_assert(Cfg::smem_bytes(Cfg::kMaxExperts) <= Cfg::kSmemPerCta, "the ring fits the shared memory a CTA holds");
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
      if constexpr (Cfg::kFp8 && kGemmTraceBuilt) {  // the traced kernel exists for fp8 only
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
    if constexpr (kGemmTraceBuilt) {
      if (p.trace != nullptr) return cudaLaunchKernelEx(&lc, sm90_grouped_gemm_kernel<Cfg, true>, tmap_a, tmap_b, tmap_sfa, tmap_d, p);
    }
    return cudaLaunchKernelEx(&lc, sm90_grouped_gemm_kernel<Cfg, false>, tmap_a, tmap_b, tmap_sfa, tmap_d, p);
  }
  if (launched != nullptr) *launched = grid;
  if constexpr (Cfg::kFp8 && kGemmTraceBuilt) {
    if (p.trace != nullptr) {
      sm90_grouped_gemm_kernel<Cfg, true><<<grid, Cfg::kNumThreads, smem, stream>>>(tmap_a, tmap_b, tmap_sfa, tmap_d, p);
      return cudaGetLastError();
    }
  }
  sm90_grouped_gemm_kernel<Cfg, false><<<grid, Cfg::kNumThreads, smem, stream>>>(tmap_a, tmap_b, tmap_sfa, tmap_d, p);
  return cudaGetLastError();
}

// X(BLOCK_M, BLOCK_N, fp8, epilogue, cluster)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_FP8(X)             \
  X(16, 128, true, GemmEpilogue::kStoreBf16, 1)         \
  X(16, 256, true, GemmEpilogue::kStoreBf16, 1)         \
  X(16, 256, true, GemmEpilogue::kSwigluFp8, 1)         \
  X(32, 128, true, GemmEpilogue::kStoreBf16, 1)         \
  X(32, 256, true, GemmEpilogue::kStoreBf16, 1)         \
  X(32, 256, true, GemmEpilogue::kSwigluFp8, 1)         \
  X(64, 128, true, GemmEpilogue::kStoreBf16, 1)         \
  X(64, 256, true, GemmEpilogue::kStoreBf16, 1)         \
  X(128, 128, true, GemmEpilogue::kStoreBf16, 1)        \
  X(128, 256, true, GemmEpilogue::kStoreBf16, 1)        \
  X(128, 256, true, GemmEpilogue::kStoreBf16, 2)        \
  X(64, 256, true, GemmEpilogue::kSwigluFp8, 1)         \
  X(128, 256, true, GemmEpilogue::kSwigluFp8, 1)        \
  X(128, 256, true, GemmEpilogue::kSwigluFp8, 2)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_BF16(X)            \
  X(64, 128, false, GemmEpilogue::kStoreBf16, 1)        \
  X(64, 256, false, GemmEpilogue::kStoreBf16, 1)        \
  X(128, 128, false, GemmEpilogue::kStoreBf16, 1)       \
  X(128, 256, false, GemmEpilogue::kStoreBf16, 1)       \
  X(64, 256, false, GemmEpilogue::kSwigluBf16, 1)       \
  X(128, 256, false, GemmEpilogue::kSwigluBf16, 1)
// nvfp4 weights expanded to bf16 (FC1 with the per-expert global scale; FC2 runs the bf16 list's
// store-bf16 configurations): a list and translation unit of their own, so the bf16 ones are untouched.
#define MEGAMOE_GROUPED_GEMM_CONFIGS_BF16_SCALED(X)     \
  X(64, 256, false, GemmEpilogue::kSwigluBf16Scaled, 1) \
  X(128, 256, false, GemmEpilogue::kSwigluBf16Scaled, 1)

// mxfp4 weights: X(BLOCK_M, BLOCK_N, fp8 A, epilogue, cluster, weight fp4, math warpgroups, CTAs per SM),
// one list per math-warpgroup count (GemmTileConfig::fp4_math_wg), one of the 64-row tiles (two math
// warpgroups only) and one of the 16-row tiles at two CTAs per SM (GemmTileConfig::ctas_per_sm), each
// instantiated in a translation unit of its own (sm90_grouped_gemm_mxfp4_inst.cu,
// sm90_grouped_gemm_mxfp4_2wg_inst.cu, sm90_grouped_gemm_mxfp4_64_inst.cu, sm90_grouped_gemm_mxfp4_2cta_inst.cu).
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_WG(X, WG)          \
  X(16, 256, true, GemmEpilogue::kStoreBf16, 1, true, WG, 1)  \
  X(16, 256, true, GemmEpilogue::kSwigluFp8, 1, true, WG, 1)  \
  X(32, 256, true, GemmEpilogue::kStoreBf16, 1, true, WG, 1)  \
  X(32, 256, true, GemmEpilogue::kSwigluFp8, 1, true, WG, 1)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_1WG(X) MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_WG(X, 1)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_2WG(X) MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_WG(X, 2)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_64(X)           \
  X(64, 256, true, GemmEpilogue::kStoreBf16, 1, true, 2, 1) \
  X(64, 256, true, GemmEpilogue::kSwigluFp8, 1, true, 2, 1)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_2CTA(X)         \
  X(16, 256, true, GemmEpilogue::kStoreBf16, 1, true, 2, 2) \
  X(16, 256, true, GemmEpilogue::kSwigluFp8, 1, true, 2, 2)
// nvfp4 weights in the pipeline (bf16 tokens; FC1 the scaled bf16 SwiGLU, FC2 bf16 rows), two math
// warpgroups, one CTA per SM: sm90_grouped_gemm_nvfp4_inst.cu.
#define MEGAMOE_GROUPED_GEMM_CONFIGS_NVFP4(X)                         \
  X(16, 256, false, GemmEpilogue::kStoreBf16, 1, true, 2, 1)         \
  X(16, 256, false, GemmEpilogue::kSwigluBf16Scaled, 1, true, 2, 1)  \
  X(32, 256, false, GemmEpilogue::kStoreBf16, 1, true, 2, 1)         \
  X(32, 256, false, GemmEpilogue::kSwigluBf16Scaled, 1, true, 2, 1)
#define MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4(X) \
  MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_1WG(X)   \
  MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_2WG(X)   \
  MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_64(X)    \
  MEGAMOE_GROUPED_GEMM_CONFIGS_MXFP4_2CTA(X)
#define MEGAMOE_GROUPED_GEMM_EXTERN_FP4(BM, BN, FP8, EPI, CL, W4, WG, CPS)                                     \
  extern template cudaError_t launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL, W4, WG, CPS>>( \
      const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const GroupedGemmParams&, int,  \
      cudaStream_t, int*);
#define MEGAMOE_GROUPED_GEMM_INSTANTIATE_FP4(BM, BN, FP8, EPI, CL, W4, WG, CPS)                                \
  template cudaError_t launch_grouped_gemm_config<GroupedGemmConfig<BM, BN, FP8, EPI, CL, W4, WG, CPS>>(        \
      const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const CUtensorMap&, const GroupedGemmParams&, int,  \
      cudaStream_t, int*);

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
