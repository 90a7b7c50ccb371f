// What core needs of each backend: its factory, called by MoeLayer::create() once the backend is
// selected and the weights are prepared, and its static gate. Each is defined with its backend
// (src/reference, src/kernels/<path>); core includes nothing from those folders.
#pragma once

#include <memory>

#include "megamoe/layer.h"

namespace megamoe {

// src/reference/cpu_backend.cpp
Status create_cpu_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                        PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

}  // namespace megamoe

namespace megamoe {

// src/kernels/routed/routed_layer.cpp. `comm`: an NCCL communicator (create_nccl_group /
// create_nccl_rank), or null for ep_size == 1 (the layer then builds a one-rank group on the
// current device).
Status create_routed_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                           PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

// src/kernels/routed/routed_layer.cpp: the routed backend's static rules (formats, options, local
// expert count); no device access. Part of its capability gate (core/layer.cpp).
Status routed_format_gate(const MoeGeometry& geometry, const MoeConfig& config);

// src/kernels/mega/mega_layer.cpp: the one-kernel backend's factory (`comm` as for routed) and its
// static rules (formats, options, shapes the kernel runs); no device access.
Status create_mega_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                         PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);
Status mega_format_gate(const MoeGeometry& geometry, const MoeConfig& config);

}  // namespace megamoe
