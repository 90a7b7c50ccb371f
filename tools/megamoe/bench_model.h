// The H200 performance model of the bench commands (docs/ARCHITECTURE.md, Performance model): per-rank FLOPs, the bytes of
// the experts actually hit, NVLink bytes, and the floor = max(weight bytes / HBM, FLOPs / GEMM peak,
// NVLink bytes / NVLink bandwidth).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/config.h"

namespace megamoe::tool {

// Ceilings of one H200, measured on the test machines (docs/ARCHITECTURE.md, Performance model).
constexpr double kH200HbmBytesPerS = 4.2e12;
constexpr double kH200Fp8FlopsPerS = 1440e12;
constexpr double kH200Bf16FlopsPerS = 790e12;
constexpr double kH200NvlinkBytesPerS = 395e9;  // per direction, 2 GPUs (NV18), copy engine

// One forward's work, from its routing (averaged over the rotated input sets).
struct ForwardModel {
  // Sums over ranks (rates are reported per rank: sum / R / time).
  double flops = 0;         // 2*3*H*I per routed (token, expert) pair
  double weight_bytes = 0;  // prepared bytes of every (rank, expert) hit at least once
  double nvlink_bytes = 0;  // bytes sent between ranks (dispatch rows + combine rows)
  // max over ranks of the rank's floor, seconds, and what bounds it ("hbm", "gemm", "nvlink").
  double floor_s = 0;
  std::string bound;
};

// The model of one forward of `tokens` tokens per rank. ids_of(r, set) gives rank r's topk_ids of
// input set `set` ([tokens, k] int32); the result averages the sets.
ForwardModel model_forward(const MoeGeometry& g, const MoeConfig& c, int64_t tokens, int64_t num_sets,
                           const std::vector<std::vector<const int32_t*>>& ids);

// The GEMM peak the floor uses: bf16 for bf16 weights, fp8 otherwise (nvfp4 is dequantised to fp8
// in the kernel: Hopper has no fp4 MMA).
double gemm_peak(const MoeConfig& c);

}  // namespace megamoe::tool
