// megamoe/checkpoint.h — one MoE layer's experts for this rank, read from a Hugging Face checkpoint
// directory as it ships (config.json + *.safetensors, with model.safetensors.index.json when the
// tensors are spread over several files).
//
// Contract:
// - read_checkpoint_config() reads the geometry from config.json (or its "text_config"):
//   hidden = hidden_size; intermediate = moe_intermediate_size (else intermediate_size, as gpt-oss and
//   Mixtral name the expert's size); num_experts = n_routed_experts, num_experts or num_local_experts;
//   top_k = num_experts_per_tok or experts_per_token. A missing or non-integer key is an error
//   naming the file and the keys it looked for.
// - load_checkpoint_experts() copies the experts [r*E/R, (r+1)*E/R) of layer L into host memory it
//   owns, as MoeWeights in the checkpoint's own format (megamoe/weights.h), with every tensor checked
//   against the config's geometry: name, dtype and shape. The files are memory-mapped, so only this
//   rank's experts are read. Layouts (tensor names `model.layers.{L}.mlp.experts.{e}.{proj}.*`,
//   proj in gate_proj / up_proj / down_proj, [out, in] row-major):
//     kFp8Block  DeepSeek-V3: `.weight` F8_E4M3 [out, in], `.weight_scale_inv` F32 [out/128, in/128].
//     kNvfp4     NVIDIA ModelOpt: `.weight` U8 [out, in/2] (two e2m1 per byte, the even element in the
//                low nibble; or F4 [out, in]), `.weight_scale` F8_E4M3 [out, in/16], `.weight_scale_2`
//                F32 scalar (gate and up must share it), `.input_scale` F32 scalar (checked when
//                present, not used: activations are quantised per 1x128 block at dispatch).
//     kMxfp4     `.weight` packed e2m1 as nvfp4, `.weight_scale` U8 or F8_E8M0 [out, in/32].
//     kMxfp4Fused  gpt-oss: `model.layers.{L}.mlp.experts.gate_up_proj_blocks` U8 [E, 2I, H/32, 16]
//                (rows interleaved gate 0, up 0, gate 1, ...), `gate_up_proj_scales` U8 [E, 2I, H/32],
//                `down_proj_blocks` U8 [E, H, I/32, 16], `down_proj_scales` U8 [E, H, I/32]. gpt-oss's
//                expert biases and its clamped SwiGLU are not megamoe's FFN: a layer with
//                `*_proj_bias` tensors, or a config with `swiglu_limit`, is refused.
//     kBf16      `.weight` BF16 or F32 [out, in], no scales.
//   The layout is recognised from the first local expert's tensors; every expert must match it.
// - Errors: kIoError for a file that cannot be opened or mapped; kInvalidArgument for a file whose
//   contents break a rule (truncated, header lies, missing tensor, wrong dtype or shape), the message
//   naming the file and the tensor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/status.h"
#include "megamoe/types.h"
#include "megamoe/weights.h"

namespace megamoe {

struct CheckpointConfig {
  std::string dir;
  std::string model_type;       // config.json "model_type" ("" when absent)
  int64_t hidden = 0, intermediate = 0, num_experts = 0, top_k = 0;
  int64_t num_layers = 0;       // num_hidden_layers (0 when absent)
  int64_t first_dense_layers = 0;  // DeepSeek first_k_dense_replace: layers below it have no experts
  bool clamped_swiglu = false;  // gpt-oss "swiglu_limit"

  // The layer's geometry on rank ep_rank of ep_size (validate() it: hidden and intermediate must
  // be multiples of 128).
  MoeGeometry geometry(int64_t ep_size, int64_t ep_rank, int64_t max_tokens_per_rank) const;
};

Status read_checkpoint_config(const std::string& dir, CheckpointConfig* out);

enum class CheckpointLayout : int32_t { kBf16 = 0, kFp8Block, kNvfp4, kMxfp4, kMxfp4Fused };
const char* to_string(CheckpointLayout v);  // "bf16", "fp8-block (DeepSeek-V3)", ...

struct CheckpointExperts {
  CheckpointConfig config;
  MoeGeometry geometry;  // config.geometry(ep_size, ep_rank, max_tokens_per_rank), validated
  int64_t layer = 0;
  CheckpointLayout layout = CheckpointLayout::kBf16;
  // The format these weights are in: MoeConfig::weight_format = format keeps them bit for bit.
  WeightFormat format = WeightFormat::kBf16;
  MoeWeights weights;                    // host views into `storage`
  std::shared_ptr<const void> storage;   // owns what `weights` views
  std::vector<std::string> files;        // the safetensors files the tensors came from
  bool has_input_scale = false;          // nvfp4: the checkpoint carries input_scale (unused)

  std::string to_string() const;  // "layer 3, nvfp4 (ModelOpt), experts [0, 64) of 256, 2 files"
};

// The layout and format of `layer` (from config.json and the tensor headers of expert 0; no tensor
// data is read): what a caller needs to configure the layer before loading each rank's experts.
struct CheckpointLayerInfo {
  CheckpointConfig config;
  CheckpointLayout layout = CheckpointLayout::kBf16;
  WeightFormat format = WeightFormat::kBf16;
};
Status probe_checkpoint_layer(const std::string& dir, int64_t layer, CheckpointLayerInfo* out);

// Loads the experts of `layer` that rank `ep_rank` of `ep_size` owns (see the contract above).
// max_tokens_per_rank goes into the returned geometry.
Status load_checkpoint_experts(const std::string& dir, int64_t layer, int64_t ep_size, int64_t ep_rank,
                               int64_t max_tokens_per_rank, CheckpointExperts* out);

}  // namespace megamoe
