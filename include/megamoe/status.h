// megamoe/status.h — the error type of the public API.
//
// Contract: every public call that can fail returns a Status. A non-ok Status carries a code and a
// message of the form "what was wrong: field=value, rule" (e.g. "invalid geometry: hidden=2880, must be
// a multiple of 128 (pad to 2944)"). No public call throws; no public call aborts the process on bad
// input.
#pragma once

#include <string>
#include <utility>

namespace megamoe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // a field or argument breaks a rule; the message names both
  kUnavailable,         // a backend or device is not there (capability gate, no GPU)
  kFailedPrecondition,  // right call, wrong time (e.g. allocation during CUDA-graph capture)
  kTimeout,             // a bounded cross-rank wait expired; the message names stage and peer
  kIoError,             // files: knob cache, dumps
  kCudaError,
  kNcclError,
  kInternal,
};

const char* to_string(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>", or "ok".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// "invalid <what>: <field>=<value>, <rule>" with code kInvalidArgument.
Status invalid_argument(const std::string& what, const std::string& field, const std::string& value,
                        const std::string& rule);

}  // namespace megamoe

// Propagate a non-ok Status to the caller.
#define MEGAMOE_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::megamoe::Status _megamoe_st = (expr);        \
    if (!_megamoe_st.is_ok()) return _megamoe_st;  \
  } while (0)
