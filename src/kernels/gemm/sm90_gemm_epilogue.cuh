// sm90_gemm_epilogue.cuh — the grouped GEMM's epilogues, run by the math warpgroups from their accumulators:
// bf16 rows through a Sink (epilogue_store_bf16, epilogue_store_swapped) and SwiGLU + requant
// (epilogue_swiglu, epilogue_swiglu_swapped) or to bf16 (epilogue_swiglu, epilogue_swiglu_swapped_bf16).
#pragma once

#include <cuda_bf16.h>

#include "kernels/common/sm90_quant.cuh"
#include "kernels/gemm/sm90_gemm_math.cuh"
#include "megamoe/formats.h"

namespace megamoe::gemm {

// ---- epilogues -------------------------------------------------------------------------------------

// Where an output row goes. The default sink writes D[row_map ? row_map[a_row] : a_row], or, with
// peer buffers, row row_map % peer_d_rows of peer_d[row_map / peer_d_rows] (a rank's combine region
// through its LSA pointer); a fused kernel may supply its own sink (row_ptr and put: the mega kernel's
// in-kernel FC2 reduce adds the pieces instead of storing them).
struct DefaultRowSink {
  const GroupedGemmParams& p;
  __device__ __forceinline__ __nv_bfloat16* row_ptr(int32_t a_row) const {
    const int32_t dst = p.row_map ? p.row_map[a_row] : a_row;
    if (dst < 0) return nullptr;
    if (p.num_peer_d > 0) {
      const int32_t peer = dst / p.peer_d_rows;
      return peer < p.num_peer_d ? p.peer_d[peer] + int64_t(dst - peer * p.peer_d_rows) * p.ld_d : nullptr;
    }
    return static_cast<__nv_bfloat16*>(p.d) + int64_t(dst) * p.ld_d;
  }
  // Stores 8 bf16 at `to` (16-byte aligned), a piece of the row row_ptr gave.
  __device__ __forceinline__ void put(__nv_bfloat16* to, const uint4& v) const { *reinterpret_cast<uint4*>(to) = v; }
};

// Quad transpose: the 4 lanes q of a quad each hold x[0..3]; afterwards y[p] = lane p's x[q]. Used
// to turn the wgmma fragment (a quad holds 8 consecutive columns of one row per 8-column group,
// 2 per lane) into one contiguous 4-group segment per lane, so the epilogue issues 16-byte
// (bf16) / 8-byte (e4m3) stores of full sectors instead of 4-byte / 2-byte ones. All 32 lanes
// must call it (warp shuffles); selects, not indexed registers, keep everything in registers.
__device__ __forceinline__ void quad_transpose(const uint32_t (&x)[4], uint32_t (&y)[4]) {
  const int q = threadIdx.x & 3;
  auto pick = [&](int k) { return k == 0 ? x[0] : k == 1 ? x[1] : k == 2 ? x[2] : x[3]; };
  const uint32_t r1 = __shfl_xor_sync(0xffffffffu, pick(q ^ 1), 1);
  const uint32_t r2 = __shfl_xor_sync(0xffffffffu, pick(q ^ 2), 2);
  const uint32_t r3 = __shfl_xor_sync(0xffffffffu, pick(q ^ 3), 3);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int d = p ^ q;
    y[p] = d == 0 ? x[p] : d == 1 ? r1 : d == 2 ? r2 : r3;
  }
}

