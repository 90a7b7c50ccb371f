// megamoe/tensor.h — a non-owning view of a strided tensor in host or device memory.
//
// Contract: a TensorView never owns or frees memory. Shapes and strides are in elements (for
// kFloat4E2M1x2, in packed bytes along the last dimension). A default-constructed view is "absent"
// (data == nullptr, ndim == 0) and is how optional arguments (scales) are left out.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "megamoe/types.h"

namespace megamoe {

enum class DeviceKind : int32_t { kCpu = 0, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for kCpu
  static Device cpu() { return {DeviceKind::kCpu, 0}; }
  static Device cuda(int ordinal) { return {DeviceKind::kCuda, ordinal}; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string to_string() const;
};

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  Device device{};

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu());

  bool present() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim]; }
  bool is_contiguous() const;
  // "bfloat16[4, 512] on cpu"
  std::string to_string() const;

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

}  // namespace megamoe
