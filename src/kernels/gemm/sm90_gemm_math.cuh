// sm90_gemm_math.cuh — the grouped GEMM's math warpgroups: the K loop of one tile into fp32 accumulators
// (math_tile; swapped operands for 16- and 32-row tiles and mxfp4's 64-row ones: math_tile_swapped)
// and the ring-slot release.
#pragma once

#include "kernels/gemm/sm90_gemm_config.cuh"

namespace megamoe::gemm {

// ---- math ------------------------------------------------------------------------------------------

// A math warp is done reading ring slot `stage` (every lane calls; `lane` = threadIdx.x % 32). In a
// cluster the partner CTA's producer writes half of this slot's weight tile too (multicast), so the
// release goes to both CTAs' empty barriers, lane 0 to this CTA's and lane 1 to the partner's: a slot is
// refilled once the math warps of both have read it, and the two rings stay in step. The remote arrive
// has the default (CTA-scope) release: the wgmma reads it orders have completed (wgmma.wait_group);
// a cluster-scope release per K block costs the K loop ~30% (measured with `--probe no-loads`).
template <class Cfg>
__device__ __forceinline__ void release_slot(const GroupedGemmSmem<Cfg>& sm, int stage, int lane) {
  if constexpr (Cfg::kCluster > 1) {
    ptx::mbar_arrive_local_and_remote(lane, &sm.empty[stage], ptx::cluster_map(&sm.empty[stage], ptx::cluster_ctarank() ^ 1u));
  } else {
    ptx::mbar_arrive_if(lane == 0, &sm.empty[stage]);  // predicated, not a branch: 3-5 fewer instructions
  }                                                     // in the swapped K loops
}

// One fp8 K block of math warpgroup `wg`: per 128-column chunk, the four m64n128k32 wgmmas into the
// temporary accumulator, then their promotion acc[c] (+)= (sa * sb[c]) * tmp. kFirst: the tile's first
// K block, whose promotion starts the sum: fmaf(s, tmp, +0), the bits a zeroed acc would give, without
// zeroing 64 registers per chunk between tiles (while the tensor cores wait).
template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_fp8(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int wg, int sfa0,
                                                 float (&acc)[Cfg::kNumChunks][64]) {
  const int lane = threadIdx.x % 32;
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint8_t* a_tile = sm.a + pipe.stage * Cfg::kStageA + wg * 64 * Cfg::kBlockKBytes;
  const uint8_t* b_tile = sm.b + pipe.stage * Cfg::kStageB;
  const uint64_t desc_a = ptx::make_sw128_desc(a_tile);
  const float sa0 = sm.sfa[pipe.stage * Cfg::kSfaStride + sfa0];
  const float sa1 = sm.sfa[pipe.stage * Cfg::kSfaStride + sfa0 + 8];
  float sb[Cfg::kNumChunks];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) sb[c] = sm.sfb[pipe.stage * 4 + c];
  float tmp[64];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) {
    const uint64_t desc_b = ptx::make_sw128_desc(b_tile + c * 128 * Cfg::kBlockKBytes);
    ptx::fence_operands(tmp);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) ptx::wgmma_m64n128k32_e4m3(tmp, desc_a + 2 * k, desc_b + 2 * k, k > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(tmp);
    if (c == Cfg::kNumChunks - 1) {
      // All reads of this slot (wgmma and scales) are done: hand it back to the producer.
      __syncwarp();
      release_slot<Cfg>(sm, pipe.stage, lane);
    }
    const float s0 = sa0 * sb[c], s1 = sa1 * sb[c];
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      acc[c][i + 0] = fmaf(s0, tmp[i + 0], kFirst ? 0.f : acc[c][i + 0]);
      acc[c][i + 1] = fmaf(s0, tmp[i + 1], kFirst ? 0.f : acc[c][i + 1]);
      acc[c][i + 2] = fmaf(s1, tmp[i + 2], kFirst ? 0.f : acc[c][i + 2]);
      acc[c][i + 3] = fmaf(s1, tmp[i + 3], kFirst ? 0.f : acc[c][i + 3]);
    }
  }
  pipe.advance(Cfg::kStages);
}