// bf16 rows: value = acc (* row_weight), rounded once. Each warp stages its 16 rows 64 columns at a
// time in shared memory with stmatrix (the accumulator fragment's 8x8 blocks are stmatrix's layout,
// so no shuffles), then reads them back as whole 16-byte row pieces and stores those: 8 lanes per
// 128-byte row segment, full sectors, any row mapping (the sink's pointer per row). A shuffle
// transpose instead costs ~940 instructions per warp per tile (ncu), while the tensor cores idle.
// Staging rows are 128 bytes with the 16-byte pieces XOR-swizzled by (row & 7): conflict-free
// stmatrix rows and read-back.
// invariant: D rows are 16-byte aligned (validate_grouped_gemm checks d and ldd).
//
// tma_d (null: not used): a tensor map of D itself ([rows, N] bf16, box 64 x 16, 128-byte swizzle:
// the staging rows' layout), for a sink that stores row r at D row r. A warp whose 16 rows all lie
// inside the tile's segment then stores each staged 16 x 64 slab with one TMA tensor store instead
// of the read-back and 16-byte stores (rows past the segment must not be written, so a partial
// slab takes the per-row path); the staging is reused once the store has read it.
template <class Cfg, class Sink>
__device__ __forceinline__ void epilogue_store_bf16(const GroupedGemmSmem<Cfg>& sm, const float (&acc)[Cfg::kNumChunks][64],
                                                    const GroupedTile& t, int wg, const Sink& sink,
                                                    const float* row_weight, const CUtensorMap* tma_d = nullptr) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int wrow0 = wg * 64 + warp * 16;  // the warp's first row in the tile
  const uint8_t* stage_ptr = sm.out + (wg * 4 + warp) * 2048;
  const uint32_t stage = ptx::smem_addr(stage_ptr);
  // warp-uniform; read through a shuffle so that ptxas knows it (a branch on a value it must treat as
  // per-lane moves the mainloop's ring position out of uniform registers)
  const bool tma = __shfl_sync(0xffffffffu, tma_d != nullptr && wrow0 + 16 <= t.rows ? 1 : 0, 0) != 0;
  // This lane's two accumulator rows (lane / 4 and + 8) and their weights.
  float w0 = 1.f, w1 = 1.f;
  if (row_weight != nullptr) {
    const int r0 = wrow0 + lane / 4;
    if (r0 < t.rows) w0 = row_weight[t.row0 + r0];
    if (r0 + 8 < t.rows) w1 = row_weight[t.row0 + r0 + 8];
  }
  // stmatrix addresses: lane l gives row (l & 7) + 8 * ((l >> 3) & 1) of 16-byte piece (l >> 4) of
  // each pair of 8-column groups.
  const int st_row = (lane & 7) + 8 * ((lane >> 3) & 1), st_piece = lane >> 4;
  // Rounds the warp's 16 rows x 64 columns of chunk c, half `half`, to bf16 and writes them into the
  // staging rows.
  const auto stage_slab = [&](int c, int half) {
#pragma unroll
    for (int g2 = 0; g2 < 4; ++g2) {  // 8-column groups 2*g2 and 2*g2+1 of this 64-column half
      const int g = half * 8 + 2 * g2;
      uint32_t r[4];
#pragma unroll
      for (int m = 0; m < 2; ++m)  // group g + m, rows lane/4 (h = 0) and lane/4 + 8 (h = 1)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float v0 = acc[c][4 * (g + m) + 2 * h], v1 = acc[c][4 * (g + m) + 2 * h + 1];
          const float w = h == 0 ? w0 : w1;
          r[2 * m + h] = row_weight ? kernels::cvt_bf16x2(v0 * w, v1 * w) : kernels::cvt_bf16x2(v0, v1);
        }
      const int piece = 2 * g2 + st_piece;
      ptx::stmatrix_x4(stage + st_row * 128 + ((piece ^ (st_row & 7)) << 4), r[0], r[1], r[2], r[3]);
    }
  };
  // Two loops, one per path, chosen once per tile: with the per-row path in the same loop body (a
  // branch per slab) FC2 runs ~1% slower (against the per-row path compiled out;
  // docs/perf-history/gemm.md, session 15).
  if (tma) {
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        ptx::bulk_wait_read<0>();  // the staging's previous TMA store (this tile's or the last one's) has read it
        __syncwarp();
        stage_slab(c, half);
        ptx::fence_proxy_async_smem();
        __syncwarp();
        ptx::tma_store_2d(lane == 0, tma_d, stage_ptr, t.n_block * Cfg::kBlockN + c * 128 + half * 64, t.row0 + wrow0);
        ptx::bulk_commit();  // a no-op where nothing was issued
      }
  } else {
    // Lane l < 16 resolves row l's destination once; the others get it by shuffle.
    __nv_bfloat16* my_row = nullptr;
    if (lane < 16 && wrow0 + lane < t.rows) my_row = sink.row_ptr(t.row0 + wrow0 + lane);
    // read-back: lane l takes row 4 * it + l / 8, piece l % 8
    const int rb_piece = lane % 8;
    if (tma_d != nullptr) {  // an earlier tile's TMA stores from this staging have read it
      ptx::bulk_wait_read<0>();  // every lane: a no-op where nothing is pending
      __syncwarp();
    }
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        stage_slab(c, half);
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int row = 4 * it + lane / 8;
          const uint4 v = ptx::lds_v4(stage + row * 128 + ((rb_piece ^ (row & 7)) << 4));
          const unsigned long long pr =
              __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(my_row), row);
          __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(pr);
          if (out != nullptr) sink.put(out + t.n_block * Cfg::kBlockN + c * 128 + half * 64 + 8 * rb_piece, v);
        }
        __syncwarp();  // the next stmatrix overwrites the staging rows
      }
  }
}

