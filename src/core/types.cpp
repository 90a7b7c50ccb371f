#include "megamoe/types.h"

namespace megamoe {

const char* to_string(DType v) {
  switch (v) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E8M0: return "float8_e8m0";
    case DType::kFloat4E2M1x2: return "float4_e2m1x2";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

const char* to_string(Backend v) {
  switch (v) {
    case Backend::kAuto: return "auto";
    case Backend::kMega: return "mega";
    case Backend::kRouted: return "routed";
    case Backend::kCpu: return "cpu";
  }
  return "unknown";
}

const char* to_string(WeightFormat v) {
  switch (v) {
    case WeightFormat::kBf16: return "bf16";
    case WeightFormat::kFp8Block: return "fp8-block";
    case WeightFormat::kMxfp8: return "mxfp8";
    case WeightFormat::kNvfp4: return "nvfp4";
    case WeightFormat::kMxfp4: return "mxfp4";
  }
  return "unknown";
}

const char* to_string(DispatchFormat v) {
  switch (v) {
    case DispatchFormat::kBf16: return "bf16";
    case DispatchFormat::kFp8Block: return "fp8-block";
  }
  return "unknown";
}

const char* to_string(CombineDtype v) {
  switch (v) {
    case CombineDtype::kBf16: return "bf16";
    case CombineDtype::kMxfp8: return "mxfp8";
    case CombineDtype::kNvfp4: return "nvfp4";
  }
  return "unknown";
}

const char* to_string(OwnerReduce v) {
  switch (v) {
    case OwnerReduce::kAuto: return "auto";
    case OwnerReduce::kOff: return "off";
    case OwnerReduce::kOn: return "on";
  }
  return "unknown";
}

namespace {

// Looks `s` up among the names of values [0, count) of enum E.
template <typename E>
Status parse_enum(const char* field, const std::string& s, int count, E* out) {
  std::string names;
  for (int i = 0; i < count; ++i) {
    const E v = static_cast<E>(i);
    if (s == to_string(v)) {
      *out = v;
      return Status::ok();
    }
    names += (i ? ", " : "");
    names += to_string(v);
  }
  return invalid_argument("value", field, "'" + s + "'", "must be one of: " + names);
}

}  // namespace

Status parse_backend(const std::string& s, Backend* out) { return parse_enum("backend", s, 4, out); }
Status parse_weight_format(const std::string& s, WeightFormat* out) {
  return parse_enum("weight_format", s, 5, out);
}
Status parse_dispatch_format(const std::string& s, DispatchFormat* out) {
  return parse_enum("dispatch_format", s, 2, out);
}
Status parse_combine_dtype(const std::string& s, CombineDtype* out) {
  return parse_enum("combine_dtype", s, 3, out);
}
Status parse_owner_reduce(const std::string& s, OwnerReduce* out) { return parse_enum("owner_reduce", s, 3, out); }

int64_t dtype_bytes(DType v) {
  switch (v) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E8M0: return 1;
    case DType::kFloat4E2M1x2: return 1;
    case DType::kUInt8: return 1;
  }
  return 0;
}

}  // namespace megamoe
