// mega_schedule.h — host-side planning of one MegaMoE forward, shared by the launcher and the CPU
// tests: the tile bucket per forward, the dispatch and reduce shapes, the local scratch layout, and a
// model of the kernel's tile order that checks its dependency rule (tests/cpu/test_mega_schedule.cpp).
// No CUDA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace megamoe::mega {

// BLOCK_M of both GEMMs inside one launch (one kernel instantiation each).
constexpr int kMegaBlockMs[] = {16, 64, 128};
constexpr int kMegaBlockN = 256;
constexpr int mega_block_n() { return kMegaBlockN; }       // both GEMMs: FC1 128 gate + 128 up columns; FC2 256 columns of H
constexpr int kMegaMaxLocalExperts = 512;
constexpr int kMegaMaxExperts = 4096;  // the per-expert count histogram of a dispatch CTA (shared memory)

// Threads of the kernel for a BLOCK_M: the GEMM's warpgroups (math + producer).
constexpr int mega_threads(int block_m) { return block_m == 128 ? 384 : 256; }
// Math warps of a CTA (each bumps an FC1 m-block's counter once per FC1 tile).
constexpr int mega_math_warps(int block_m) { return block_m == 128 ? 8 : 4; }

// The rows a busy expert gets under uniform routing when every rank has `tokens` (mean + 2 standard
// deviations, Poisson): a tile must hold an expert's rows rather than their mean. The routed backend
// buckets its GEMM tiles the same way.
inline int64_t mega_expected_rows_per_expert(int64_t ep_size, int64_t tokens, int64_t top_k, int64_t num_experts) {
  const double mean = static_cast<double>(ep_size * tokens * top_k) / static_cast<double>(num_experts);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(mean + 2.0 * std::sqrt(mean))));
}

// BLOCK_M for a forward: the knob when it names a built one (16 fp8 only), else by rows per expert:
//   <= 16 (decode): 16-row tiles with the operands swapped (fp8; bf16 weights take 64)
//   <= 64: 64-row tiles, one math warpgroup (weight streaming)
//   else: 128-row tiles, two math warpgroups
// mxfp4 weights (weight_fp4): 16 always, the one mxfp4 configuration built.
inline int mega_block_m(int64_t rows_per_expert, bool fp8, int32_t knob_block_m, bool weight_fp4 = false) {
  if (weight_fp4) return 16;
  if (knob_block_m == 64 || knob_block_m == 128 || (knob_block_m == 16 && fp8)) return knob_block_m;
  if (rows_per_expert <= 16 && fp8) return 16;
  if (rows_per_expert <= 64) return 64;
  return 128;
}

// Dispatch shape: tokens per CTA (one CTA ranks at most `threads` tokens) and parts per token (more
// parts, more warps per row, when a CTA has few tokens).
struct MegaDispatchShape {
  int tokens_per_cta = 1;
  int parts = 1;
};
inline MegaDispatchShape mega_dispatch_shape(int64_t tokens, int grid, int threads, int64_t row_chunks) {
  MegaDispatchShape s;
  const int64_t g = std::max(grid, 1);
  s.tokens_per_cta = static_cast<int>(std::max<int64_t>(1, (tokens + g - 1) / g));
  const int64_t rounds = std::max<int64_t>(1, (row_chunks + 31) / 32);
  const int64_t warps = threads / 32;
  s.parts = static_cast<int>(std::min<int64_t>(std::max<int64_t>(warps / s.tokens_per_cta, 1), rounds));
  return s;
}

// Parts per token of the reduce: enough (token, part) items for the math warps of the grid at small T.
inline int mega_reduce_parts(int64_t tokens, int64_t warps, int64_t rounds) {
  const int64_t t = std::max<int64_t>(tokens, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((warps + t - 1) / t, std::max<int64_t>(rounds, 1))));
}

// m-blocks a pool of `pool_rows` rows in `experts` segments can have at `block_m` rows per tile (the
// FC1-done counters: one per m-block).
inline int64_t mega_max_m_blocks(int64_t pool_rows, int64_t experts, int block_m) {
  return pool_rows / block_m + experts;
}

// Local (non-symmetric) scratch of a mega layer, in bytes from its base (256-byte aligned pieces).
struct MegaScratchLayout {
  int64_t counters = 0;     // MegaCounters
  int64_t expert_fill = 0;  // int32 [E_l]: rows claimed so far per local expert (their pool slot)
  int64_t expert_placed = 0;  // int32 [E_l]: rows copied into the pool per local expert (FC1 waits on it)
  int64_t fc1_done = 0;     // int32 [max m-blocks at BLOCK_M 16]: FC1 tiles done per m-block, x math warps
  int64_t max_m_blocks = 0;
  int64_t total = 0;
  static MegaScratchLayout make(int64_t pool_rows, int64_t experts_per_rank, int64_t counters_bytes) {
    MegaScratchLayout s;
    int64_t cur = 0;
    auto take = [&cur](int64_t* off, int64_t bytes) {
      *off = cur;
      cur += (bytes + 255) / 256 * 256;
    };
    s.max_m_blocks = mega_max_m_blocks(pool_rows, experts_per_rank, 16);
    take(&s.counters, counters_bytes);
    take(&s.expert_fill, experts_per_rank * 4);
    take(&s.expert_placed, experts_per_rank * 4);
    take(&s.fc1_done, s.max_m_blocks * 4);
    s.total = cur;
    return s;
  }
};

// The tile sequence of one launch as the kernel runs it, for CPU checks of the dependency rule: tiles
// [0, fc1_tiles) are FC1's (m-block mb, n-block n) and [fc1_tiles, + fc2_tiles) FC2's; FC2 tile u of
// m-block mb waits until every FC1 tile of mb is done. Tiles go out in increasing order (each CTA's
// tiles increase), so a tile only ever waits on tiles handed out before it.
struct MegaTileOrder {
  std::vector<int32_t> m_block_prefix;  // [E + 1]
  int32_t fc1_n_blocks = 0, fc2_n_blocks = 0;
  int64_t fc1_tiles() const { return int64_t(m_block_prefix.back()) * fc1_n_blocks; }
  int64_t fc2_tiles() const { return int64_t(m_block_prefix.back()) * fc2_n_blocks; }
  // Global m-block of tile u (either GEMM): experts in order, n-block major, m-blocks fastest.
  int32_t m_block_of(int64_t u) const {
    const bool fc1 = u < fc1_tiles();
    const int64_t t = fc1 ? u : u - fc1_tiles();
    const int32_t nb = fc1 ? fc1_n_blocks : fc2_n_blocks;
    const int32_t mb_global = static_cast<int32_t>(t / nb);  // prefix[e] * nb <= t < prefix[e+1] * nb
    int32_t e = 0;
    while (e + 1 < static_cast<int32_t>(m_block_prefix.size()) - 1 && m_block_prefix[e + 1] <= mb_global) ++e;
    const int32_t m_blocks = m_block_prefix[e + 1] - m_block_prefix[e];
    const int64_t local = t - int64_t(m_block_prefix[e]) * nb;
    return m_block_prefix[e] + static_cast<int32_t>(local % m_blocks);
  }
};

}  // namespace megamoe::mega