// bf16 rows of a swapped tile: token row r gets the tile's BLOCK_N columns (times row_weight[r]).
// The fragment's 8 x 8 blocks (8 weight rows x 8 tokens) go through stmatrix.trans into staging rows
// of one token each ([BLOCK_M tokens][BLOCK_N] bf16, 16-byte pieces XOR-swizzled by token & 7 within
// each 64-column half: conflict-free), each math warpgroup its own halves of the chunks, then the math
// threads copy the 16-byte pieces of the tile's real token rows to where the sink puts them. Two named
// barriers over the math threads (id 1, all kNumMathWG warpgroups): the staging is read before it is
// rewritten, and complete before it is read.
template <class Cfg, class Sink>
__device__ __forceinline__ void epilogue_store_swapped(const GroupedGemmSmem<Cfg>& sm, const SwappedAcc<Cfg>& acc,
                                                       const GroupedTile& t, const Sink& sink,
                                                       const float* row_weight) {
  constexpr int kPitch = Cfg::kBlockN * 2;   // bytes per staged token row
  constexpr int kPieces = Cfg::kBlockN / 8;  // 16-byte pieces per token row
  constexpr int kTok = Cfg::kBlockM / 4;     // tokens per thread
  static_assert(Cfg::kBlockM * kPitch <= Cfg::kStageOut, "staging holds the tile's token rows");
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32, q = lane % 4;
  const int half0 = swapped_math_wg<Cfg>() * Cfg::kSwapHalves;  // this warpgroup's first half of each chunk
  // this thread among the math threads (the CTA's first kMathThreads): ptxas then knows the copy-out's
  // trip count is the same for every thread (a bound it cannot see costs the K loop its uniform ring
  // position: +16 R2UR per K block)
  const int math_tid = Cfg::kNumMathWG == 1 ? tid : int(threadIdx.x % Cfg::kMathThreads);
  const uint32_t stage = ptx::smem_addr(sm.out);
  float w[kTok];  // weights of this thread's tokens (swapped_token)
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int tok = swapped_token(s, q);
    w[s] = row_weight != nullptr && tok < t.rows ? row_weight[t.row0 + tok] : 1.f;
  }
  // stmatrix.trans, 16 tokens per call: lane L gives row L % 8 of matrix L / 8 = 2j' + hh (tokens
  // 16g + 8j' .., weight rows + 8hh)
  const int hh_l = (lane / 8) % 2;
  ptx::named_barrier_sync(1, Cfg::kMathThreads);  // the previous tile's copy-out has read the staging
#pragma unroll
  for (int g = 0; g < Cfg::kBlockM / 16; ++g) {
    const int tok_l = 16 * g + (lane / 16) * 8 + lane % 8;
#pragma unroll
    for (int c = 0; c < Cfg::kNumChunks; ++c)
#pragma unroll
      for (int h = 0; h < Cfg::kSwapHalves; ++h) {
        const int n0 = c * 128 + (half0 + h) * 64 + warp * 16 + 8 * hh_l;  // first weight row of this lane's matrix
        const uint32_t addr = stage + tok_l * kPitch + (((n0 / 8) ^ (tok_l & 7)) << 4);
        uint32_t r[4];  // matrix 2j' + hh: (acc[4j + 2hh], acc[4j + 2hh + 1]) for tokens 8j + 2q, + 1, j = 2g + j'
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int j = 2 * g + m / 2, hh = m % 2;
          r[m] = kernels::cvt_bf16x2(acc[c][h][4 * j + 2 * hh] * w[2 * j], acc[c][h][4 * j + 2 * hh + 1] * w[2 * j + 1]);
        }
        ptx::stmatrix_x4_trans(addr, r[0], r[1], r[2], r[3]);
      }
  }
  ptx::named_barrier_sync(1, Cfg::kMathThreads);
#pragma unroll
  for (int idx = math_tid; idx < Cfg::kBlockM * kPieces; idx += Cfg::kMathThreads) {
    const int tok = idx / kPieces, piece = idx % kPieces;
    __nv_bfloat16* out = tok < t.rows ? sink.row_ptr(t.row0 + tok) : nullptr;
    if (out != nullptr) {
      const uint4 v = ptx::lds_v4(stage + tok * kPitch + ((piece ^ (tok & 7)) << 4));  // read, then the address
      sink.put(out + t.n_block * Cfg::kBlockN + piece * 8, v);
    }
  }
}

