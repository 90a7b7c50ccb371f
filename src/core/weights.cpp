// Weight preparation: validate this rank's expert weights as the caller has them and convert them to
// the storage the experts compute with (megamoe/weights.h).
//
// Conversion works on 128-row slabs of one expert matrix, so the fp32 scratch is 128 x K floats per
// worker whatever the expert size:
//   source slab -> fp32 (fp32: copy; bf16: widen; e4m3: code * 128x128 scale; nvfp4 / mxfp4: the
//                  formats.h dequantiser)
//               -> target (bf16: RNE; fp8-block: quantize_fp8_128x128; mxfp8 / nvfp4 / mxfp4:
//                  per-row blocks along K, which never straddle a row because K % 128 == 0).
// nvfp4 takes two passes per expert: the expert's amax (its global scale) first, then the blocks.
// A source prepared in its own format (e4m3 as fp8-block, nvfp4, mxfp4) is copied byte for byte,
// scales included (config.pow2_scales applies only to scales this file computes).
#include "megamoe/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/weight_checks.h"
#include "megamoe/formats.h"

namespace megamoe {
namespace {

constexpr int64_t kSlabRows = fmt::kFp8BlockSize;
// Worker threads for the per-expert conversion (experts are independent).
constexpr unsigned kMaxWorkers = 8;

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

std::string shape_string(const TensorView& v) {
  return shape_string(std::vector<int64_t>(v.shape.begin(), v.shape.begin() + std::max(v.ndim, 0)));
}

std::string strides_string(const TensorView& v) {
  return shape_string(std::vector<int64_t>(v.strides.begin(), v.strides.begin() + std::max(v.ndim, 0)));
}

// `device`: where the view must be (the host for prepare_weights, w13's device for a device source).
Status check_view_basics(const TensorView& v, const std::string& name, const std::vector<int64_t>& want,
                         const std::string& dims, Device device = Device::cpu()) {
  if (v.device != device) {
    if (device.kind == DeviceKind::kCpu)
      return invalid_argument("weights", name + ".device", v.device.to_string(),
                              "must be cpu (prepare_weights reads host memory; copy the weights to the host first)");
    return invalid_argument("weights", name + ".device", v.device.to_string(),
                            "must be " + device.to_string() + " like w13 (device-resident weights are all on the "
                                "layer's device)");
  }
  if (v.ndim != static_cast<int>(want.size()) || !std::equal(want.begin(), want.end(), v.shape.begin()))
    return invalid_argument("weights", name + ".shape", shape_string(v),
                            "must be " + dims + " = " + shape_string(want));
  if (!v.is_contiguous())
    return invalid_argument("weights", name + ".strides", strides_string(v), "must be contiguous (row-major)");
  if (v.data == nullptr)
    return invalid_argument("weights", name + ".data", "null", "a " + shape_string(want) + " view needs its data");
  return Status::ok();
}

// One source matrix stack: w13 [E, 2I, H] or w2 [E, H, I], with its optional scales.
struct SourceSpec {
  const char* name;        // "w13"
  const char* scale_name;  // "w13_scale"
  const char* dims;        // "[E_local, 2I, H]"
  const char* scale_dims;  // "[E_local, 2I/128, H/128]"
  const TensorView* data;
  const TensorView* scale;
  const TensorView* global;  // nvfp4 only
  int64_t num_experts, rows, cols;
};

// What a validated source holds.
enum class SourceKind { kFloat, kFp8Block, kNvfp4, kMxfp4 };

SourceKind source_kind(const SourceSpec& s) {
  switch (s.data->dtype) {
    case DType::kFloat8E4M3: return SourceKind::kFp8Block;
    case DType::kFloat4E2M1x2:
      return s.scale->dtype == DType::kFloat8E4M3 ? SourceKind::kNvfp4 : SourceKind::kMxfp4;
    default: return SourceKind::kFloat;
  }
}

// The weight format a source kind is kept in bit for bit, if any.
bool kept_as_is(SourceKind kind, WeightFormat format) {
  return (kind == SourceKind::kFp8Block && format == WeightFormat::kFp8Block) ||
         (kind == SourceKind::kNvfp4 && format == WeightFormat::kNvfp4) ||
         (kind == SourceKind::kMxfp4 && format == WeightFormat::kMxfp4);
}

std::string index_string(int64_t i, const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t d = shape.size(); d-- > 0;) {
    out = std::to_string(i % shape[d]) + (out.empty() ? "" : ", ") + out;
    i /= shape[d];
  }
  return "[" + out + "]";
}

// Every code of an nvfp4 (e4m3) or mxfp4 (e8m0) scale tensor must decode to a finite value >= 0.
Status check_fp4_scale_codes(const TensorView& scale, const std::string& scale_name, const std::vector<int64_t>& shape,
                             bool e8m0) {
  const uint8_t* p = scale.ptr<const uint8_t>();
  const int64_t n = scale.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = p[i];
    const bool bad = e8m0 ? c == 0xFFu : ((c & 0x7Fu) == 0x7Fu || ((c & 0x80u) != 0 && c != 0x80u));
    if (bad) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", c);
      return invalid_argument("weights", scale_name + index_string(i, shape), hex,
                              e8m0 ? "an e8m0 scale code must not be 0xFF (NaN)"
                                   : "an e4m3 block scale must be finite and >= 0 (not NaN, not negative)");
    }
  }
  return Status::ok();
}

