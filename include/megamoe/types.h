// megamoe/types.h — enumerations shared by the whole API, with their names and parsers.
//
// Contract: to_string() gives the canonical lowercase name used on the command line, in the knob
// cache and in dumps; parse_*() accepts exactly those names and returns kInvalidArgument naming the
// field, the value and the accepted names otherwise.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/status.h"

namespace megamoe {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64,
  kBFloat16,
  kFloat16,
  kInt32,
  kInt64,
  kFloat8E4M3,  // OCP e4m3fn (max 448, NaN = S.1111.111, no infinities)
  kFloat8E8M0,  // OCP e8m0 scale (2^(code-127), 0xFF = NaN)
  kFloat4E2M1x2,// two OCP e2m1 codes per byte, element 2i in the low nibble
  kUInt8,
};

enum class Backend : int32_t { kAuto = 0, kMega, kRouted, kCpu };

// Weight storage the experts compute with (weight preparation converts to it).
enum class WeightFormat : int32_t {
  kBf16 = 0,
  kFp8Block,  // e4m3 + fp32 scale per 128x128 block (DeepSeek-V3 checkpoint format)
  kMxfp8,     // e4m3 + e8m0 scale per 1x32 along K (OCP MX)
  kNvfp4,     // e2m1 + e4m3 scale per 1x16 along K + fp32 global scale
  kMxfp4,     // e2m1 + e8m0 scale per 1x32 along K (OCP MX)
};

// Activation format on the dispatch wire and into FC1.
enum class DispatchFormat : int32_t {
  kBf16 = 0,
  kFp8Block,  // e4m3 + fp32 scale per 1x128
};

// Format of the FC2 partials sent back to the source rank.
enum class CombineDtype : int32_t { kBf16 = 0, kMxfp8, kNvfp4 };

// Whether each owner rank sums its experts' partials of a token before the combine sends them
// (MoeConfig::owner_reduce): auto (on for a quantised combine wire), off (one row per slot), on.
enum class OwnerReduce : int32_t { kAuto = 0, kOff, kOn };

const char* to_string(DType v);
const char* to_string(Backend v);
const char* to_string(WeightFormat v);
const char* to_string(DispatchFormat v);
const char* to_string(CombineDtype v);
const char* to_string(OwnerReduce v);

Status parse_backend(const std::string& s, Backend* out);
Status parse_weight_format(const std::string& s, WeightFormat* out);
Status parse_dispatch_format(const std::string& s, DispatchFormat* out);
Status parse_combine_dtype(const std::string& s, CombineDtype* out);
Status parse_owner_reduce(const std::string& s, OwnerReduce* out);

// Bytes per element; for kFloat4E2M1x2 the bytes of one packed pair (1).
int64_t dtype_bytes(DType v);

}  // namespace megamoe
