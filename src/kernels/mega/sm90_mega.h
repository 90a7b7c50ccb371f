// sm90_mega.h — host API of the MegaMoE kernel (sm90_mega_kernel.cuh): planned once at warmup (the
// GEMMs' tensor maps and parameters for every tile configuration, the grid, the residency check),
// launched once per forward as one cooperative kernel. Host code; no CUDA device headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kernels/transport/sm90_launch.h"
#include "megamoe/status.h"

namespace megamoe::mega {

// What every launch of a layer shares (fixed at warmup).
struct MegaPlanArgs {
  kernels::TransportArgs transport;  // num_tokens: set per forward
  bool fp8 = true;                     // fp8-block (or mxfp4) weights, fp8 wire and intermediate; else bf16 (bf16 or nvfp4 weights)
  bool weight_fp4 = false;             // mxfp4 weights (with fp8): the grouped GEMM's mxfp4 mode, 16-row tiles
  // nvfp4 weights (with bf16, not fp8): bf16 images, FC1 with the scaled SwiGLU epilogue
  // (w13_expert_scale), w2_expert_scale folded into each pool row's weight at placement.
  bool weight_nvfp4 = false;
  int32_t intermediate = 0;            // I
  // This rank's experts (device): w13 prepared for the SwiGLU epilogue [E_l, 2I, H], w2 [E_l, H, I],
  // fp32 128x128 block scales with fp8 (w13's prepared too); mxfp4: each the GEMM's device image
  // (layer_buffers.h), the scales null; nvfp4: bf16 (layer_buffers.h), the scales null.
  const void* w13 = nullptr;
  const float* w13_scales = nullptr;
  const void* w2 = nullptr;
  const float* w2_scales = nullptr;
  // nvfp4: each matrix's fp32 global scale per local expert [E_l]; null otherwise.
  const float* w13_expert_scale = nullptr;
  const float* w2_expert_scale = nullptr;
  bool pow2_scales = false;            // FC1's requant scales
  void* peer_combine[kernels::kMaxTransportRanks] = {};  // every rank's combine region (FC2's rows)
  void* scratch = nullptr;             // MegaScratchLayout (mega_schedule.h), zero at rest
  // FC2's bf16 rows [pool_rows, H] (local) when the combine sends them after FC2 (a quantised wire or
  // the owner reduce: mega_staged_combine); null otherwise.
  void* expert_out = nullptr;
  int grid = 0;                        // CTAs of every launch: <= the SMs this rank may occupy
  // A cooperative launch (the driver refuses a grid that cannot be resident at once). false on a GPU
  // shared by logical ranks: each rank's grid is within its SM budget, so all ranks' CTAs are resident
  // together, and a plain launch does not depend on how the driver schedules cooperative grids of
  // several streams.
  bool cooperative = true;
  int block_m_knob = 0;                // Knobs::block_m (0: by the forward's tokens)
  float output_scale = 1.0f;           // MoeConfig::output_scale
};

// Whether the combine is staged: FC2 writes unweighted bf16 rows and the kernel sends them after
// every CTA's FC2 (a quantised wire, or the owner reduce's per-(token, owner) sums); else FC2's
// epilogue writes each row's weighted bf16 partial straight into its source's combine row.
inline bool mega_staged_combine(int32_t combine_format, bool owner_reduce) {
  return combine_format != kWsBf16 || owner_reduce;
}

class MegaPlan;
struct MegaPlanDeleter {
  void operator()(MegaPlan* p) const;
};
using MegaPlanPtr = std::unique_ptr<MegaPlan, MegaPlanDeleter>;

// Validates (shapes the kernel runs, residency of `grid` CTAs), encodes every tile configuration's
// tensor maps. Host only; may set function attributes (warmup, never during capture).
Status make_mega_plan(const MegaPlanArgs& args, MegaPlanPtr* out);

struct MegaForwardArgs {
  const void* x = nullptr;        // [T, H] bf16, or e4m3 with x_scale
  const float* x_scale = nullptr;
  bool x_fp8 = false;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  uint16_t* y = nullptr;
  int64_t num_tokens = 0;
  uint64_t* trace = nullptr;      // bench: [grid][kMegaTraceWords] %globaltimer stamps, or null
  void* expert_counts = nullptr;  // EPLB (MoeLayer::set_expert_counts): [E_l] int32 or int64, or null
  bool counts_int64 = false;
};

// One forward: one kernel on `stream` (capturable; no host sync). *block_m (optional): the tiles it ran.
Status launch_mega(const MegaPlan& plan, const MegaForwardArgs& f, cudaStream_t stream, int* block_m = nullptr);

int mega_plan_grid(const MegaPlan& plan);
constexpr int kMegaTraceWordsPerCta = 8;  // = MegaTraceWord::kMegaTraceWords
// Names of the trace words, in order (kMegaTraceWordsPerCta of them; "" for unused ones).
const char* mega_trace_word_name(int i);

}  // namespace megamoe::mega
