// megamoe/weights.h — expert weights as the caller has them, and as the layer computes with them.
//
// Contract:
// - MoeWeights views this rank's experts only (E_local = E / R, global experts
//   [r*E_local, (r+1)*E_local)), every present view on the host, or every one on the layer's CUDA
//   device (device-resident weights, below).
//   w13 [E_local, 2I, H]: rows [0, I) are the gate projection, rows [I, 2I) the up projection.
//   w2  [E_local, H, I].
//   Accepted sources (megamoe/checkpoint.h loads each from the checkpoints that ship them):
//   - fp32 or bf16, no scales;
//   - fp8-block (DeepSeek-V3): e4m3 with fp32 `weight_scale_inv` per 128x128 block (w13_scale
//     [E_local, 2I/128, H/128], w2_scale [E_local, H/128, I/128]); value = code * scale;
//   - nvfp4 (ModelOpt): float4_e2m1x2 w13 [E_local, 2I, H/2] (packed bytes, element 2i in the low
//     nibble), e4m3 scales per 1x16 along K (w13_scale [E_local, 2I, H/16]), fp32 global scale per
//     expert matrix (w13_global_scale [E_local], the checkpoint's `weight_scale_2`; gate and up share
//     it); value = e2m1 * e4m3 scale * global scale;
//   - mxfp4 (OCP MX): float4_e2m1x2 as nvfp4, e8m0 scales per 1x32 along K (w13_scale
//     [E_local, 2I, H/32]), no global scale; value = e2m1 * 2^(code - 127).
//   w2 and its scales likewise with [E_local, H, I]. Scales must be finite and >= 0 (no NaN code).
// - prepare_weights() converts them to config.weight_format (quantising where needed, with the
//   rounding of megamoe/formats.h). A source prepared in its own format (fp8-block, nvfp4, mxfp4)
//   is kept bit for bit, scales included.
// - Device-resident weights (an engine's tensors, already on the GPU): MoeLayer::create() on the
//   routed or mega backend prepares them on the layer's device, with no host copy of the weights
//   (device-to-device copies into the GEMM's layout on a private stream, and one quantiser kernel),
//   bit for bit what it makes of the same bytes in host memory. Accepted pairings:
//   - weight_format fp8-block: float8_e4m3 w13 / w2 with their float32 128x128 scales (kept as they
//     are; the scales, 1/16384 of the bytes, are read back once for the value rule above), or
//     bfloat16 w13 / w2 without scales (quantised on the device as prepare_weights quantises them,
//     pow2_scales included);
//   - weight_format bf16: bfloat16 w13 / w2, no scales (kept as they are);
//   each of w13 and w2 on its own (a bf16 w13 beside an e4m3 w2 is fine). Every view contiguous, on
//   one CUDA device, the layer's (its communicator's, or the current device without one).
//   check_device_weights() checks that (it reads no data). The views' contents must be complete on
//   the device when create() is called (it waits for no other stream: synchronise the stream that
//   wrote them); the caller may free them once create() returns. Refused, each with "copy the weights
//   to the host first" (the phrase megamoe.torch falls back on): fp32 or fp4 sources and the other
//   formats (mxfp8, nvfp4, mxfp4), e4m3 into bf16, the cpu backend (it computes from host memory),
//   and views on another device than the layer's. The layer's prepared_weights() then holds the
//   format and shapes only; MoeLayer::expert_weight_views() has the prepared weights per expert.
// - A QuantizedTensor holds [E_local, N, K] with K the reduction dimension; its scales follow the
//   format's block shape along (N, K).
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/tensor.h"

namespace megamoe {

struct MoeWeights {
  TensorView w13;
  TensorView w13_scale;         // fp8-block, nvfp4 and mxfp4 sources
  TensorView w2;
  TensorView w2_scale;          // fp8-block, nvfp4 and mxfp4 sources
  TensorView w13_global_scale;  // nvfp4 sources only: fp32 [E_local]
  TensorView w2_global_scale;   // nvfp4 sources only: fp32 [E_local]
};

struct QuantizedTensor {
  WeightFormat format = WeightFormat::kBf16;
  int64_t num_experts = 0, rows = 0, cols = 0;  // [E_local, N, K]
  // Element data, packed: bf16 (2 B), e4m3 (1 B) or two e2m1 per byte (row-major, low nibble first).
  std::vector<uint8_t> data;
  // Block scales: fp8-block fp32 [E, N/128, K/128]; mxfp8 and mxfp4 e8m0 [E, N, K/32]; nvfp4 e4m3
  // [E, N, K/16]; empty for bf16.
  std::vector<uint8_t> scales;
  // nvfp4 only: fp32 global scale per expert [E].
  std::vector<float> global_scales;

  DType data_dtype() const;
  DType scale_dtype() const;
  std::vector<int64_t> scale_shape() const;
  int64_t data_bytes_per_expert() const;
  // The values the experts compute with, as fp32 [E, N, K].
  void dequantize(std::vector<float>* out) const;
  void dequantize_expert(int64_t expert, float* out) const;
};

struct PreparedWeights {
  WeightFormat format = WeightFormat::kBf16;
  QuantizedTensor w13;  // [E_local, 2I, H]
  QuantizedTensor w2;   // [E_local, H, I]

  // Views of these weights as a source that prepare_weights keeps bit for bit (fp8-block, nvfp4,
  // mxfp4 with their scales; bf16), valid while this object lives; absent views for mxfp8, which
  // is no source format.
  MoeWeights as_source() const;
};

Status prepare_weights(const MoeGeometry& geometry, const MoeConfig& config, const MoeWeights& source,
                       PreparedWeights* out);

// Whether `weights` is a device-resident source: its w13 view is on a CUDA device.
bool on_device(const MoeWeights& weights);

// The checks MoeLayer::create() runs on a device-resident source (see the contract above): every
// present view on w13's CUDA device, contiguous, with its data; the dtypes and shapes of the
// pairing with config.weight_format that the device path takes. Reads no data.
Status check_device_weights(const MoeGeometry& geometry, const MoeConfig& config, const MoeWeights& weights);

}  // namespace megamoe
