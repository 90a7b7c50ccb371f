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
#include "core/weight_checks.h"
#include "kernels/common/sm90_weight_quant.h"
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
                             ExpertWeightBuffers* out, Nvfp4Upload nvfp4) {
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
  if (weights.format == WeightFormat::kNvfp4 && nvfp4 == Nvfp4Upload::kGemmImages) {
    if (static_cast<int64_t>(w13.global_scales.size()) != El || static_cast<int64_t>(w2.global_scales.size()) != El)
      return Status(StatusCode::kInternal, "upload_expert_weights: nvfp4 weights without one global scale per expert");
    std::vector<uint8_t> image13, image2;
    std::string bad;
    if (!gemm::prepare_nvfp4_expert_images(w13.data.data(), w13.scales.data(), w13.global_scales.data(),
                                           w2.data.data(), w2.scales.data(), w2.global_scales.data(), El, H, I,
                                           &image13, &image2, &bad))
      return Status(StatusCode::kInvalidArgument,
                    "weights: nvfp4 " + bad + " is NaN; the GPU layout holds finite block scales");
    MEGAMOE_RETURN_IF_ERROR(upload(device, image13.data(), static_cast<int64_t>(image13.size()), &out->w13));
    MEGAMOE_RETURN_IF_ERROR(upload(device, image2.data(), static_cast<int64_t>(image2.size()), &out->w2));
    MEGAMOE_RETURN_IF_ERROR(upload(device, w13.global_scales.data(), El * 4, &out->w13_expert_scale));
    MEGAMOE_RETURN_IF_ERROR(upload(device, w2.global_scales.data(), El * 4, &out->w2_expert_scale));
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

namespace {

// A private non-blocking stream of the current device, destroyed with the scope.
struct PrivateStream {
  cudaStream_t stream = nullptr;
  ~PrivateStream() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// w13's SwiGLU order on the device (gemm_weights.h): an expert's 2 * half units of unit_bytes (128
// rows of codes, or one row of block scales) go gate unit j -> 2j, up unit half + j -> 2j + 1.
Status copy_w13_swiglu_order(void* dst, const void* src, int64_t num_experts, int64_t half, int64_t unit_bytes,
                             cudaStream_t stream) {
  for (int64_t e = 0; e < num_experts; ++e) {
    char* d = static_cast<char*>(dst) + e * 2 * half * unit_bytes;
    const char* s = static_cast<const char*>(src) + e * 2 * half * unit_bytes;
    const size_t unit = static_cast<size_t>(unit_bytes), rows = static_cast<size_t>(half);
    MEGAMOE_CUDA_CHECK(cudaMemcpy2DAsync(d, 2 * unit, s, unit, unit, rows, cudaMemcpyDeviceToDevice, stream));
    MEGAMOE_CUDA_CHECK(cudaMemcpy2DAsync(d + unit, 2 * unit, s + half * unit_bytes, unit, unit, rows,
                                         cudaMemcpyDeviceToDevice, stream));
  }
  return Status::ok();
}

// One stack (w13 [E, 2I, H] when swiglu_intermediate = I > 0, else w2 [E, H, I]) into *data / *scales.
Status prepare_device_stack(int device, const char* scale_name, const TensorView& data, const TensorView& scale,
                            int64_t num_experts, int64_t rows, int64_t cols, int64_t swiglu_intermediate,
                            const MoeConfig& config, cudaStream_t stream, std::shared_ptr<DeviceBuffer>* out_data,
                            std::shared_ptr<DeviceBuffer>* out_scales) {
  const bool fp8 = config.weight_format == WeightFormat::kFp8Block;
  const int64_t elem = fp8 ? 1 : 2;
  const int64_t data_bytes = num_experts * rows * cols * elem;
  const int64_t block_rows = rows / 128, block_cols = cols / 128;
  const int64_t scale_bytes = fp8 ? num_experts * block_rows * block_cols * 4 : 0;
  MEGAMOE_RETURN_IF_ERROR(device_alloc(device, data_bytes, out_data));
  if (fp8) MEGAMOE_RETURN_IF_ERROR(device_alloc(device, scale_bytes, out_scales));
  if (fp8 && data.dtype == DType::kBFloat16) {  // quantised on the device
    MEGAMOE_CUDA_CHECK(kernels::launch_quantize_bf16_fp8_block(
        static_cast<const uint16_t*>(data.data), num_experts, rows, cols, swiglu_intermediate, config.pow2_scales,
        static_cast<uint8_t*>((*out_data)->ptr), static_cast<float*>((*out_scales)->ptr), stream));
    return Status::ok();
  }
  // Kept as they are (e4m3 codes + weight_scale_inv, or bf16): prepare_weights' value check of the
  // scales on a host copy of them, then the layout copies.
  if (fp8) {
    std::vector<float> host(static_cast<size_t>(scale_bytes / 4));
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), scale.data, static_cast<size_t>(scale_bytes),
                                       cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<int64_t> shape = {num_experts, block_rows, block_cols};
    MEGAMOE_RETURN_IF_ERROR(check_fp8_block_scale_values(scale_name, host.data(), shape));
  }
  if (swiglu_intermediate > 0) {
    const int64_t half = swiglu_intermediate / 128;
    MEGAMOE_RETURN_IF_ERROR(
        copy_w13_swiglu_order((*out_data)->ptr, data.data, num_experts, half, 128 * cols * elem, stream));
    if (fp8)
      MEGAMOE_RETURN_IF_ERROR(
          copy_w13_swiglu_order((*out_scales)->ptr, scale.data, num_experts, half, block_cols * 4, stream));
    return Status::ok();
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync((*out_data)->ptr, data.data, static_cast<size_t>(data_bytes),
                                     cudaMemcpyDeviceToDevice, stream));
  if (fp8)
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync((*out_scales)->ptr, scale.data, static_cast<size_t>(scale_bytes),
                                       cudaMemcpyDeviceToDevice, stream));
  return Status::ok();
}

}  // namespace

Status prepare_device_expert_weights(int device, const MoeGeometry& geometry, const MoeConfig& config,
                                     const MoeWeights& source, ExpertWeightBuffers* out) {
  MEGAMOE_RETURN_IF_ERROR(check_device_weights(geometry, config, source));
  if (source.w13.device != Device::cuda(device))
    return invalid_argument("weights", "w13.device", source.w13.device.to_string(),
                            "device-resident weights must be on the layer's device cuda:" + std::to_string(device) +
                                " (its communicator's); else copy the weights to the host first");
  CudaDeviceGuard guard(device);
  if (!guard.ok()) return Status(StatusCode::kCudaError, "cannot select cuda:" + std::to_string(device));
  const int64_t El = geometry.experts_per_rank(), H = geometry.hidden, I = geometry.intermediate;
  PrivateStream ps;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&ps.stream, cudaStreamNonBlocking));
  ExpertWeightBuffers w;
  MEGAMOE_RETURN_IF_ERROR(prepare_device_stack(device, "w13_scale", source.w13, source.w13_scale, El, 2 * I, H, I,
                                               config, ps.stream, &w.w13, &w.w13_scales));
  MEGAMOE_RETURN_IF_ERROR(prepare_device_stack(device, "w2_scale", source.w2, source.w2_scale, El, H, I, 0, config,
                                               ps.stream, &w.w2, &w.w2_scales));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(ps.stream));
  *out = std::move(w);
  return Status::ok();
}