// silu(g) * u in fp32 from the fast exponential and division (g / (1 + e), 0 when 1 + e overflows;
// a few ulp from the host's silu, far below the bf16 / e4m3 step of the output) and an IEEE multiply.
// e = 2^(-g * log2 e) by ex2.approx.ftz: __expf's bits wherever e is normal, and 0 where __expf gives a
// subnormal (g > 87.3), which 1 + e rounds away either way; it saves __expf's range check and
// rescaling (three instructions per element).
// Not a codec: the requantisation below is. The epilogue runs while the tensor cores idle, on two
// warps per scheduler, so every instruction per element shows in the layer's time.
__device__ __forceinline__ float swiglu(float g, float u) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return __fmul_rn(__fdividef(g, 1.f + e), u);
}

// SwiGLU over a 128 gate + 128 up tile: h[:, 128 * n_block ...] of width 128, one 1x128 block per
// row: fp8 e4m3 codes + fp32 scale (fmt::fp8_block_scale of the row's amax and e4m3(div_rn(h, s)),
// as fmt::quantize_fp8_1x128 computes them), or bf16. Stores: 8 bytes (e4m3) / 16 bytes (bf16)
// per lane after the quad transpose. kSwigluBf16Scaled: gate and up are each fp32(acc * s) with
// s = b_expert_scale[expert] (in p.sfb, which bf16 tiles do not otherwise read) before the SwiGLU
// (compiled out of every other configuration).
template <class Cfg>
__device__ __forceinline__ void epilogue_swiglu(const float (&acc)[Cfg::kNumChunks][64], const GroupedTile& t, int wg,
                                                const GroupedGemmParams& p) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, q = lane % 4;
  constexpr bool kScaled = Cfg::kEpilogue == GemmEpilogue::kSwigluBf16Scaled;
  float es = 1.f;
  if constexpr (kScaled) es = p.sfb[t.expert];
  const auto in = [&](float a) { return kScaled ? __fmul_rn(a, es) : a; };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + warp * 16 + lane / 4 + 8 * h;
    float v[32];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[2 * i] = swiglu(in(acc[0][4 * i + 2 * h]), in(acc[1][4 * i + 2 * h]));
      v[2 * i + 1] = swiglu(in(acc[0][4 * i + 2 * h + 1]), in(acc[1][4 * i + 2 * h + 1]));
      amax = fmaxf(amax, fmaxf(fmt::finite_abs(v[2 * i]), fmt::finite_abs(v[2 * i + 1])));
    }
    // The 4 lanes of a quad hold one row.
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const bool valid = r < t.rows;  // uniform over the quad
    const int64_t a_row = t.row0 + r;
    if constexpr (Cfg::kEpilogue == GemmEpilogue::kSwigluFp8) {
      const float s = fmt::fp8_block_scale(amax, p.pow2_scales != 0);
      const float inv = __frcp_rn(s);
      uint8_t* out = static_cast<uint8_t*>(p.d) + a_row * p.ld_d + t.n_block * 128;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x[4], y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * j + k;
          // == fmt::float_to_e4m3(fmt::div_rn(v, s)) for each of the pair, without the division
          x[k] = kernels::quantize_e4m3_pair(v[2 * i], v[2 * i + 1], s, inv);
        }
        quad_transpose(x, y);
        if (valid)
          *reinterpret_cast<uint2*>(out + 8 * (4 * j + q)) = make_uint2(y[0] | (y[1] << 16), y[2] | (y[3] << 16));
      }
      if (valid && q == 0) {
        const int64_t m = p.layout == GroupedLayout::kMasked ? t.m0 + r : a_row;
        p.sfd[t.expert * p.sfd_expert_stride + int64_t(t.n_block) * p.ld_sfd + m] = s;
      }
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.d) + a_row * p.ld_d + t.n_block * 128;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x[4], y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = kernels::cvt_bf16x2(v[2 * (4 * j + k)], v[2 * (4 * j + k) + 1]);
        quad_transpose(x, y);
        if (valid) *reinterpret_cast<uint4*>(out + 8 * (4 * j + q)) = make_uint4(y[0], y[1], y[2], y[3]);
      }
    }
  }
}

