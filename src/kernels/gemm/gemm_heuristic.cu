// gemm_heuristic.cu — see gemm_heuristic.h. Measurements cited by session are in
// docs/perf-history/gemm.md.
#include "kernels/gemm/gemm_heuristic.h"

#include <algorithm>

namespace megamoe::gemm {

GemmTileConfig select_gemm_tiles(const GemmShapeHint& hint, const Knobs* overrides) {
  const bool swiglu = hint.epilogue != GemmEpilogue::kStoreBf16;
  const int32_t sms = hint.num_sms > 0 ? hint.num_sms : 132;
  // m-blocks of one expert (at least 1) and the launch's tiles, for the bucket's rows per expert
  const auto m_blocks_per_expert = [&hint](int32_t block_m) {
    return std::max<int64_t>(1, (hint.m_per_expert + block_m - 1) / block_m);
  };
  const auto expected_tiles = [&](int32_t block_m, int32_t block_n) {
    return hint.num_experts * m_blocks_per_expert(block_m) * (hint.n / block_n);
  };
  GemmTileConfig c;
  c.num_sms = sms;
  const bool swap_ok = hint.fp8;  // 16- and 32-row tiles: operands swapped (fp8, bf16 rows or SwiGLU + fp8)
  if (hint.m_per_expert <= 16 && swap_ok) {
    // decode, <= 16 rows per expert: 16-row tiles with the operands swapped (the weights as wgmma's
    // M, the tokens as its N = 16): the tensor cores spend 16 MACs per weight byte instead of the 64
    // of an m64 tile, so the math keeps up with the weight stream; 256 wide: 6 stages of 32 KiB of
    // weights in flight per SM. Measured on H200 (gemm.md session 11, `bench-gemm --flush read`, kernel µs,
    // against 64 x 128 / 64 x 256 tiles): qwen3-30b-a3b FC2 64 x 8 29.6 / 29.8 (16 x 128: 30.1 /
    // 30.2; 64 x 128: 31.3 / 31.4), deepseek-v3 FC2 32 x 8 115.0 / 115.1 (116.3 / 116.4), plain FC1
    // unchanged; FC1 + SwiGLU: docs/PERF.md (Grouped GEMM). At 32 rows (2 m-blocks) they lose: 44.9 vs 32.2.
    c.block_m = 16;
    c.block_n = 256;
  } else if (hint.m_per_expert <= 32 && swap_ok && swiglu) {
    // decode, 17-32 rows per expert, FC1 + SwiGLU: the swapped tiles with 32 tokens (wgmma N = 32, 32
    // MACs per weight byte; 5 stages of 32 KiB of weights). Measured on H200 (gemm.md session 12, `bench-gemm
    // --tokens 32`, memset flush, kernel µs, against 64 x 256): qwen3-30b-a3b 63.8-64.1 vs 68.6-68.7,
    // deepseek-v3 32 x 32 233.9-234.5 vs 238.9-239.9. bf16 rows (FC1, FC2) gain nothing there (qwen3
    // FC2 64 x 32 32.1-32.4 vs 31.7-32.0 on 64 x 128 with `--flush read`; FC1 and deepseek-v3 equal):
    // the weight stream, not the math, sets their time. They keep 64-row tiles.
    c.block_m = 32;
    c.block_n = 256;
  } else if (hint.m_per_expert <= 64) {
    // decode (masked or small pools), <= 64 rows per expert: one math warpgroup, the widest N tile;
    // the kernel streams weights, so bytes in flight per SM (5 stages of 40 KiB) are what count.
    c.block_m = 64;
    c.block_n = 256;
  } else {
    // prefill / large batches, > 64 rows per expert: two math warpgroups on 128 x 256 tiles
    // (A reused over 256 columns, B over 128 rows).
    c.block_m = 128;
    c.block_n = 256;
  }
  if (hint.n % 256 != 0) c.block_n = 128;  // plain epilogue on N = 128 (mod 256)
  // small models at <= 128 rows per expert (qwen3-30b-a3b-like, N <= 2048, decode and small
  // batches): 128-wide tiles. Measured on H200 (gemm.md session 7, `bench-gemm --preset qwen3-30b-a3b
  // --block-n 128|256 --no-swiglu`, 64 experts, µs, 128- vs 256-wide): 8 rows FC2 38.4 vs 39.4,
  // 128 rows FC1 72.6 vs 74.3 (twice the tiles: 5.8 waves instead of 2.9); from 256 rows 256-wide
  // wins: FC1 113.5 vs 103.4, FC2 72.5 vs 66.6; 512 rows 210.6 vs 187.6, 134.6 vs 120.0.
  if (!swiglu && hint.n <= 2048 && hint.m_per_expert <= 128 && c.block_m > 32) c.block_n = 128;
  // few tiles for the SMs (e.g. FC2 of a small model at small batch): narrower N tiles give the
  // persistent grid more work items.
  if (!swiglu && c.block_n == 256) {
    if (expected_tiles(c.block_m, 256) < sms) c.block_n = 128;
  }
  if (overrides != nullptr) {
    if (((overrides->block_m == 16 || overrides->block_m == 32) && swap_ok) || overrides->block_m == 64 ||
        overrides->block_m == 128)
      c.block_m = overrides->block_m;
    if ((overrides->block_n == 128 && !swiglu && hint.n % 128 == 0) ||
        (overrides->block_n == 256 && hint.n % 256 == 0))
      c.block_n = overrides->block_n;
    if (overrides->num_sms > 0) c.num_sms = std::min(overrides->num_sms, sms);
  }
  // Clusters of 2 (fp8 128 x 256 tiles): the pair of CTAs running two m-blocks of one weight tile load
  // half of it each and multicast it to both. That halves the L2 reads of the weights (32 instead of
  // 48 KiB per K block and CTA) but ties the two CTAs' rings together, so each K block waits for the
  // later of two loads. Measured on one H200 (gemm.md session 13, `bench-gemm --cluster 1|2`, kernel µs, 2-3
  // rounds, cluster 1 vs 2): long K gains, deepseek-v3 FC1 (K 7168) 32 x 512 765-779 vs 738-751, FC1 +
  // SwiGLU 805-833 vs 789-810, 32 x 2048 SwiGLU 3533-3617 vs 3409-3420; K 2048 is even (deepseek-v3 FC2
  // 32 x 512 409-422 vs 406-418, qwen3-30b-a3b FC1 64 x 1024 349-351 vs 349-350); short K loses
  // (qwen3-30b-a3b FC2, K 768, 64 x 1024 208-213 vs 224-226, 64 x 256 58.4 vs 64.3-65.0).
  const bool cluster_ok = hint.fp8 && c.block_m == 128 && c.block_n == 256 && c.num_sms >= 2;
  c.cluster = cluster_ok && hint.k >= 4096 ? 2 : 1;
  if (overrides != nullptr && (overrides->gemm_cluster == 1 || overrides->gemm_cluster == 2))
    c.cluster = overrides->gemm_cluster;
  if (!cluster_ok) c.cluster = 1;
  // Tile order. A short launch (at most 8 tiles per CTA) whose experts span 2 or more m-blocks takes
  // its tiles round-robin; longer launches and one m-block per expert (decode) take them from the
  // counter. Measured on one H200 (gemm.md session 10, `bench-gemm --schedule dynamic|static`, kernel µs,
  // counter vs round-robin):
  //   qwen3-30b-a3b 64 x 256 (2 m-blocks): FC2 62.7 / 63.0 vs 58.0 / 58.0 (7.8 tiles per CTA), FC1
  //     99.6 / 99.9 vs 96.3 / 96.5 (5.8), FC1 + SwiGLU 120.2 vs 120.0;
  //   deepseek-v3 32 x 256 (2 m-blocks): FC1 402.7 / 403.4 vs 401.5 / 402.8 (7.8); FC2 216.6 / 216.5
  //     vs 215.6 / 215.3 (13.6: left to the counter, no clear gain);
  //   longer launches drift apart (the counter keeps CTAs that share a weight tile together):
  //     deepseek-v3 128 x 256 FC1 1633.9 / 1648.7 vs 1702.7 / 1735.4 (31), 32 x 512 FC2 404.8 vs 413.7
  //     (27), qwen3-30b-a3b 64 x 1024 FC2 207.4 vs 211.0 (31);
  //   one m-block per expert (deepseek-v3 32 / 128 experts x 8-128 rows, qwen3 decode): the counter
  //     ahead by 0-4%.
  c.round_robin = m_blocks_per_expert(c.block_m) >= 2 &&
                  expected_tiles(c.block_m, c.block_n) <= 8 * static_cast<int64_t>(c.num_sms);
  return c;
}

int32_t select_mxfp4_block_m(int64_t m_per_expert, int32_t block_m, int32_t fp4_math_wg) {
  if (block_m != 0) return block_m;
  return m_per_expert <= 16 ? 16 : m_per_expert <= 32 || fp4_math_wg == 1 ? 32 : 64;
}

int64_t count_gemm_tiles(const int32_t* rows_per_expert, int32_t num_experts, int32_t n, const GemmTileConfig& cfg) {
  int64_t m_blocks = 0;
  for (int32_t e = 0; e < num_experts; ++e)
    m_blocks += (std::max<int32_t>(rows_per_expert[e], 0) + cfg.block_m - 1) / cfg.block_m;
  return m_blocks * (n / cfg.block_n);
}

}  // namespace megamoe::gemm