// Runs the K loop of one tile for math warpgroup `wg` (0-based among the math warpgroups), leaving
// the fp32 result for its 64 rows x BLOCK_N columns in acc[chunk][...] (fragment layout of
// ptx::wgmma_m64n128k32_e4m3). Called by all 128 threads of the warpgroup.
template <class Cfg>
__device__ __forceinline__ void math_tile(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, const GroupedGemmParams& p,
                                          const GroupedTile& t, int wg, float (&acc)[Cfg::kNumChunks][64]) {
  const int num_kb = p.k / Cfg::kBlockK;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  if constexpr (Cfg::kFp8) {
    const int r0 = wg * 64 + warp * 16 + lane / 4;  // this thread's first row in the tile; second is r0 + 8
    const int sfa0 = sfa_first_row(p, t) - sfa_box_start(p, t) + r0;  // its A scale in the slot
    // invariant: num_kb >= 1 (validate_grouped_gemm: K a positive multiple of 128)
    math_k_block_fp8<Cfg, true>(sm, pipe, wg, sfa0, acc);
    for (int kb = 1; kb < num_kb; ++kb) math_k_block_fp8<Cfg, false>(sm, pipe, wg, sfa0, acc);
  } else {
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[c][i] = 0.f;

    for (int kb = 0; kb < num_kb; ++kb) {
      ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
      const uint8_t* a_tile = sm.a + pipe.stage * Cfg::kStageA + wg * 64 * Cfg::kBlockKBytes;
      const uint8_t* b_tile = sm.b + pipe.stage * Cfg::kStageB;
      const uint64_t desc_a = ptx::make_sw128_desc(a_tile);
      // bf16: the wgmmas accumulate in acc itself
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::fence_operands(acc[c]);
      ptx::wgmma_fence();
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) {
        const uint64_t desc_b = ptx::make_sw128_desc(b_tile + c * 128 * Cfg::kBlockKBytes);
#pragma unroll
        for (int k = 0; k < 4; ++k) ptx::wgmma_m64n128k16_bf16(acc[c], desc_a + 2 * k, desc_b + 2 * k, 1);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int c = 0; c < Cfg::kNumChunks; ++c) ptx::fence_operands(acc[c]);
      __syncwarp();
      release_slot<Cfg>(sm, pipe.stage, lane);
      pipe.advance(Cfg::kStages);
    }
  }
}

// ---- swapped operands (BLOCK_M 16 or 32, fp8 and nvfp4; mxfp4 weights also 64) --------------------------------------
//
// The weights are wgmma's A: the tile's BLOCK_N weight rows in m64 halves (chunk c, half h: rows
// 128c + 64h ..), read from the B slot; the tile's BLOCK_M token rows are wgmma's B (N = BLOCK_M), the
// A slot. Accumulator fragment of (c, h): thread (warp w, lane l) holds weight row 128c + 64h + 16w +
// l/4 (+8) for tokens 8i + 2(l%4) + j, i < BLOCK_M / 8, j in {0, 1}; register 4i + 2hh + j is
// row + 8hh (ptx::wgmma_m64n16k32_e4m3 / m64n32k32 / m64n64k32). Token s / 2 * 8 + 2(l%4) + s % 2 is this
// thread's token s, s < BLOCK_M / 4.

// The swapped tile's accumulators of one math warpgroup: [chunk][its half][registers of BLOCK_M tokens]
// (one warpgroup: both halves; two, mxfp4 weights: warpgroup w holds half w of each chunk).
template <class Cfg>
using SwappedAcc = float[Cfg::kNumChunks][Cfg::kSwapHalves][Cfg::kBlockM / 2];

