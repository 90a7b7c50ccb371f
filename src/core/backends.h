// What core needs of each backend: its factory, called by MoeLayer::create() once the backend is
// selected and the weights are prepared, and its static gate. Each is defined with its backend
// (src/reference, src/kernels/<path>); core includes nothing from those folders.
#pragma once

#include <memory>
#include <string>

#include "megamoe/layer.h"

namespace megamoe {

// src/reference/cpu_backend.cpp
Status create_cpu_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                        PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

}  // namespace megamoe

namespace megamoe {

// src/kernels/routed/routed_layer.cpp. `comm`: a GPU group's communicator (create_nccl_group /
// create_nccl_rank / create_shared_gpu_group), or null for ep_size == 1 (the layer then builds a
// one-rank group on the current device). `device_weights`: null, or a device-resident source that
// check_device_weights() accepted, which the layer prepares on its device
// (prepare_device_expert_weights); `weights` then holds the format and shapes only.
Status create_routed_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                           PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out,
                           const MoeWeights* device_weights = nullptr);

// src/core/layer.cpp: the gates for the layer's own device (the GPU group's, or the current device
// without a communicator; -1 with `why_not` for a communicator that is not a GPU group's), and the
// selection they feed (MoeLayer::create uses it; select_backend(g, c) is it without a communicator).
int layer_device_of(const Communicator* comm, std::string* why_not);
Status mega_capability_on(const MoeGeometry& geometry, const MoeConfig& config, int device, const std::string& why_not);
Status routed_capability_on(const MoeGeometry& geometry, const MoeConfig& config, int device,
                            const std::string& why_not);
BackendSelection select_backend_for(const MoeGeometry& geometry, const MoeConfig& config, const Communicator* comm);
// src/core/layer.cpp: what `auto` asks of mega's weight format beyond its gate: ok for fp8-block and
// bf16; unavailable, saying so, for mxfp4, and for nvfp4 where routed runs it (bf16 wire, no owner
// reduce): built and gated on mega, not yet timed against routed, so `auto` keeps to routed there;
// backend=mega runs them.
Status mega_auto_format_gate(const MoeConfig& config);

// src/kernels/routed/routed_layer.cpp: the routed backend's static rules (formats, options, local
// expert count, the EP transport's limits, the grouped GEMMs' shape rules on the arguments warmup
// would build); no device access. Part of its capability gate (core/layer.cpp), so `auto` never picks
// routed for a layer that create() or warmup() would then refuse.
Status routed_format_gate(const MoeGeometry& geometry, const MoeConfig& config);
// The weight / dispatch pairing the GPU backends run: fp8-block weights with an fp8-block dispatch,
// mxfp4 weights with an fp8-block one, bf16 and nvfp4 weights with a bf16 one (nvfp4: expanded to
// bf16 at upload, on both GPU backends) (`backend` names the backend in the message).
Status weight_dispatch_pairing_gate(const char* backend, const MoeConfig& config);
// mxfp4 weights' shape rule on both GPU backends (the GEMM's mxfp4 tiles are 256 wide, so hidden, FC2's
// N, is a multiple of 256; 2I is by the geometry's 128 alignment). Ok for any other weight format.
Status mxfp4_shape_gate(const char* backend, const MoeGeometry& geometry, const MoeConfig& config);

// src/kernels/mega/mega_layer.cpp: the one-kernel backend's factory (`comm` and `device_weights` as
// for routed) and its static rules (formats, options, shapes the kernel runs); no device access.
Status create_mega_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                         PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out,
                         const MoeWeights* device_weights = nullptr);
Status mega_format_gate(const MoeGeometry& geometry, const MoeConfig& config);

}  // namespace megamoe
