// Checked NCCL calls for host code that returns Status (kNcclError, naming the call and NCCL's reason).
#pragma once

#include <nccl.h>

#include <string>

#include "core/cuda_check.h"

namespace megamoe {

inline Status nccl_status(ncclResult_t res, const char* expr, const char* file, int line) {
  std::string msg = std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                    ncclGetErrorString(res);
  if (res == ncclSystemError || res == ncclInternalError || res == ncclRemoteError)
    msg += " (rerun with NCCL_DEBUG=WARN for NCCL's own account)";
  return Status(StatusCode::kNcclError, msg);
}

}  // namespace megamoe

#define MEGAMOE_NCCL_CHECK(expr)                                                     \
  do {                                                                               \
    const ncclResult_t _megamoe_res = (expr);                                        \
    if (_megamoe_res != ncclSuccess && _megamoe_res != ncclInProgress)               \
      return ::megamoe::nccl_status(_megamoe_res, #expr, __FILE__, __LINE__);        \
  } while (0)
