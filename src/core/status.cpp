#include "megamoe/status.h"

namespace megamoe {

const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kCudaError: return "CUDA error";
    case StatusCode::kNcclError: return "NCCL error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(megamoe::to_string(code_)) + ": " + message_;
}

Status invalid_argument(const std::string& what, const std::string& field, const std::string& value,
                        const std::string& rule) {
  return Status(StatusCode::kInvalidArgument, "invalid " + what + ": " + field + "=" + value + ", " + rule);
}

}  // namespace megamoe
