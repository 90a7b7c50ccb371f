// Factories of the backends, called by MoeLayer::create() once the backend is selected and the
// weights are prepared. Each lives with its backend (src/reference, src/kernels/<path>).
#pragma once

#include <memory>

#include "megamoe/layer.h"

namespace megamoe {

// src/reference/cpu_backend.cpp
Status create_cpu_layer(const MoeGeometry& geometry, const MoeConfig& config, BackendSelection selection,
                        PreparedWeights weights, std::shared_ptr<Communicator> comm, std::unique_ptr<MoeLayer>* out);

}  // namespace megamoe
