// layer_buffers.h — device buffers the GPU backends' layers share: an owned device allocation, scratch
// shared by the layers of one EP group (like their workspace), the expert weights prepared for the
// grouped GEMM, and the one-rank NCCL group of EP1 layers built without a communicator. Host code.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "megamoe/comm.h"
#include "megamoe/config.h"
#include "megamoe/layer.h"
#include "megamoe/status.h"
#include "megamoe/weights.h"

namespace megamoe {

struct DeviceBuffer {
  void* ptr = nullptr;
  int device = 0;
  ~DeviceBuffer();
};

Status device_alloc(int device, int64_t bytes, std::shared_ptr<DeviceBuffer>* out);
Status upload(int device, const void* src, int64_t bytes, std::shared_ptr<DeviceBuffer>* out);

// What a shared scratch buffer is for (part of its key).
enum ScratchPurpose {
  kScratchAScales = 1,
  kScratchExpertOut = 2,
  kScratchTileCounter = 3,
  kScratchMega = 4,
  kScratchRouting = 5,  // the routed layer's int32 ids + fp32 weights for converted routing
};

// Scratch shared by the layers of one EP rank with equal (device, purpose, bytes), like their
// workspace (the layers of a model run one after another on a stream); freed with its last user. The
// rank is part of the key: logical ranks of a shared GPU have one device and one group. zero: a new
// buffer is zeroed once, on a private stream (counters that every launch returns to zero).
Status shared_scratch(int device, uint64_t group_id, int rank, int purpose, int64_t bytes,
                      std::shared_ptr<DeviceBuffer>* out, bool zero = false);

// EP1 layers built without a communicator share one single-rank NCCL group per device, so they share
// one workspace too (WorkspacePool keys include the group).
Status single_rank_group(int device, std::shared_ptr<Communicator>* out);

// This rank's experts as the grouped GEMM reads them (weights.format: bf16, fp8-block, nvfp4 or
// mxfp4): w13 reordered for the SwiGLU epilogue (gemm_weights.h), w2 as prepared; fp32 block scales
// for fp8-block weights (w13's reordered too); mxfp4: each of w13 and w2 one device image of
// gemm_weights.h's Mxfp4GemmWeights (its block scales inside, no separate scale buffer), made from
// the packed codes and their e8m0 scales (w13's rows reordered first); nvfp4: w13 and w2 as bf16
// (gemm::expand_nvfp4_to_bf16: e2m1 x e4m3 block scale, exact), then as bf16 weights, and each
// matrix's fp32 global scales [E_local] apart (w13_expert_scale: FC1's scaled SwiGLU epilogue;
// w2_expert_scale: folded into FC2's row weights by the pool build).
// nvfp4 with Nvfp4Upload::kGemmImages (the routed backend): w13 and w2 are the nvfp4 GEMM's device
// images instead (gemm_weights.h's Nvfp4GemmWeights: FP4 stays FP4 in HBM, the global scales inside
// and apart as above); a NaN block scale is refused, naming the matrix, expert, row and block.
struct ExpertWeightBuffers {
  std::shared_ptr<DeviceBuffer> w13, w13_scales, w2, w2_scales, w13_expert_scale, w2_expert_scale;
};
enum class Nvfp4Upload { kBf16, kGemmImages };
Status upload_expert_weights(int device, const MoeGeometry& geometry, const PreparedWeights& weights,
                             ExpertWeightBuffers* out, Nvfp4Upload nvfp4 = Nvfp4Upload::kBf16);

// The same buffers, bit for bit what upload_expert_weights makes of prepare_weights(source), made on
// `device` from a device-resident source that check_device_weights() accepted (config.weight_format
// fp8-block or bf16; weights.h): device-to-device copies that put w13's rows (and scale rows) in the
// SwiGLU order, w2 as it is, and for a bf16 stack into fp8-block the quantiser kernel of
// sm90_weight_quant.h. Every view must be on `device`. The fp8 scales (1/16384 of the codes' bytes)
// are read back to the host for prepare_weights' value check (finite, >= 0; the same message). Runs on
// a private stream of `device` and returns once it is done: the source must be complete on the
// device before the call (no other stream is waited for), and may be freed after it.
Status prepare_device_expert_weights(int device, const MoeGeometry& geometry, const MoeConfig& config,
                                     const MoeWeights& source, ExpertWeightBuffers* out);

// Per local expert, the regions of `buffers` (made by one of the two above for `format`) that hold
// it (megamoe/layer.h ExpertWeightView).
Status expert_weight_views_of(const MoeGeometry& geometry, WeightFormat format, const ExpertWeightBuffers& buffers,
                              std::vector<ExpertWeightView>* out);

}  // namespace megamoe
