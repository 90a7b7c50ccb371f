// sm90_gemm_plan.cuh — the grouped GEMM planned once, launched many times: CUTLASS-style arguments
// (GroupedGemmArgs) turned into the device parameters, the tile configuration, the tensor maps and
// the grid. A backend whose buffers do not move plans at warmup; a fused kernel takes the planned
// tensor maps and parameters and runs the building blocks itself. For .cu files (CUtensorMap and
// the device parameter struct).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "kernels/gemm/sm90_gemm_config.cuh"

namespace megamoe::gemm {

struct GroupedGemmPlan {
  CUtensorMap tmap_a, tmap_b, tmap_sfa, tmap_d;  // d: only for the TMA-store epilogue (identity rows)
  GroupedGemmParams params;
  GemmTileConfig tiles;  // as chosen (heuristic + overrides)
  GemmEpilogue epilogue = GemmEpilogue::kStoreBf16;
  bool fp8 = true;
  bool weight_fp4 = false;  // mxfp4 weights (GemmDtype::kMxfp4)
  bool empty = true;     // m_rows == 0: nothing to launch
  int grid = 0;
};

// Validates, chooses the tiles, encodes the tensor maps and fills the parameters for the current
// device (the same checks and choices as launch_grouped_gemm). Host only; no launch.
Status plan_grouped_gemm(const GroupedGemmArgs& args, GroupedGemmPlan* plan);
// Launches a plan on `stream` (what: for the error message).
Status launch_grouped_gemm_plan(const GroupedGemmPlan& plan, cudaStream_t stream, GemmTileConfig* used = nullptr,
                                const char* what = nullptr);

}  // namespace megamoe::gemm