// SwiGLU + fp8 1x128 requant of a swapped tile (chunk 0 = the 128 gate rows, chunk 1 = the matching up
// rows, gemm_weights.h): h = silu(gate) * up per (intermediate column, token), then per token the
// amax over the tile's 128 columns (registers, then lanes of the same l % 4, then every math warp's
// through shared memory), its scale and the e4m3 codes (as epilogue_swiglu computes them), staged as
// token rows ([BLOCK_M][128] codes) and stored 16 bytes at a time; one scale per real token. A math
// warpgroup holds the same halves of both chunks (SwappedAcc), so its gate and up values pair in
// registers: with two, warpgroup w has intermediate columns 64w .. 64w + 63, and only the amax crosses
// warpgroups. Named barrier 1 over the math threads (kMathThreads; never __syncthreads: the producer
// is elsewhere).
template <class Cfg>
__device__ __forceinline__ void epilogue_swiglu_swapped(const GroupedGemmSmem<Cfg>& sm, const SwappedAcc<Cfg>& acc,
                                                        const GroupedTile& t, const GroupedGemmParams& p) {
  static_assert(Cfg::kNumChunks == 2, "gate and up chunks");
  constexpr int kM = Cfg::kBlockM, kTok = kM / 4, kHalves = Cfg::kSwapHalves, kMathWarps = Cfg::kMathThreads / 32;
  const int tid = threadIdx.x % 128, lane = tid % 32, q = lane % 4;
  const int wg = swapped_math_wg<Cfg>(), half0 = wg * kHalves;
  const int warp = tid / 32, math_warp = wg * 4 + warp;
  const int math_tid = Cfg::kNumMathWG == 1 ? tid : int(threadIdx.x % Cfg::kMathThreads);  // as in epilogue_store_swapped
  uint8_t* const codes = sm.out;                                   // [kM tokens][128]
  float* const red = reinterpret_cast<float*>(sm.out + kM * 128);  // [math warps][kM tokens]
  static_assert(kM * 128 + kMathWarps * kM * 4 <= Cfg::kStageOut, "staging holds the codes and the amax");
  float v[kHalves][kM / 2];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < kM / 2; ++i) v[h][i] = swiglu(acc[0][h][i], acc[1][h][i]);
  // token s of this thread (swapped_token): registers (s / 2) * 4 + s % 2 (+ 2) of both halves
  float amax[kTok];
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int i = (s / 2) * 4 + s % 2;
    amax[s] = fmaxf(fmt::finite_abs(v[0][i]), fmt::finite_abs(v[0][i + 2]));
#pragma unroll
    for (int h = 1; h < kHalves; ++h)
      amax[s] = fmaxf(amax[s], fmaxf(fmt::finite_abs(v[h][i]), fmt::finite_abs(v[h][i + 2])));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) amax[s] = fmaxf(amax[s], __shfl_xor_sync(0xffffffffu, amax[s], o));
  }
  ptx::named_barrier_sync(1, Cfg::kMathThreads);  // the previous tile's copy-out has read the staging
  if (lane < 4) {
#pragma unroll
    for (int s = 0; s < kTok; ++s) red[math_warp * kM + swapped_token(s, q)] = amax[s];
  }
  ptx::named_barrier_sync(1, Cfg::kMathThreads);  // every math warp's amax is in `red`
  float scale[kTok];
#pragma unroll
  for (int s = 0; s < kTok; ++s) {
    const int tok = swapped_token(s, q);
    float m[kMathWarps];  // the math warps' amax of this token, reduced pairwise
#pragma unroll
    for (int w = 0; w < kMathWarps; ++w) m[w] = red[w * kM + tok];
#pragma unroll
    for (int d = 1; d < kMathWarps; d *= 2)
#pragma unroll
      for (int w = 0; w + d < kMathWarps; w += 2 * d) m[w] = fmaxf(m[w], m[w + d]);
    scale[s] = fmt::fp8_block_scale(m[0], p.pow2_scales != 0);
    const float inv = __frcp_rn(scale[s]);
    const int i = (s / 2) * 4 + s % 2;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      // rows 64 * half + 16w + l/4 and + 8 of one token: one pair, one scale
      const uint32_t c2 = kernels::quantize_e4m3_pair(v[h][i], v[h][i + 2], scale[s], inv);
      const int row = 64 * (half0 + h) + 16 * warp + lane / 4;
      codes[tok * 128 + row] = uint8_t(c2 & 0xFFu);
      codes[tok * 128 + row + 8] = uint8_t(c2 >> 8);
    }
  }
  ptx::named_barrier_sync(1, Cfg::kMathThreads);