Status validate_fp4_source(const SourceSpec& s) {
  const std::string name = s.name, scale_name = s.scale_name;
  const std::string global_name = name + "_global_scale";
  const TensorView& scale = *s.scale;
  const std::vector<int64_t> want = {s.num_experts, s.rows, s.cols / 2};
  const std::string dims = std::string(s.dims);
  const std::string last_dim_over = dims.substr(0, dims.size() - 1) + "/";  // "[E_local, 2I, H/"
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(*s.data, name, want, last_dim_over + "2] (packed bytes)"));
  if (!scale.present())
    return invalid_argument("weights", scale_name, "absent",
                            "a float4_e2m1x2 " + name + " needs its block scales: float8_e4m3 per 1x16 (nvfp4) or "
                                "float8_e8m0 per 1x32 (mxfp4) along K");
  if (scale.dtype != DType::kFloat8E4M3 && scale.dtype != DType::kFloat8E8M0)
    return invalid_argument("weights", scale_name + ".dtype", to_string(scale.dtype),
                            "a float4_e2m1x2 " + name + " takes float8_e4m3 scales per 1x16 (nvfp4) or float8_e8m0 "
                                "per 1x32 (mxfp4)");
  const bool nvfp4 = scale.dtype == DType::kFloat8E4M3;
  const int64_t block = nvfp4 ? fmt::kNvfp4BlockSize : fmt::kMxfp4BlockSize;
  const std::vector<int64_t> want_scale = {s.num_experts, s.rows, s.cols / block};
  const std::string scale_dims = last_dim_over + std::to_string(block) + "]";
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(scale, scale_name, want_scale, scale_dims));
  MEGAMOE_RETURN_IF_ERROR(check_fp4_scale_codes(scale, scale_name, want_scale, !nvfp4));
  const TensorView& global = *s.global;
  if (!nvfp4) {
    if (global.present())
      return invalid_argument("weights", global_name, global.to_string(),
                              "only an nvfp4 source has a global scale; leave it absent for mxfp4");
    return Status::ok();
  }
  const std::vector<int64_t> want_global = {s.num_experts};
  if (!global.present())
    return invalid_argument("weights", global_name, "absent",
                            "an nvfp4 " + name + " needs its fp32 global scale per expert (weight_scale_2) [E_local] = " +
                                shape_string(want_global));
  if (global.dtype != DType::kFloat32)
    return invalid_argument("weights", global_name + ".dtype", to_string(global.dtype), "must be float32");
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(global, global_name, want_global, "[E_local]"));
  const float* g = global.ptr<const float>();
  for (int64_t e = 0; e < s.num_experts; ++e) {
    if (!(g[e] > 0.f) || std::isinf(g[e])) {
      std::ostringstream value;
      value << g[e];
      return invalid_argument("weights", global_name + "[" + std::to_string(e) + "]", value.str(),
                              "an nvfp4 global scale must be finite and > 0");
    }
  }
  return Status::ok();
}