// This thread's math warpgroup on a swapped tile. invariant: the math warpgroups are the CTA's first
// kNumMathWG (thread t is in warpgroup t / 128); with one it is 0 at compile time, whatever the
// kernel's role layout.
template <class Cfg>
__device__ __forceinline__ int swapped_math_wg() {
  return Cfg::kNumMathWG == 1 ? 0 : int(threadIdx.x / 128);
}

template <int kTokens>
__device__ __forceinline__ void wgmma_swapped(float (&d)[kTokens / 2], uint64_t desc_w, uint64_t desc_x, int scale_d) {
  static_assert(kTokens == 16 || kTokens == 32, "swapped fp8 tiles: 16 or 32 tokens");
  if constexpr (kTokens == 16)
    ptx::wgmma_m64n16k32_e4m3(d, desc_w, desc_x, scale_d);
  else
    ptx::wgmma_m64n32k32_e4m3(d, desc_w, desc_x, scale_d);
}

// This thread's token s (fragment column), s < BLOCK_M / 4.
__device__ __forceinline__ int swapped_token(int s, int q) { return (s / 2) * 8 + 2 * q + s % 2; }

// One fp8 K block: every (c, h)'s four m64nBLOCK_Mk32 wgmmas issued before one wait, then the promotion
// acc (+)= (sa[token] * sb[c]) * tmp (kFirst: the tile's first K block, as math_k_block_fp8).
template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_swapped(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int box0,
                                                     SwappedAcc<Cfg>& acc) {
  static_assert(Cfg::kNumMathWG == 1 && Cfg::kSwapHalves == 2, "fp8 weights: one math warpgroup per swapped tile");
  constexpr int kRegs = Cfg::kBlockM / 2;
  const int lane = threadIdx.x % 32, q = lane % 4;
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint64_t desc_x = ptx::make_sw128_desc(sm.a + pipe.stage * Cfg::kStageA);
  const uint8_t* w_tile = sm.b + pipe.stage * Cfg::kStageB;
  const float* sfa = sm.sfa + pipe.stage * Cfg::kSfaStride + box0;
  float sa[Cfg::kBlockM / 4];  // this thread's tokens
#pragma unroll
  for (int s = 0; s < Cfg::kBlockM / 4; ++s) sa[s] = sfa[swapped_token(s, q)];
  float sb[Cfg::kNumChunks];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) sb[c] = sm.sfb[pipe.stage * 4 + c];
  SwappedAcc<Cfg> tmp;
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) ptx::fence_operands(tmp[c][h]);
  ptx::wgmma_fence();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint64_t desc_w = ptx::make_sw128_desc(w_tile + (c * 128 + h * 64) * Cfg::kBlockKBytes);
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_swapped<Cfg::kBlockM>(tmp[c][h], desc_w + 2 * k, desc_x + 2 * k, k > 0);
    }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h) ptx::fence_operands(tmp[c][h]);
  // All reads of this slot (wgmma and scales) are done: hand it back to the producer.
  __syncwarp();
  release_slot<Cfg>(sm, pipe.stage, lane);
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const float sc = sa[(i / 4) * 2 + (i % 2)] * sb[c];
        acc[c][h][i] = fmaf(sc, tmp[c][h][i], kFirst ? 0.f : acc[c][h][i]);
      }
  pipe.advance(Cfg::kStages);
}

// ---- mxfp4 weights (Cfg::kWeightFp4, swapped tiles) ----------------------------------------------------
//
// The weight slot holds the tile's four 64-row pieces of gemm_weights.h's layout (slab 2c + h is chunk
// c's half h). Math warpgroup w computes halves w * kSwapHalves .. + kSwapHalves - 1 of both chunks (one
// warpgroup: all four slabs; two: slabs w and 2 + w each). Each thread reads, per slab, two 16-byte runs
// of codes (its eight words: steps 0..3 of its rows m0 and m0 + 8) and its two rows' shift indices, and
// expands every word with the shift table row of its (row, step) into two A registers: a[0] / a[2] from
// row m0's word, a[1] / a[3] from row m0 + 8's. All A registers of the K block (16 per slab) exist before
// its wgmmas (4 per slab) issue (the hardware reads them after issue; they are held until the wait). The
// block scale S of chunk c is fp8-block's sb[c].

