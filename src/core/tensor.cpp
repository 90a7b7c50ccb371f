#include "megamoe/tensor.h"

#include <sstream>

namespace megamoe {

std::string Device::to_string() const {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())), device(device_) {
  int i = 0;
  for (int64_t s : shape_) {
    if (i < kMaxDims) shape[i] = s;
    ++i;
  }
  if (ndim > kMaxDims) ndim = kMaxDims;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
}

int64_t TensorView::numel() const {
  if (ndim == 0) return data ? 1 : 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  if (ndim > 0 && numel() == 0) return true;  // no element to misplace (numpy and torch give empty tensors any strides)
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::to_string() const {
  std::ostringstream os;
  os << megamoe::to_string(dtype) << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] on " << device.to_string();
  return os.str();
}

}  // namespace megamoe