Status validate_source(const SourceSpec& s) {
  const std::string name = s.name, scale_name = s.scale_name;
  const std::vector<int64_t> want = {s.num_experts, s.rows, s.cols};
  if (!s.data->present())
    return invalid_argument("weights", name, "absent",
                            std::string("must view this rank's experts ") + s.dims + " = " + shape_string(want));
  const DType dtype = s.data->dtype;
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat8E4M3 &&
      dtype != DType::kFloat4E2M1x2)
    return invalid_argument("weights", name + ".dtype", to_string(dtype),
                            "must be float32, bfloat16, float8_e4m3 with 128x128 fp32 scales in " + scale_name +
                                ", or float4_e2m1x2 with nvfp4 / mxfp4 scales");
  if (dtype == DType::kFloat4E2M1x2) return validate_fp4_source(s);
  if (s.global->present())
    return invalid_argument("weights", name + "_global_scale", s.global->to_string(),
                            "only an nvfp4 (float4_e2m1x2) " + name + " has a global scale; leave it absent for " +
                                to_string(dtype));
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(*s.data, name, want, s.dims));

  const TensorView& scale = *s.scale;
  if (dtype != DType::kFloat8E4M3) {
    if (scale.present())
      return invalid_argument("weights", scale_name, scale.to_string(),
                              "only a float8_e4m3 " + name + " has scales; leave it absent for " + to_string(dtype));
    return Status::ok();
  }
  const std::vector<int64_t> want_scale = {s.num_experts, s.rows / fmt::kFp8BlockSize, s.cols / fmt::kFp8BlockSize};
  const std::string scale_dims = s.scale_dims;
  if (!scale.present())
    return invalid_argument("weights", scale_name, "absent",
                            "a float8_e4m3 " + name + " needs its fp32 128x128 weight_scale_inv " + scale_dims + " = " +
                                shape_string(want_scale));
  if (scale.dtype != DType::kFloat32)
    return invalid_argument("weights", scale_name + ".dtype", to_string(scale.dtype),
                            "must be float32 (one weight_scale_inv per 128x128 block)");
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(scale, scale_name, want_scale, scale_dims));
  // A dequantised value is code * scale: a scale must be finite and >= 0.
  return check_fp8_block_scale_values(scale_name, scale.ptr<const float>(), want_scale);
}

// A device-resident source stack: a dtype the layer's format takes on the device (as it is, or bf16
// quantised into fp8-block), shapes, device, layout.
Status check_device_source(const SourceSpec& s, WeightFormat format, Device device) {
  const std::string name = s.name, scale_name = s.scale_name;
  const std::vector<int64_t> want = {s.num_experts, s.rows, s.cols};
  if (!s.data->present())
    return invalid_argument("weights", name, "absent",
                            std::string("must view this rank's experts ") + s.dims + " = " + shape_string(want));
  if (format != WeightFormat::kFp8Block && format != WeightFormat::kBf16)
    return invalid_argument("weights", "config.weight_format", to_string(format),
                            "device-resident weights are prepared on the device for fp8-block or bf16 only "
                            "(the GPU backends' formats); for another format copy the weights to the host first");
  // fp8-block takes e4m3 + scales as they are, or bf16 quantised on the device; bf16 takes bf16.
  const bool fp8 = s.data->dtype == DType::kFloat8E4M3;
  if (!(s.data->dtype == DType::kBFloat16 || (fp8 && format == WeightFormat::kFp8Block)))
    return invalid_argument("weights", name + ".dtype", to_string(s.data->dtype),
                            format == WeightFormat::kFp8Block
                                ? "device-resident weights for weight_format fp8-block must be float8_e4m3 with "
                                  "float32 128x128 scales (kept as they are) or bfloat16 (quantised on the device); "
                                  "for another conversion copy the weights to the host first"
                                : "device-resident weights for weight_format bf16 must be bfloat16 without scales "
                                  "(taken as they are; for a conversion copy the weights to the host first)");
  MEGAMOE_RETURN_IF_ERROR(check_view_basics(*s.data, name, want, s.dims, device));
  if (s.global->present())
    return invalid_argument("weights", name + "_global_scale", s.global->to_string(),
                            "only an nvfp4 (float4_e2m1x2) " + name + " has a global scale; leave it absent for " +
                                to_string(s.data->dtype));
  const TensorView& scale = *s.scale;
  if (!fp8) {
    if (scale.present())
      return invalid_argument("weights", scale_name, scale.to_string(),
                              "only a float8_e4m3 " + name + " has scales; leave it absent for bfloat16");
    return Status::ok();
  }
  const std::vector<int64_t> want_scale = {s.num_experts, s.rows / fmt::kFp8BlockSize, s.cols / fmt::kFp8BlockSize};
  if (!scale.present())
    return invalid_argument("weights", scale_name, "absent",
                            "a float8_e4m3 " + name + " needs its fp32 128x128 weight_scale_inv " + s.scale_dims +
                                " = " + shape_string(want_scale));
  if (scale.dtype != DType::kFloat32)
    return invalid_argument("weights", scale_name + ".dtype", to_string(scale.dtype),
                            "must be float32 (one weight_scale_inv per 128x128 block)");
  return check_view_basics(scale, scale_name, want_scale, s.scale_dims, device);
}