template <int kTokens>
__device__ __forceinline__ void wgmma_swapped_rs(float (&d)[kTokens / 2], const uint32_t (&a)[4], uint64_t desc_x,
                                                 int scale_d) {
  static_assert(kTokens == 16 || kTokens == 32 || kTokens == 64, "swapped mxfp4 tiles: 16, 32 or 64 tokens");
  if constexpr (kTokens == 16)
    ptx::wgmma_m64n16k32_e4m3_rs(d, a, desc_x, scale_d);
  else if constexpr (kTokens == 32)
    ptx::wgmma_m64n32k32_e4m3_rs(d, a, desc_x, scale_d);
  else
    ptx::wgmma_m64n64k32_e4m3_rs(d, a, desc_x, scale_d);
}

template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_swapped_fp4(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe, int box0,
                                                         SwappedAcc<Cfg>& acc) {
  constexpr int kRegs = Cfg::kBlockM / 2, kHalves = Cfg::kSwapHalves;
  const int tid = threadIdx.x % 128, lane = tid % 32, q = lane % 4;
  const int m0 = (tid / 32) * 16 + lane / 4;  // this thread's fragment rows in each slab: m0, m0 + 8
  const int half0 = swapped_math_wg<Cfg>() * kHalves;  // this warpgroup's first half of each chunk
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint64_t desc_x = ptx::make_sw128_desc(sm.a + pipe.stage * Cfg::kStageA);
  const uint8_t* w_tile = sm.b + pipe.stage * Cfg::kStageB;
  const float* sfa = sm.sfa + pipe.stage * Cfg::kSfaStride + box0;
  float sa[Cfg::kBlockM / 4];
#pragma unroll
  for (int s = 0; s < Cfg::kBlockM / 4; ++s) sa[s] = sfa[swapped_token(s, q)];
  float sb[Cfg::kNumChunks];
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c) sb[c] = sm.sfb[pipe.stage * 4 + c];
  uint32_t a[Cfg::kNumChunks][kHalves][4][4];  // [chunk][this warpgroup's half][k32 step][register]
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint8_t* slab = w_tile + (2 * c + half0 + h) * kFp4SlabBytes;
      const uint4 f0 = *reinterpret_cast<const uint4*>(slab + 16 * tid);
      const uint4 f1 = *reinterpret_cast<const uint4*>(slab + 2048 + 16 * tid);
      const uint32_t sh0 = *reinterpret_cast<const uint32_t*>(slab + kFp4SlabCodeBytes + 4 * m0);
      const uint32_t sh1 = *reinterpret_cast<const uint32_t*>(slab + kFp4SlabCodeBytes + 4 * (m0 + 8));
      const uint32_t words[4][2] = {{f0.x, f0.y}, {f0.z, f0.w}, {f1.x, f1.y}, {f1.z, f1.w}};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        // byte s of the shift word is the table row's byte offset: one PRMT extracts it
        const uint8_t* table = reinterpret_cast<const uint8_t*>(sm.fp4_table);
        const uint2 t0 = *reinterpret_cast<const uint2*>(table + fmt::byte_perm(sh0, 0u, 0x4440u | s));
        const uint2 t1 = *reinterpret_cast<const uint2*>(table + fmt::byte_perm(sh1, 0u, 0x4440u | s));
        fmt::fp4_word_to_e4m3(words[s][0], t0.x, t0.y, &a[c][h][s][0], &a[c][h][s][2]);
        fmt::fp4_word_to_e4m3(words[s][1], t1.x, t1.y, &a[c][h][s][1], &a[c][h][s][3]);
      }
    }
  SwappedAcc<Cfg> tmp;
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::fence_operands(tmp[c][h]);
#pragma unroll
      for (int s = 0; s < 4; ++s) ptx::fence_operands(a[c][h][s]);
    }
  ptx::wgmma_fence();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma_swapped_rs<Cfg::kBlockM>(tmp[c][h], a[c][h][s], desc_x + 2 * s, s > 0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::fence_operands(tmp[c][h]);
#pragma unroll
      for (int s = 0; s < 4; ++s) ptx::fence_operands(a[c][h][s]);
    }
  __syncwarp();
  release_slot<Cfg>(sm, pipe.stage, lane);
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const float sc = sa[(i / 4) * 2 + (i % 2)] * sb[c];
        acc[c][h][i] = fmaf(sc, tmp[c][h][i], kFirst ? 0.f : acc[c][h][i]);
      }
  pipe.advance(Cfg::kStages);
}

