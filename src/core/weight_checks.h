// Checks of weight contents that the host preparation (core/weights.cpp) and the device path for
// device-resident weights share, so both refuse the same values with
// the same message. Host code.
#pragma once

#include <string>
#include <vector>

#include "megamoe/status.h"

namespace megamoe {

// fp8-block scales (weight_scale_inv) of `shape` in host memory: every value finite and >= 0. The
// error names the first bad one as scale_name[e, row block, column block].
Status check_fp8_block_scale_values(const std::string& scale_name, const float* values,
                                    const std::vector<int64_t>& shape);

}  // namespace megamoe