// Rows [r0, r0 + kSlabRows) of expert e of the source as fp32, into out[kSlabRows * cols].
void load_slab(const SourceSpec& s, int64_t e, int64_t r0, float* out) {
  const int64_t offset = (e * s.rows + r0) * s.cols;
  const int64_t n = kSlabRows * s.cols;
  switch (s.data->dtype) {
    case DType::kFloat32: std::memcpy(out, s.data->ptr<const float>() + offset, sizeof(float) * n); break;
    case DType::kBFloat16: {
      const uint16_t* src = s.data->ptr<const uint16_t>() + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = fmt::bf16_to_float(src[i]);
      break;
    }
    case DType::kFloat4E2M1x2: {  // nvfp4 or mxfp4, validated
      const uint8_t* packed = s.data->ptr<const uint8_t>() + offset / 2;
      if (s.scale->dtype == DType::kFloat8E4M3)
        fmt::dequantize_nvfp4(packed, s.scale->ptr<const uint8_t>() + offset / fmt::kNvfp4BlockSize,
                              s.global->ptr<const float>()[e], n, out);
      else
        fmt::dequantize_mxfp4(packed, s.scale->ptr<const uint8_t>() + offset / fmt::kMxfp4BlockSize, n, out);
      break;
    }
    default: {  // kFloat8E4M3, validated
      const int64_t scale_cols = s.cols / fmt::kFp8BlockSize;
      const float* scales =
          s.scale->ptr<const float>() + (e * (s.rows / fmt::kFp8BlockSize) + r0 / kSlabRows) * scale_cols;
      fmt::dequantize_fp8_128x128(s.data->ptr<const uint8_t>() + offset, scales, kSlabRows, s.cols, out);
      break;
    }
  }
}