#pragma unroll
  for (int idx = math_tid; idx < kM * 8; idx += Cfg::kMathThreads) {  // kM token rows x 8 pieces of 16 bytes
    const int tok = idx / 8, piece = idx % 8;
    if (tok < t.rows)
      *reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.d) + int64_t(t.row0 + tok) * p.ld_d + t.n_block * 128 +
                                piece * 16) = ptx::lds_v4(ptx::smem_addr(codes + tok * 128 + piece * 16));
  }
  if (math_warp == 0 && lane < 4) {
#pragma unroll
    for (int s = 0; s < kTok; ++s) {
      const int tok = swapped_token(s, q);
      if (tok < t.rows) {
        const int64_t m = p.layout == GroupedLayout::kMasked ? t.m0 + tok : t.row0 + tok;
        p.sfd[t.expert * p.sfd_expert_stride + int64_t(t.n_block) * p.ld_sfd + m] = scale[s];
      }
    }
  }
}

// The scaled bf16 SwiGLU of a swapped tile (nvfp4 weights, kSwigluBf16Scaled): gate and up each
// fp32(acc * s), s = p.sfb[expert] (the image's global scale), then h = silu(gate) * up rounded to bf16,
// as epilogue_swiglu computes it; staged as token rows ([BLOCK_M][128] bf16, 256 bytes each) and stored
// 16 bytes at a time. Named barrier 1 over the math threads (as epilogue_swiglu_swapped).
template <class Cfg>
__device__ __forceinline__ void epilogue_swiglu_swapped_bf16(const GroupedGemmSmem<Cfg>& sm, const SwappedAcc<Cfg>& acc,
                                                             const GroupedTile& t, const GroupedGemmParams& p) {
  static_assert(Cfg::kNumChunks == 2 && Cfg::kEpilogue == GemmEpilogue::kSwigluBf16Scaled, "gate and up chunks, bf16 out");
  constexpr int kM = Cfg::kBlockM, kTok = kM / 4, kHalves = Cfg::kSwapHalves;
  const int tid = threadIdx.x % 128, lane = tid % 32, q = lane % 4, warp = tid / 32;
  const int half0 = swapped_math_wg<Cfg>() * kHalves;
  const int math_tid = Cfg::kNumMathWG == 1 ? tid : int(threadIdx.x % Cfg::kMathThreads);  // as in epilogue_store_swapped
  __nv_bfloat16* const rows = reinterpret_cast<__nv_bfloat16*>(sm.out);  // [kM tokens][128]
  static_assert(kM * 256 <= Cfg::kStageOut, "staging holds the token rows");
  const float es = p.sfb[t.expert];
  ptx::named_barrier_sync(1, Cfg::kMathThreads);  // the previous tile's copy-out has read the staging
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int s = 0; s < kTok; ++s) {
      const int tok = swapped_token(s, q), i = (s / 2) * 4 + s % 2;  // registers i (row m0) and i + 2 (m0 + 8)
      const float v0 = swiglu(__fmul_rn(acc[0][h][i], es), __fmul_rn(acc[1][h][i], es));
      const float v1 = swiglu(__fmul_rn(acc[0][h][i + 2], es), __fmul_rn(acc[1][h][i + 2], es));
      const uint32_t b2 = kernels::cvt_bf16x2(v0, v1);
      const int row = 64 * (half0 + h) + 16 * warp + lane / 4;
      reinterpret_cast<uint16_t*>(rows)[tok * 128 + row] = uint16_t(b2 & 0xFFFFu);
      reinterpret_cast<uint16_t*>(rows)[tok * 128 + row + 8] = uint16_t(b2 >> 16);
    }
  ptx::named_barrier_sync(1, Cfg::kMathThreads);
#pragma unroll
  for (int idx = math_tid; idx < kM * 16; idx += Cfg::kMathThreads) {  // kM token rows x 16 pieces of 16 bytes
    const int tok = idx / 16, piece = idx % 16;
    if (tok < t.rows)
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.d) + int64_t(t.row0 + tok) * p.ld_d + t.n_block * 128 +
                                piece * 8) = ptx::lds_v4(ptx::smem_addr(rows + tok * 128 + piece * 8));
  }
}

}  // namespace megamoe::gemm
