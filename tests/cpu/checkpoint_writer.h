// Writes small synthetic Hugging Face checkpoints for the tests: safetensors files (an 8-byte
// header length, the JSON header padded with spaces to a multiple of 8, the raw tensors), config.json
// and model.safetensors.index.json, with the tensor names, dtypes and shapes of the checkpoints that
// ship: DeepSeek-V3 fp8, ModelOpt nvfp4, per-projection mxfp4, gpt-oss's fused mxfp4, bf16.
// The expected per-rank stacks are kept beside them, built with the formats.h codecs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "megamoe/checkpoint.h"
#include "megamoe/formats.h"

namespace megamoe::testing_ckpt {

struct StEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

template <typename T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The header JSON of `entries` laid out back to back from offset 0, padded to a multiple of 8.
inline std::string header_json(const std::vector<StEntry>& entries) {
  nlohmann::ordered_json h;
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const StEntry& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string s = h.dump();
  while (s.size() % 8) s += ' ';
  return s;
}

// A whole file from a header text and the data bytes.
inline void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint8_t len[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

inline void write_safetensors(const std::string& path, const std::vector<StEntry>& entries) {
  std::vector<uint8_t> data;
  for (const StEntry& e : entries) data.insert(data.end(), e.bytes.begin(), e.bytes.end());
  write_raw(path, header_json(entries), data);
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// One synthetic MoE checkpoint: layers [0, num_layers), the first `dense_layers` dense (a plain
// mlp.gate_proj), the others with E experts in `layout`.
struct SynthCheckpoint {
  CheckpointLayout layout = CheckpointLayout::kFp8Block;
  int64_t hidden = 256, inter = 128, experts = 4, top_k = 2;
  int64_t num_layers = 3, dense_layers = 1;
  bool bf16_as_f32 = false;      // kBf16: F32 weights instead of BF16
  bool gpt_oss_biases = false;   // kMxfp4Fused: also write the *_proj_bias tensors
  bool nvfp4_f4_dtype = false;   // kNvfp4: weights as "F4" [out, in] instead of U8 [out, in/2]
  uint32_t seed = 7;

  // Expected MoeWeights bytes per layer, per global expert: w13 [2I, ...] gate rows then up rows.
  struct Expert {
    std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
    float w13_global = 0, w2_global = 0;
  };
  std::map<int64_t, std::vector<Expert>> expected;  // layer -> experts
  std::vector<StEntry> entries;

  // fp32 values of one [rows, cols] matrix: N(0, 1) / sqrt(cols), scaled per expert and row block so
  // the block scales differ.
  std::vector<float> values(int64_t rows, int64_t cols, std::mt19937* rng, int64_t e) const {
    std::normal_distribution<float> n(0.f, 1.f);
    std::vector<float> v(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        v[r * cols + c] = n(*rng) / std::sqrt(static_cast<float>(cols)) * std::ldexp(1.f, static_cast<int>((e + r / 32) % 5) - 2);
    return v;
  }

  void build() {
    entries.clear();
    expected.clear();
    std::mt19937 rng(seed);
    const int64_t H = hidden, I = inter, E = experts;
    for (int64_t L = 0; L < num_layers; ++L) {
      const std::string p = "model.layers." + std::to_string(L) + ".mlp.";
      if (L < dense_layers) {
        std::vector<uint16_t> dense(static_cast<size_t>(4 * H), 0x3F80);
        entries.push_back({p + "gate_proj.weight", "BF16", {4, H}, to_bytes(dense)});
        continue;
      }
      std::vector<Expert>& ex = expected[L];
      ex.resize(static_cast<size_t>(E));
      // gpt-oss: fused tensors over all experts.
      std::vector<uint8_t> gu_blocks, gu_scales, dn_blocks, dn_scales;
      for (int64_t e = 0; e < E; ++e) {
        const std::vector<float> gate = values(I, H, &rng, e), up = values(I, H, &rng, e + 1),
                                 down = values(H, I, &rng, e + 2);
        Expert& x = ex[static_cast<size_t>(e)];
        const std::string pe = p + "experts." + std::to_string(e) + ".";
        const std::vector<float>* mats[3] = {&gate, &up, &down};
        const char* projs[3] = {"gate_proj", "up_proj", "down_proj"};
        // nvfp4: gate and up share the global scale (the amax over both), as ModelOpt exports them.
        float amax13 = std::max(fmt::amax_finite(gate.data(), I * H), fmt::amax_finite(up.data(), I * H));
        const float g13 = fmt::nvfp4_global_scale(amax13), g2 = fmt::nvfp4_global_scale(fmt::amax_finite(down.data(), H * I));
        x.w13_global = g13;
        x.w2_global = g2;
        std::vector<uint8_t> fused_codes_13, fused_scales_13;  // kMxfp4Fused: this expert's gate, up codes
        for (int pi = 0; pi < 3; ++pi) {
          const std::vector<float>& v = *mats[pi];
          const int64_t rows = pi < 2 ? I : H, cols = pi < 2 ? H : I, n = rows * cols;
          std::vector<uint8_t>& xd = pi < 2 ? x.w13 : x.w2;
          std::vector<uint8_t>& xs = pi < 2 ? x.w13_scale : x.w2_scale;
          const std::string w = pe + projs[pi] + ".weight";
          switch (layout) {
            case CheckpointLayout::kBf16: {
              if (bf16_as_f32) {
                entries.push_back({w, "F32", {rows, cols}, to_bytes(v)});
                const std::vector<uint8_t> b = to_bytes(v);
                xd.insert(xd.end(), b.begin(), b.end());
              } else {
                std::vector<uint16_t> b(static_cast<size_t>(n));
                for (int64_t i = 0; i < n; ++i) b[i] = fmt::float_to_bf16(v[i]);
                entries.push_back({w, "BF16", {rows, cols}, to_bytes(b)});
                const std::vector<uint8_t> bb = to_bytes(b);
                xd.insert(xd.end(), bb.begin(), bb.end());
              }
              break;
            }
            case CheckpointLayout::kFp8Block: {
              std::vector<uint8_t> q(static_cast<size_t>(n));
              std::vector<float> s(static_cast<size_t>(n / (128 * 128)));
              fmt::quantize_fp8_128x128(v.data(), rows, cols, q.data(), s.data(), false);
              entries.push_back({w, "F8_E4M3", {rows, cols}, q});
              entries.push_back({pe + projs[pi] + ".weight_scale_inv", "F32", {rows / 128, cols / 128}, to_bytes(s)});
              xd.insert(xd.end(), q.begin(), q.end());
              const std::vector<uint8_t> sb = to_bytes(s);
              xs.insert(xs.end(), sb.begin(), sb.end());
              break;
            }
            case CheckpointLayout::kNvfp4: {
              const float g = pi < 2 ? g13 : g2;
              std::vector<uint8_t> q(static_cast<size_t>(n / 2)), s(static_cast<size_t>(n / 16));
              fmt::quantize_nvfp4(v.data(), n, g, q.data(), s.data());
              if (nvfp4_f4_dtype)
                entries.push_back({w, "F4", {rows, cols}, q});
              else
                entries.push_back({w, "U8", {rows, cols / 2}, q});
              entries.push_back({pe + projs[pi] + ".weight_scale", "F8_E4M3", {rows, cols / 16}, s});
              entries.push_back({pe + projs[pi] + ".weight_scale_2", "F32", {}, to_bytes(std::vector<float>{g})});
              entries.push_back({pe + projs[pi] + ".input_scale", "F32", {}, to_bytes(std::vector<float>{0.03125f})});
              xd.insert(xd.end(), q.begin(), q.end());
              xs.insert(xs.end(), s.begin(), s.end());
              break;
            }
            case CheckpointLayout::kMxfp4:
            case CheckpointLayout::kMxfp4Fused: {
              std::vector<uint8_t> q(static_cast<size_t>(n / 2)), s(static_cast<size_t>(n / 32));
              fmt::quantize_mxfp4(v.data(), n, q.data(), s.data());
              if (layout == CheckpointLayout::kMxfp4) {
                entries.push_back({w, "U8", {rows, cols / 2}, q});
                entries.push_back({pe + projs[pi] + ".weight_scale", pi == 1 ? "F8_E8M0" : "U8", {rows, cols / 32}, s});
              } else if (pi < 2) {
                fused_codes_13.insert(fused_codes_13.end(), q.begin(), q.end());
                fused_scales_13.insert(fused_scales_13.end(), s.begin(), s.end());
              } else {
                dn_blocks.insert(dn_blocks.end(), q.begin(), q.end());
                dn_scales.insert(dn_scales.end(), s.begin(), s.end());
              }
              xd.insert(xd.end(), q.begin(), q.end());
              xs.insert(xs.end(), s.begin(), s.end());
              break;
            }
          }
        }
        if (layout == CheckpointLayout::kMxfp4Fused) {
          // Interleave: fused row 2j = gate row j, 2j + 1 = up row j.
          for (int64_t j = 0; j < I; ++j) {
            for (int64_t half = 0; half < 2; ++half) {
              const int64_t src = half * I + j;
              gu_blocks.insert(gu_blocks.end(), fused_codes_13.begin() + src * H / 2,
                               fused_codes_13.begin() + (src + 1) * H / 2);
              gu_scales.insert(gu_scales.end(), fused_scales_13.begin() + src * H / 32,
                               fused_scales_13.begin() + (src + 1) * H / 32);
            }
          }
        }
      }
      if (layout == CheckpointLayout::kMxfp4Fused) {
        const std::string pe = p + "experts.";
        entries.push_back({pe + "gate_up_proj_blocks", "U8", {E, 2 * I, H / 32, 16}, gu_blocks});
        entries.push_back({pe + "gate_up_proj_scales", "U8", {E, 2 * I, H / 32}, gu_scales});
        entries.push_back({pe + "down_proj_blocks", "U8", {E, H, I / 32, 16}, dn_blocks});
        entries.push_back({pe + "down_proj_scales", "U8", {E, H, I / 32}, dn_scales});
        if (gpt_oss_biases) {
          entries.push_back({pe + "gate_up_proj_bias", "BF16", {E, 2 * I}, std::vector<uint8_t>(E * 2 * I * 2, 0)});
          entries.push_back({pe + "down_proj_bias", "BF16", {E, H}, std::vector<uint8_t>(E * H * 2, 0)});
        }
      }
    }
  }

  nlohmann::json config() const {
    nlohmann::json c;
    c["hidden_size"] = hidden;
    c["num_hidden_layers"] = num_layers;
    if (layout == CheckpointLayout::kMxfp4Fused) {  // gpt-oss names
      c["model_type"] = "gpt_oss";
      c["intermediate_size"] = inter;
      c["num_local_experts"] = experts;
      c["experts_per_token"] = top_k;
    } else {  // DeepSeek-V3 names
      c["model_type"] = "deepseek_v3";
      c["intermediate_size"] = 8 * inter;  // the dense MLP's, which the loader must not take
      c["moe_intermediate_size"] = inter;
      c["n_routed_experts"] = experts;
      c["num_experts_per_tok"] = top_k;
      c["first_k_dense_replace"] = dense_layers;
    }
    return c;
  }

  // Writes config.json and the tensors over `num_files` shards (round-robin by tensor), with
  // model.safetensors.index.json when `with_index`.
  void write(const std::string& dir, int num_files, bool with_index) const {
    write_text(dir + "/config.json", config().dump(2));
    std::vector<std::vector<StEntry>> shards(static_cast<size_t>(num_files));
    nlohmann::json index;
    index["metadata"] = {{"total_size", 0}};
    for (size_t i = 0; i < entries.size(); ++i) {
      const size_t f = i % static_cast<size_t>(num_files);
      shards[f].push_back(entries[i]);
      index["weight_map"][entries[i].name] = shard_name(static_cast<int>(f), num_files);
    }
    for (int f = 0; f < num_files; ++f) write_safetensors(dir + "/" + shard_name(f, num_files), shards[static_cast<size_t>(f)]);
    if (with_index) write_text(dir + "/model.safetensors.index.json", index.dump(2));
  }

  static std::string shard_name(int f, int num_files) {
    if (num_files == 1) return "model.safetensors";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", f + 1, num_files);
    return buf;
  }
};

}  // namespace megamoe::testing_ckpt