Status expert_weight_views_of(const MoeGeometry& geometry, WeightFormat format, const ExpertWeightBuffers& buffers,
                              std::vector<ExpertWeightView>* out) {
  if (!out) return invalid_argument("argument", "out", "null", "must point to a std::vector<ExpertWeightView>");
  if (!buffers.w13 || !buffers.w2)
    return Status(StatusCode::kFailedPrecondition, "expert_weight_views(): the layer holds no weights (released)");
  const int64_t El = geometry.experts_per_rank(), H = geometry.hidden, I = geometry.intermediate;
  auto at = [](const std::shared_ptr<DeviceBuffer>& b, int64_t offset) {
    return static_cast<void*>(static_cast<char*>(b->ptr) + offset);
  };
  out->assign(static_cast<size_t>(El), ExpertWeightView());
  if (format == WeightFormat::kMxfp4) {  // one image per stack: [E] block scales, padding, [E] pieces
    auto piece = [&](const std::shared_ptr<DeviceBuffer>& image, int64_t n, int64_t k, int64_t e, void** codes,
                     int64_t* codes_bytes, void** scales, int64_t* scales_bytes) {
      *scales_bytes = (n / 128) * (k / 128) * 4;
      *scales = at(image, e * *scales_bytes);
      *codes_bytes = (k / 128) * (n / gemm::kFp4SlabRows) * gemm::kFp4SlabBytes;
      *codes = at(image, gemm::mxfp4_pieces_offset(El, n, k) + e * *codes_bytes);
    };
    for (int64_t e = 0; e < El; ++e) {
      ExpertWeightView& v = (*out)[static_cast<size_t>(e)];
      piece(buffers.w13, 2 * I, H, e, &v.w13, &v.w13_bytes, &v.w13_scale, &v.w13_scale_bytes);
      piece(buffers.w2, H, I, e, &v.w2, &v.w2_bytes, &v.w2_scale, &v.w2_scale_bytes);
    }
    return Status::ok();
  }
  // nvfp4 runs as bf16 images with a per-expert global scale beside them (upload_expert_weights): a
  // permutation through views of the images alone would leave the scales behind.
  if (format == WeightFormat::kNvfp4)
    return Status(StatusCode::kUnavailable,
                  "expert_weight_views(): not available with weight_format=nvfp4 (each expert's global scales live "
                  "outside its bf16 images, so moving an expert through the views would not move them)");
  const bool fp8 = format == WeightFormat::kFp8Block;
  if (!fp8 && format != WeightFormat::kBf16)
    return Status(StatusCode::kInternal, std::string("expert_weight_views(): no GPU layout for weight format ") +
                                             to_string(format));
  const int64_t elem = fp8 ? 1 : 2;
  for (int64_t e = 0; e < El; ++e) {
    ExpertWeightView& v = (*out)[static_cast<size_t>(e)];
    v.w13_bytes = 2 * I * H * elem;
    v.w13 = at(buffers.w13, e * v.w13_bytes);
    v.w2_bytes = H * I * elem;
    v.w2 = at(buffers.w2, e * v.w2_bytes);
    if (fp8) {
      v.w13_scale_bytes = (2 * I / 128) * (H / 128) * 4;
      v.w13_scale = at(buffers.w13_scales, e * v.w13_scale_bytes);
      v.w2_scale_bytes = (H / 128) * (I / 128) * 4;
      v.w2_scale = at(buffers.w2_scales, e * v.w2_scale_bytes);
    }
  }
  return Status::ok();
}

}  // namespace megamoe