// Encode one fp32 slab (rows [r0, r0 + kSlabRows) of expert e) into `t`. `scale_tmp` holds
// cols / 128 floats (fp8-block scales, copied into the byte vector).
void store_slab(const float* slab, int64_t e, int64_t r0, bool pow2, QuantizedTensor* t, float* scale_tmp) {
  const int64_t cols = t->cols;
  const int64_t n = kSlabRows * cols;
  const int64_t elem = e * t->rows * cols + r0 * cols;  // index of the slab's first element
  switch (t->format) {
    case WeightFormat::kBf16: {
      uint8_t* dst = t->data.data() + elem * 2;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = fmt::float_to_bf16(slab[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
      break;
    }
    case WeightFormat::kFp8Block: {
      const int64_t scale_cols = cols / fmt::kFp8BlockSize;
      fmt::quantize_fp8_128x128(slab, kSlabRows, cols, t->data.data() + elem, scale_tmp, pow2);
      const int64_t scale_idx = (e * (t->rows / fmt::kFp8BlockSize) + r0 / kSlabRows) * scale_cols;
      std::memcpy(t->scales.data() + scale_idx * sizeof(float), scale_tmp, sizeof(float) * scale_cols);
      break;
    }
    case WeightFormat::kMxfp8:
      fmt::quantize_mxfp8(slab, n, t->data.data() + elem, t->scales.data() + elem / fmt::kMxfp8BlockSize);
      break;
    case WeightFormat::kNvfp4:
      fmt::quantize_nvfp4(slab, n, t->global_scales[e], t->data.data() + elem / 2,
                          t->scales.data() + elem / fmt::kNvfp4BlockSize);
      break;
    case WeightFormat::kMxfp4:
      fmt::quantize_mxfp4(slab, n, t->data.data() + elem / 2, t->scales.data() + elem / fmt::kMxfp4BlockSize);
      break;
  }
}

// Runs fn(expert, worker) for every expert on up to kMaxWorkers threads (worker < num_workers).
// Falls back to the calling thread when threads cannot be started.
template <typename Fn>
void for_each_expert(int64_t num_experts, unsigned num_workers, Fn fn) {
  std::vector<std::thread> threads;
  unsigned started = 0;
  if (num_workers > 1) {
    try {
      threads.reserve(num_workers - 1);
      for (unsigned w = 1; w < num_workers; ++w) {
        threads.emplace_back([&fn, w, num_workers, num_experts] {
          for (int64_t e = w; e < num_experts; e += num_workers) fn(e, w);
        });
        ++started;
      }
    } catch (const std::system_error&) {
    }
  }
  // Worker 0 (this thread) takes its own experts and those of workers that did not start.
  for (int64_t e = 0; e < num_experts; ++e) {
    const unsigned owner = static_cast<unsigned>(e % num_workers);
    if (owner == 0 || owner > started) fn(e, 0);
  }
  for (std::thread& t : threads) t.join();
}

unsigned worker_count(int64_t num_experts) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>({static_cast<int64_t>(hw), kMaxWorkers, std::max<int64_t>(num_experts, 1)});
  return static_cast<unsigned>(workers);
}

// Converts one source stack into `out` (format, shapes and storage set here).
void convert(const SourceSpec& s, WeightFormat format, bool pow2, QuantizedTensor* out) {
  QuantizedTensor& t = *out;
  t.format = format;
  t.num_experts = s.num_experts;
  t.rows = s.rows;
  t.cols = s.cols;
  const size_t data_bytes = static_cast<size_t>(s.num_experts * t.data_bytes_per_expert());
  int64_t num_scales = 1;
  for (int64_t d : t.scale_shape()) num_scales *= d;
  const size_t scale_bytes =
      format == WeightFormat::kBf16 ? 0 : static_cast<size_t>(num_scales * dtype_bytes(t.scale_dtype()));
  t.global_scales.assign(format == WeightFormat::kNvfp4 ? static_cast<size_t>(s.num_experts) : 0, 1.f);

  if (kept_as_is(source_kind(s), format)) {
    // A checkpoint kept as is: same codes, same scale bits (weight_scale_inv, e4m3 / e8m0 block
    // scales, the nvfp4 global scales). One pass over the bytes (no zero fill first).
    const uint8_t* data = s.data->ptr<const uint8_t>();
    t.data.assign(data, data + data_bytes);
    const uint8_t* scales = scale_bytes ? s.scale->ptr<const uint8_t>() : nullptr;
    t.scales.assign(scales, scales + scale_bytes);
    if (format == WeightFormat::kNvfp4)
      std::memcpy(t.global_scales.data(), s.global->data, sizeof(float) * static_cast<size_t>(s.num_experts));
    return;
  }
  t.data.assign(data_bytes, 0);
  t.scales.assign(scale_bytes, 0);

  const unsigned num_workers = worker_count(s.num_experts);
  const int64_t slab_elems = kSlabRows * s.cols;
  std::vector<float> slabs(static_cast<size_t>(num_workers * slab_elems));
  std::vector<float> scale_tmp(static_cast<size_t>(num_workers * (s.cols / fmt::kFp8BlockSize)));
  for_each_expert(s.num_experts, num_workers, [&](int64_t e, unsigned w) {
    float* slab = slabs.data() + w * slab_elems;
    if (format == WeightFormat::kNvfp4) {
      float amax = 0.f;
      for (int64_t r0 = 0; r0 < s.rows; r0 += kSlabRows) {
        load_slab(s, e, r0, slab);
        amax = std::max(amax, fmt::amax_finite(slab, slab_elems));
      }
      t.global_scales[e] = fmt::nvfp4_global_scale(amax);
    }
    for (int64_t r0 = 0; r0 < s.rows; r0 += kSlabRows) {
      load_slab(s, e, r0, slab);
      store_slab(slab, e, r0, pow2, &t, scale_tmp.data() + w * (s.cols / fmt::kFp8BlockSize));
    }
  });
}

}  // namespace

