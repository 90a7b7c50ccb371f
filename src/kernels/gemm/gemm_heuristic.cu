// gemm_heuristic.cpp — see gemm_heuristic.h.
#include "kernels/gemm/gemm_heuristic.h"

#include <algorithm>

namespace megamoe::gemm {

GemmTileConfig select_gemm_tiles(const GemmShapeHint& hint, const Knobs* overrides) {
  const bool swiglu = hint.epilogue != GemmEpilogue::kStoreBf16;
  const int32_t sms = hint.num_sms > 0 ? hint.num_sms : 132;
  GemmTileConfig c;
  c.num_sms = sms;
  if (hint.m_per_expert <= 64) {
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
  // batches): 128-wide tiles. Measured on H200 (session 7, `bench-gemm --preset qwen3-30b-a3b
  // --block-n 128|256 --no-swiglu`, 64 experts, µs, 128- vs 256-wide): 8 rows FC2 38.4 vs 39.4,
  // 128 rows FC1 72.6 vs 74.3 (twice the tiles: 5.8 waves instead of 2.9); from 256 rows 256-wide
  // wins: FC1 113.5 vs 103.4, FC2 72.5 vs 66.6; 512 rows 210.6 vs 187.6, 134.6 vs 120.0. (An
  // earlier kernel measured 128-wide ahead at 256 rows too; the SwiGLU, scheduling and stmatrix
  // changes since moved it.)
  if (!swiglu && hint.n <= 2048 && hint.m_per_expert <= 128) c.block_n = 128;
  // few tiles for the SMs (e.g. FC2 of a small model at small batch): narrower N tiles give the
  // persistent grid more work items.
  if (!swiglu && c.block_n == 256) {
    const int64_t m_blocks = hint.num_experts * std::max<int64_t>(1, (hint.m_per_expert + c.block_m - 1) / c.block_m);
    const int64_t tiles = m_blocks * (hint.n / 256);
    if (tiles < sms) c.block_n = 128;
  }
  if (overrides != nullptr) {
    if (overrides->block_m == 64 || overrides->block_m == 128) c.block_m = overrides->block_m;
    if ((overrides->block_n == 128 && !swiglu && hint.n % 128 == 0) ||
        (overrides->block_n == 256 && hint.n % 256 == 0))
      c.block_n = overrides->block_n;
    if (overrides->num_sms > 0) c.num_sms = std::min(overrides->num_sms, sms);
  }
  return c;
}

int64_t count_gemm_tiles(const int32_t* rows_per_expert, int32_t num_experts, int32_t n, const GemmTileConfig& cfg) {
  int64_t m_blocks = 0;
  for (int32_t e = 0; e < num_experts; ++e)
    m_blocks += (std::max<int32_t>(rows_per_expert[e], 0) + cfg.block_m - 1) / cfg.block_m;
  return m_blocks * (n / cfg.block_n);
}

}  // namespace megamoe::gemm