// ---- nvfp4 weights (Cfg::kWeightNvfp4, swapped tiles) ---------------------------------------------------
//
// The weight slot holds the tile's four 64-row pieces of gemm_weights.h's nvfp4 layout (K blocks of 128:
// eight k16 steps), sliced over the math warpgroups as for mxfp4. Each thread reads, per slab, two 16-byte
// runs of codes (its eight words: steps 0-1, 2-3, 4-5 and 6-7 of its rows m0 and m0 + 8) and its two rows'
// 8-byte scale runs, expands every word into four bf16x2 A registers (fmt::fp4_word_to_bf16x2_pow120) and
// multiplies each pair by its (row, step) block scale (fmt::nvfp4_scale_bf16x2: e4m3 x 2^-120 as bf16):
// the exact e2m1 x scale products. The token slot is two 64-column bf16 boxes (steps 0-3, 4-7). The
// wgmmas accumulate straight into acc over the whole K (bf16 tokens carry no scale; the global scale
// is the epilogue's).
template <int kTokens>
__device__ __forceinline__ void wgmma_swapped_bf16_rs(float (&d)[kTokens / 2], const uint32_t (&a)[4], uint64_t desc_x,
                                                      int scale_d) {
  static_assert(kTokens == 16 || kTokens == 32, "swapped nvfp4 tiles: 16 or 32 tokens");
  if constexpr (kTokens == 16)
    ptx::wgmma_m64n16k16_bf16_rs(d, a, desc_x, scale_d);
  else
    ptx::wgmma_m64n32k16_bf16_rs(d, a, desc_x, scale_d);
}