Status check_fp8_block_scale_values(const std::string& scale_name, const float* values,
                                    const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  for (int64_t i = 0; i < count; ++i) {
    if (!(values[i] >= 0.f) || std::isinf(values[i])) {
      std::ostringstream value;
      value << values[i];
      return invalid_argument("weights", scale_name + index_string(i, shape), value.str(),
                              "a weight_scale_inv must be finite and >= 0");
    }
  }
  return Status::ok();
}

DType QuantizedTensor::data_dtype() const {
  switch (format) {
    case WeightFormat::kBf16: return DType::kBFloat16;
    case WeightFormat::kFp8Block:
    case WeightFormat::kMxfp8: return DType::kFloat8E4M3;
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: return DType::kFloat4E2M1x2;
  }
  return DType::kUInt8;
}

// bf16 has no scales; kFloat32 is returned for it with an empty scale_shape().
DType QuantizedTensor::scale_dtype() const {
  switch (format) {
    case WeightFormat::kBf16:
    case WeightFormat::kFp8Block: return DType::kFloat32;
    case WeightFormat::kMxfp8:
    case WeightFormat::kMxfp4: return DType::kFloat8E8M0;
    case WeightFormat::kNvfp4: return DType::kFloat8E4M3;
  }
  return DType::kUInt8;
}

std::vector<int64_t> QuantizedTensor::scale_shape() const {
  switch (format) {
    case WeightFormat::kBf16: return {};
    case WeightFormat::kFp8Block: return {num_experts, rows / fmt::kFp8BlockSize, cols / fmt::kFp8BlockSize};
    case WeightFormat::kMxfp8: return {num_experts, rows, cols / fmt::kMxfp8BlockSize};
    case WeightFormat::kNvfp4: return {num_experts, rows, cols / fmt::kNvfp4BlockSize};
    case WeightFormat::kMxfp4: return {num_experts, rows, cols / fmt::kMxfp4BlockSize};
  }
  return {};
}

int64_t QuantizedTensor::data_bytes_per_expert() const {
  const int64_t n = rows * cols;
  switch (format) {
    case WeightFormat::kBf16: return 2 * n;
    case WeightFormat::kFp8Block:
    case WeightFormat::kMxfp8: return n;
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: return n / 2;
  }
  return 0;
}

void QuantizedTensor::dequantize(std::vector<float>* out) const {
  const int64_t per_expert = rows * cols;
  out->assign(static_cast<size_t>(num_experts * per_expert), 0.f);
  for (int64_t e = 0; e < num_experts; ++e) dequantize_expert(e, out->data() + e * per_expert);
}

// Writes rows * cols floats; an expert outside [0, num_experts) writes nothing.
void QuantizedTensor::dequantize_expert(int64_t expert, float* out) const {
  if (expert < 0 || expert >= num_experts) return;
  const int64_t n = rows * cols;
  const uint8_t* data_e = data.data() + expert * data_bytes_per_expert();
  switch (format) {
    case WeightFormat::kBf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, data_e + 2 * i, 2);
        out[i] = fmt::bf16_to_float(b);
      }
      break;
    case WeightFormat::kFp8Block: {
      const int64_t per_expert = (rows / fmt::kFp8BlockSize) * (cols / fmt::kFp8BlockSize);
      std::vector<float> s(static_cast<size_t>(per_expert));
      std::memcpy(s.data(), scales.data() + expert * per_expert * sizeof(float), sizeof(float) * per_expert);
      fmt::dequantize_fp8_128x128(data_e, s.data(), rows, cols, out);
      break;
    }
    case WeightFormat::kMxfp8:
      fmt::dequantize_mxfp8(data_e, scales.data() + expert * (n / fmt::kMxfp8BlockSize), n, out);
      break;
    case WeightFormat::kNvfp4:
      fmt::dequantize_nvfp4(data_e, scales.data() + expert * (n / fmt::kNvfp4BlockSize), global_scales[expert], n, out);
      break;
    case WeightFormat::kMxfp4:
      fmt::dequantize_mxfp4(data_e, scales.data() + expert * (n / fmt::kMxfp4BlockSize), n, out);
      break;
  }
}

