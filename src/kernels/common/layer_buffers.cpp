#include "kernels/common/layer_buffers.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "comm/nccl_comm.h"
#include "megamoe/comm.h"
#include "core/cuda_check.h"
#include "kernels/gemm/gemm_weights.h"

namespace megamoe {

DeviceBuffer::~DeviceBuffer() {
  if (ptr) {
    CudaDeviceGuard g(device);
    cudaFree(ptr);
  }
}

Status device_alloc(int device, int64_t bytes, std::shared_ptr<DeviceBuffer>* out) {
  auto buf = std::make_shared<DeviceBuffer>();
  buf->device = device;
  if (bytes > 0) {
    const cudaError_t err = cudaMalloc(&buf->ptr, static_cast<size_t>(bytes));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status(StatusCode::kCudaError, "cudaMalloc of " + std::to_string(bytes) + " bytes on cuda:" +
                                                std::to_string(device) + " failed: " + cudaGetErrorString(err));
    }
  }
  *out = std::move(buf);
  return Status::ok();
}

Status upload(int device, const void* src, int64_t bytes, std::shared_ptr<DeviceBuffer>* out) {
  MEGAMOE_RETURN_IF_ERROR(device_alloc(device, bytes, out));
  if (bytes > 0) MEGAMOE_CUDA_CHECK(upload_sync((*out)->ptr, src, static_cast<size_t>(bytes)));
  return Status::ok();
}

Status shared_scratch(int device, uint64_t group_id, int rank, int purpose, int64_t bytes,
                      std::shared_ptr<DeviceBuffer>* out, bool zero) {
  static std::mutex mutex;
  static auto* entries = new std::map<std::tuple<int, uint64_t, int, int, int64_t>, std::weak_ptr<DeviceBuffer>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = (*entries)[{device, group_id, rank, purpose, bytes}];
  if (auto live = slot.lock()) {
    *out = std::move(live);
    return Status::ok();
  }
  MEGAMOE_RETURN_IF_ERROR(device_alloc(device, bytes, out));
  if (zero && bytes > 0) {
    CudaDeviceGuard guard(device);
    MEGAMOE_CUDA_CHECK(zero_device_sync((*out)->ptr, static_cast<size_t>(bytes)));
  }
  slot = *out;
  return Status::ok();
}

Status single_rank_group(int device, std::shared_ptr<Communicator>* out) {
  static std::mutex mutex;
  static auto* groups = new std::map<int, std::weak_ptr<Communicator>>();
  std::lock_guard<std::mutex> lock(mutex);
  if (auto live = (*groups)[device].lock()) {
    *out = std::move(live);
    return Status::ok();
  }
  std::vector<std::shared_ptr<Communicator>> ranks;
  MEGAMOE_RETURN_IF_ERROR(create_nccl_group({device}, &ranks));
  (*groups)[device] = ranks.front();
  *out = ranks.front();
  return Status::ok();
}

Status upload_expert_weights(int device, const MoeGeometry& geometry, const PreparedWeights& weights,
                             ExpertWeightBuffers* out) {
  const QuantizedTensor& w13 = weights.w13;
  const QuantizedTensor& w2 = weights.w2;
  const int64_t El = geometry.experts_per_rank(), H = geometry.hidden, I = geometry.intermediate;
  if (weights.format == WeightFormat::kMxfp4) {
    std::vector<uint8_t> image13, image2;
    gemm::prepare_mxfp4_expert_images(w13.data.data(), w13.scales.data(), w2.data.data(), w2.scales.data(), El, H, I,
                                      &image13, &image2);
    MEGAMOE_RETURN_IF_ERROR(upload(device, image13.data(), static_cast<int64_t>(image13.size()), &out->w13));
    MEGAMOE_RETURN_IF_ERROR(upload(device, image2.data(), static_cast<int64_t>(image2.size()), &out->w2));
    return Status::ok();
  }
  if (weights.format == WeightFormat::kNvfp4) {
    std::vector<uint16_t> b13, b2;
    gemm::prepare_nvfp4_expert_bf16(w13.data.data(), w13.scales.data(), w2.data.data(), w2.scales.data(), El, H, I,
                                    &b13, &b2);
    MEGAMOE_RETURN_IF_ERROR(upload(device, b13.data(), static_cast<int64_t>(b13.size() * 2), &out->w13));
    MEGAMOE_RETURN_IF_ERROR(upload(device, b2.data(), static_cast<int64_t>(b2.size() * 2), &out->w2));
    if (static_cast<int64_t>(w13.global_scales.size()) != El || static_cast<int64_t>(w2.global_scales.size()) != El)
      return Status(StatusCode::kInternal, "upload_expert_weights: nvfp4 weights without one global scale per expert");
    MEGAMOE_RETURN_IF_ERROR(upload(device, w13.global_scales.data(), El * 4, &out->w13_expert_scale));
    MEGAMOE_RETURN_IF_ERROR(upload(device, w2.global_scales.data(), El * 4, &out->w2_expert_scale));
    return Status::ok();
  }
  const bool fp8 = weights.format == WeightFormat::kFp8Block;
  if (!fp8 && weights.format != WeightFormat::kBf16)
    return Status(StatusCode::kInternal, std::string("upload_expert_weights: no GPU layout for weight format ") +
                                             to_string(weights.format));
  const int64_t elem = fp8 ? 1 : 2;
  std::vector<uint8_t> w13_swiglu(w13.data.size());
  gemm::prepare_w13_for_swiglu(w13.data.data(), El, I, H, elem, w13_swiglu.data());
  MEGAMOE_RETURN_IF_ERROR(upload(device, w13_swiglu.data(), static_cast<int64_t>(w13_swiglu.size()), &out->w13));
  MEGAMOE_RETURN_IF_ERROR(upload(device, w2.data.data(), static_cast<int64_t>(w2.data.size()), &out->w2));
  if (fp8) {
    std::vector<float> s13(w13.scales.size() / 4);
    gemm::prepare_w13_scales_for_swiglu(reinterpret_cast<const float*>(w13.scales.data()), El, I, H, s13.data());
    MEGAMOE_RETURN_IF_ERROR(upload(device, s13.data(), static_cast<int64_t>(s13.size() * 4), &out->w13_scales));
    MEGAMOE_RETURN_IF_ERROR(upload(device, w2.scales.data(), static_cast<int64_t>(w2.scales.size()), &out->w2_scales));
  }
  return Status::ok();
}

}  // namespace megamoe
