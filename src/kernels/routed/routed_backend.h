// The routed backend: separate kernels on the caller's stream, no host synchronisation inside
// forward(), capturable in a CUDA graph after warmup():
//   dispatch (EpTransport: layout + dispatch + arrival)  -> build_expert_pool (expert-major, BM-padded)
//   -> FC1 grouped GEMM with the SwiGLU + fp8 requant epilogue (h into the workspace's intermediate)
//   -> FC2 grouped GEMM to bf16 rows (local, unweighted)
//   -> combine_send (weight, wire format, to the source rank) -> combine (slot-order fp32 sum -> y).
// Formats: fp8-block weights with fp8-block dispatch, or bf16 weights with bf16 dispatch; every
// combine wire; no in-kernel FC2 reduce yet.
#pragma once

#include <memory>

#include "megamoe/layer.h"

namespace megamoe {

// Static rules of this backend (formats, options); no device access.
Status routed_format_gate(const MoeGeometry& geometry, const MoeConfig& config);

}  // namespace megamoe