MoeWeights PreparedWeights::as_source() const {
  MoeWeights w;
  if (format == WeightFormat::kMxfp8) return w;
  // TensorView has no const form; prepare_weights only reads the views.
  auto data = [](const QuantizedTensor& t) {
    const int64_t cols = t.format == WeightFormat::kNvfp4 || t.format == WeightFormat::kMxfp4 ? t.cols / 2 : t.cols;
    return TensorView(const_cast<uint8_t*>(t.data.data()), t.data_dtype(), {t.num_experts, t.rows, cols});
  };
  auto scales = [](const QuantizedTensor& t) {
    const std::vector<int64_t> s = t.scale_shape();
    return TensorView(const_cast<uint8_t*>(t.scales.data()), t.scale_dtype(), {s[0], s[1], s[2]});
  };
  auto global = [](const QuantizedTensor& t) {
    return TensorView(const_cast<float*>(t.global_scales.data()), DType::kFloat32, {t.num_experts});
  };
  w.w13 = data(w13);
  w.w2 = data(w2);
  if (format != WeightFormat::kBf16) {
    w.w13_scale = scales(w13);
    w.w2_scale = scales(w2);
  }
  if (format == WeightFormat::kNvfp4) {
    w.w13_global_scale = global(w13);
    w.w2_global_scale = global(w2);
  }
  return w;
}

bool on_device(const MoeWeights& weights) { return weights.w13.device.kind == DeviceKind::kCuda; }

Status check_device_weights(const MoeGeometry& geometry, const MoeConfig& config, const MoeWeights& weights) {
  MEGAMOE_RETURN_IF_ERROR(config.validate(geometry));
  if (!on_device(weights))
    return invalid_argument("weights", "w13.device", weights.w13.device.to_string(),
                            "must be a cuda device for device-resident weights");
  const Device device = weights.w13.device;
  const int64_t num_local = geometry.experts_per_rank();
  const SourceSpec w13{"w13",        "w13_scale",        "[E_local, 2I, H]",        "[E_local, 2I/128, H/128]",
                       &weights.w13, &weights.w13_scale, &weights.w13_global_scale, num_local,
                       2 * geometry.intermediate, geometry.hidden};
  const SourceSpec w2{"w2",        "w2_scale",        "[E_local, H, I]",        "[E_local, H/128, I/128]",
                      &weights.w2, &weights.w2_scale, &weights.w2_global_scale, num_local,
                      geometry.hidden, geometry.intermediate};
  MEGAMOE_RETURN_IF_ERROR(check_device_source(w13, config.weight_format, device));
  return check_device_source(w2, config.weight_format, device);
}

Status prepare_weights(const MoeGeometry& geometry, const MoeConfig& config, const MoeWeights& source,
                       PreparedWeights* out) {
  if (out == nullptr)
    return invalid_argument("weights", "out", "null", "prepare_weights needs a PreparedWeights to fill");
  MEGAMOE_RETURN_IF_ERROR(config.validate(geometry));
  const int64_t num_local = geometry.experts_per_rank();
  const int64_t hidden = geometry.hidden, inter = geometry.intermediate;
  const SourceSpec w13{"w13",       "w13_scale",       "[E_local, 2I, H]",       "[E_local, 2I/128, H/128]",
                       &source.w13, &source.w13_scale, &source.w13_global_scale, num_local,
                       2 * inter,   hidden};
  const SourceSpec w2{"w2",       "w2_scale",       "[E_local, H, I]",       "[E_local, H/128, I/128]",
                      &source.w2, &source.w2_scale, &source.w2_global_scale, num_local,
                      hidden,     inter};
  MEGAMOE_RETURN_IF_ERROR(validate_source(w13));
  MEGAMOE_RETURN_IF_ERROR(validate_source(w2));

  PreparedWeights prepared;
  prepared.format = config.weight_format;
  try {
    convert(w13, config.weight_format, config.pow2_scales, &prepared.w13);
    convert(w2, config.weight_format, config.pow2_scales, &prepared.w2);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kInternal, "prepare_weights: out of host memory converting " + std::to_string(num_local) +
                                             " experts to " + to_string(config.weight_format));
  }
  *out = std::move(prepared);
  return Status::ok();
}

}  // namespace megamoe