template <class Cfg, bool kFirst>
__device__ __forceinline__ void math_k_block_swapped_nvfp4(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe,
                                                           SwappedAcc<Cfg>& acc) {
  constexpr int kHalves = Cfg::kSwapHalves, kSteps = Cfg::kBlockK / 16;
  static_assert(kSteps == 8 && Cfg::kASubTiles == 2, "nvfp4: K blocks of 128, two token boxes");
  const int tid = threadIdx.x % 128, lane = tid % 32;
  const int m0 = (tid / 32) * 16 + lane / 4;  // this thread's fragment rows in each slab: m0, m0 + 8
  const int half0 = swapped_math_wg<Cfg>() * kHalves;
  ptx::mbar_wait(&sm.full[pipe.stage], pipe.phase);
  const uint64_t desc_x = ptx::make_sw128_desc(sm.a + pipe.stage * Cfg::kStageA);
  constexpr uint64_t kBoxDesc = Cfg::kBlockM * Cfg::kBlockKBytes / 16;  // the second box, in descriptor units
  const uint8_t* w_tile = sm.b + pipe.stage * Cfg::kStageB;
  uint32_t a[Cfg::kNumChunks][kHalves][kSteps][4];  // [chunk][this warpgroup's half][k16 step][register]
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint8_t* slab = w_tile + (2 * c + half0 + h) * kNvfp4SlabBytes;
      const uint4 f0 = *reinterpret_cast<const uint4*>(slab + 16 * tid);
      const uint4 f1 = *reinterpret_cast<const uint4*>(slab + 2048 + 16 * tid);
      const uint2 sw0 = *reinterpret_cast<const uint2*>(slab + kNvfp4SlabCodeBytes + 8 * m0);
      const uint2 sw1 = *reinterpret_cast<const uint2*>(slab + kNvfp4SlabCodeBytes + 8 * (m0 + 8));
      const uint32_t words[4][2] = {{f0.x, f0.y}, {f0.z, f0.w}, {f1.x, f1.y}, {f1.z, f1.w}};  // [step pair][row]
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t r0[4], r1[4];
        fmt::fp4_word_to_bf16x2_pow120(words[j][0], r0);
        fmt::fp4_word_to_bf16x2_pow120(words[j][1], r1);
        const uint32_t sc0 = j < 2 ? sw0.x : sw0.y, sc1 = j < 2 ? sw1.x : sw1.y;  // steps 0-3, 4-7
#pragma unroll
        for (int t = 0; t < 2; ++t) {  // step 2j + t: pairs 2t (columns 2q, 2q + 1) and 2t + 1 (+ 8)
          const int st = 2 * j + t;
          const uint32_t s0 = fmt::nvfp4_scale_bf16x2(sc0, st % 4), s1 = fmt::nvfp4_scale_bf16x2(sc1, st % 4);
          a[c][h][st][0] = ptx::mul_bf16x2(r0[2 * t], s0);
          a[c][h][st][1] = ptx::mul_bf16x2(r1[2 * t], s1);
          a[c][h][st][2] = ptx::mul_bf16x2(r0[2 * t + 1], s0);
          a[c][h][st][3] = ptx::mul_bf16x2(r1[2 * t + 1], s1);
        }
      }
    }
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::fence_operands(acc[c][h]);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) ptx::fence_operands(a[c][h][s]);
    }
  ptx::wgmma_fence();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
        wgmma_swapped_bf16_rs<Cfg::kBlockM>(acc[c][h], a[c][h][s], desc_x + (s / 4) * kBoxDesc + 2 * (s % 4),
                                            (kFirst && s == 0) ? 0 : 1);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::fence_operands(acc[c][h]);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) ptx::fence_operands(a[c][h][s]);
    }
  __syncwarp();
  release_slot<Cfg>(sm, pipe.stage, lane);
  pipe.advance(Cfg::kStages);
}

template <class Cfg>
__device__ __forceinline__ void math_tile_swapped(const GroupedGemmSmem<Cfg>& sm, PipeState& pipe,
                                                  const GroupedGemmParams& p, const GroupedTile& t,
                                                  SwappedAcc<Cfg>& acc) {
  const int box0 = sfa_first_row(p, t) - sfa_box_start(p, t);  // the tile's first token in the scale slot
  // invariant: num_kb >= 1 (validate_grouped_gemm: K a positive multiple of 128)
  if constexpr (Cfg::kWeightNvfp4) {
    (void)box0;
    math_k_block_swapped_nvfp4<Cfg, true>(sm, pipe, acc);
    for (int kb = 1; kb < p.k / Cfg::kBlockK; ++kb) math_k_block_swapped_nvfp4<Cfg, false>(sm, pipe, acc);
  } else if constexpr (Cfg::kWeightFp4) {
    math_k_block_swapped_fp4<Cfg, true>(sm, pipe, box0, acc);
    for (int kb = 1; kb < p.k / Cfg::kBlockK; ++kb) math_k_block_swapped_fp4<Cfg, false>(sm, pipe, box0, acc);
  } else {
    math_k_block_swapped<Cfg, true>(sm, pipe, box0, acc);
    for (int kb = 1; kb < p.k / Cfg::kBlockK; ++kb) math_k_block_swapped<Cfg, false>(sm, pipe, box0, acc);
  }
}

}  // namespace megamoe::gemm
