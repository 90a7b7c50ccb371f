// Checkpoint loading (megamoe/checkpoint.h): config.json -> geometry; tensor name -> file through
// model.safetensors.index.json (or every *.safetensors header of the directory); then one loader per
// layout copies this rank's experts into [E_local, 2I, H] / [E_local, H, I] stacks, gate rows before
// up rows, checking each tensor's dtype, shape and scale values on the way.
#include "megamoe/checkpoint.h"

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "io/safetensors.h"

namespace megamoe {
namespace {

using io::StDtype;
using io::StTensor;

constexpr const char* kIndexFile = "model.safetensors.index.json";
// Header and config files are read whole; a larger one is not a config.
constexpr std::streamoff kMaxJsonBytes = 256 << 20;

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status bad_checkpoint(const std::string& where, const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "invalid checkpoint " + where + ": " + what);
}

// Reads and parses a JSON file; `*exists` (when given) tells a missing file from a broken one.
Status read_json(const std::string& path, nlohmann::json* out, bool* exists = nullptr) {
  std::ifstream f(path, std::ios::binary);
  if (exists) *exists = static_cast<bool>(f);
  if (!f) return Status(StatusCode::kIoError, "cannot open " + path + ": " + std::strerror(errno));
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  if (size < 0 || size > kMaxJsonBytes)
    return bad_checkpoint(path, "size=" + std::to_string(size) + " bytes, a JSON file here must be at most " +
                                    std::to_string(kMaxJsonBytes));
  f.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  if (!f.read(&text[0], size)) return Status(StatusCode::kIoError, "cannot read " + path);
  *out = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) return bad_checkpoint(path, "not valid JSON");
  if (!out->is_object()) return bad_checkpoint(path, "must be a JSON object");
  return Status::ok();
}

// The first of `keys` present in `j` as an integer; 0 and false when none is.
bool find_int(const nlohmann::json& j, std::initializer_list<const char*> keys, int64_t* out, std::string* key_used) {
  for (const char* k : keys) {
    const auto it = j.find(k);
    if (it != j.end() && it->is_number_integer()) {
      *out = it->get<int64_t>();
      if (key_used) *key_used = k;
      return true;
    }
  }
  return false;
}

std::string key_list(std::initializer_list<const char*> keys) {
  std::string s;
  for (const char* k : keys) s += (s.empty() ? "" : " or ") + std::string(k);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Where each tensor lives.

class TensorStore {
 public:
  struct Found {
    const io::SafetensorsFile* file = nullptr;
    const StTensor* tensor = nullptr;
  };

  Status init(const std::string& dir) {
    dir_ = dir;
    nlohmann::json index;
    bool exists = false;
    const std::string index_path = join_path(dir, kIndexFile);
    const Status st = read_json(index_path, &index, &exists);
    if (exists) {
      MEGAMOE_RETURN_IF_ERROR(st);
      const auto map = index.find("weight_map");
      if (map == index.end() || !map->is_object())
        return bad_checkpoint(index_path, "weight_map missing or not an object of tensor name -> file name");
      for (auto it = map->begin(); it != map->end(); ++it) {
        if (!it.value().is_string())
          return bad_checkpoint(index_path, "weight_map[" + it.key() + "] must be a file name (a string)");
        const std::string file = it.value().get<std::string>();
        if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
          return bad_checkpoint(index_path, "weight_map[" + it.key() + "]=" + file +
                                                ", must be the name of a file in " + dir);
        weight_map_[it.key()] = file;
      }
      where_ = index_path;
      return Status::ok();
    }
    // No index: every *.safetensors file of the directory, each tensor in exactly one of them.
    DIR* d = opendir(dir.c_str());
    if (!d) return Status(StatusCode::kIoError, "cannot open checkpoint directory " + dir + ": " + std::strerror(errno));
    std::vector<std::string> names;
    while (const dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      const std::string ext = ".safetensors";
      if (n.size() > ext.size() && n.compare(n.size() - ext.size(), ext.size(), ext) == 0) names.push_back(n);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    if (names.empty())
      return bad_checkpoint(dir, "no " + std::string(kIndexFile) + " and no *.safetensors file in the directory");
    for (const std::string& n : names) {
      const io::SafetensorsFile* f = nullptr;
      MEGAMOE_RETURN_IF_ERROR(open_file(n, &f));
      for (const StTensor& t : f->header().tensors) {
        const auto [it, inserted] = weight_map_.emplace(t.name, n);
        if (!inserted)
          return bad_checkpoint(dir, "tensor " + t.name + " is in both " + it->second + " and " + n);
      }
    }
    where_ = "the " + std::to_string(names.size()) + " *.safetensors file(s) of " + dir;
    return Status::ok();
  }

  // The tensor `name`, or found->tensor == null when the checkpoint has none.
  Status lookup(const std::string& name, Found* found) {
    *found = Found{};
    const auto it = weight_map_.find(name);
    if (it == weight_map_.end()) return Status::ok();
    const io::SafetensorsFile* f = nullptr;
    MEGAMOE_RETURN_IF_ERROR(open_file(it->second, &f));
    const StTensor* t = f->header().find(name);
    if (!t)
      return bad_checkpoint(where_, "it puts tensor " + name + " in " + it->second + ", whose header has no such tensor");
    found->file = f;
    found->tensor = t;
    if (std::find(used_.begin(), used_.end(), it->second) == used_.end()) used_.push_back(it->second);
    return Status::ok();
  }

  const std::string& where() const { return where_; }
  const std::vector<std::string>& used_files() const { return used_; }

 private:
  Status open_file(const std::string& name, const io::SafetensorsFile** out) {
    auto it = open_.find(name);
    if (it == open_.end()) {
      std::unique_ptr<io::SafetensorsFile> f;
      MEGAMOE_RETURN_IF_ERROR(io::SafetensorsFile::open(join_path(dir_, name), &f));
      it = open_.emplace(name, std::move(f)).first;
    }
    *out = it->second.get();
    return Status::ok();
  }

  std::string dir_, where_;
  std::unordered_map<std::string, std::string> weight_map_;
  std::map<std::string, std::unique_ptr<io::SafetensorsFile>> open_;
  std::vector<std::string> used_;
};

// ---------------------------------------------------------------------------------------------
// Tensor checks.

// What a tensor must be: one of `dtypes` with the shape given for each (a scalar accepts [] and [1]).
struct Expect {
  std::vector<std::pair<StDtype, std::vector<int64_t>>> forms;
  const char* role;  // "DeepSeek-V3 fp8 expert weight"
  bool scalar = false;
};

std::string describe_forms(const Expect& x) {
  std::string s;
  for (const auto& f : x.forms) {
    s += (s.empty() ? "" : " or ") + std::string(io::to_string(f.first));
    s += x.scalar ? " scalar ([] or [1])" : " " + shape_string(f.second);
  }
  return s;
}

class Loader {
 public:
  Loader(TensorStore* store, const CheckpointConfig& config, int64_t layer)
      : store_(store), config_(config), layer_(layer) {
    prefix_ = "model.layers." + std::to_string(layer) + ".mlp.experts.";
  }

  std::string expert_name(int64_t e, const char* proj, const char* field) const {
    return prefix_ + std::to_string(e) + "." + proj + "." + field;
  }
  const std::string& prefix() const { return prefix_; }

  Status missing(const std::string& name, const char* role) const {
    return bad_checkpoint(config_.dir, "missing tensor " + name + " (" + role + "; looked in " + store_->where() + ")");
  }

  // The tensor `name` as `x` says (missing, wrong dtype or shape: an error naming file and tensor).
  Status require(const std::string& name, const Expect& x, TensorStore::Found* out) {
    MEGAMOE_RETURN_IF_ERROR(store_->lookup(name, out));
    if (!out->tensor) return missing(name, x.role);
    return check(*out, x);
  }

  Status lookup(const std::string& name, TensorStore::Found* out) { return store_->lookup(name, out); }

  // Absent is fine; present must be as `x` says.
  Status optional(const std::string& name, const Expect& x, TensorStore::Found* out) {
    MEGAMOE_RETURN_IF_ERROR(store_->lookup(name, out));
    if (!out->tensor) return Status::ok();
    return check(*out, x);
  }

  Status check(const TensorStore::Found& f, const Expect& x) const {
    const StTensor& t = *f.tensor;
    const std::string where = f.file->path() + ": tensor " + t.name;
    bool dtype_ok = false;
    for (const auto& form : x.forms) {
      if (form.first != t.dtype) continue;
      dtype_ok = true;
      const bool shape_ok = x.scalar ? (t.shape.empty() || (t.shape.size() == 1 && t.shape[0] == 1))
                                     : t.shape == form.second;
      if (shape_ok) return Status::ok();
    }
    if (!dtype_ok)
      return bad_checkpoint(where, std::string("dtype=") + io::to_string(t.dtype) + ", must be " + describe_forms(x) +
                                       " (" + x.role + ")");
    return bad_checkpoint(where, "shape=" + t.shape_string() + ", must be " + describe_forms(x) + " (" + x.role +
                                     "; " + geometry_note() + ")");
  }

  std::string geometry_note() const {
    return "config.json: hidden=" + std::to_string(config_.hidden) + ", intermediate=" +
           std::to_string(config_.intermediate) + ", num_experts=" + std::to_string(config_.num_experts);
  }

  static std::string where(const TensorStore::Found& f) { return f.file->path() + ": tensor " + f.tensor->name; }

 private:
  TensorStore* store_;
  const CheckpointConfig& config_;
  int64_t layer_;
  std::string prefix_;
};

void copy_bytes(const TensorStore::Found& f, uint8_t* dst) {
  std::memcpy(dst, f.file->data(*f.tensor), static_cast<size_t>(f.tensor->bytes()));
}

// A float32 scalar tensor's value.
float scalar_value(const TensorStore::Found& f) {
  float v;
  std::memcpy(&v, f.file->data(*f.tensor), sizeof(v));
  return v;
}

std::string float_string(float v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

// Per 128x128 block fp32 scales must be finite and >= 0 (value = code * scale).
Status check_fp32_scales(const TensorStore::Found& f) {
  const int64_t n = f.tensor->numel();
  const uint8_t* p = f.file->data(*f.tensor);
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    if (!(v >= 0.f) || std::isinf(v))
      return bad_checkpoint(Loader::where(f), "element " + std::to_string(i) + "=" + float_string(v) +
                                                  ", a weight_scale_inv must be finite and >= 0");
  }
  return Status::ok();
}

// e4m3 block scales (nvfp4) must be finite and >= 0; e8m0 (mxfp4) must not be 0xFF (NaN).
Status check_scale_codes(const TensorStore::Found& f, bool e8m0) {
  const int64_t n = f.tensor->numel();
  const uint8_t* p = f.file->data(*f.tensor);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = p[i];
    const bool bad = e8m0 ? c == 0xFFu : ((c & 0x7Fu) == 0x7Fu || ((c & 0x80u) != 0 && c != 0x80u));
    if (bad) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", c);
      return bad_checkpoint(Loader::where(f), "element " + std::to_string(i) + "=" + hex +
                                                  (e8m0 ? ", an e8m0 scale must not be 0xFF (NaN)"
                                                        : ", an e4m3 block scale must be finite and >= 0"));
    }
  }
  return Status::ok();
}

// What load_checkpoint_experts hands out: the stacks the MoeWeights views point into.
struct ExpertStorage {
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_global, w2_global;
};

const char* const kProjs[3] = {"gate_proj", "up_proj", "down_proj"};

// The three matrices of one expert: [rows, cols] of each projection, and where its rows go.
struct ProjShape {
  int64_t rows, cols;
  bool w13;           // into w13 (gate, up) or w2 (down)
  int64_t row_begin;  // first row in the expert's w13 / w2
};

ProjShape proj_shape(int p, int64_t H, int64_t I) {
  if (p == 0) return {I, H, true, 0};
  if (p == 1) return {I, H, true, I};
  return {H, I, false, 0};
}

Status load_per_expert(Loader& ld, CheckpointLayout layout, StDtype float_dtype, const MoeGeometry& g,
                       ExpertStorage* st, bool* has_input_scale) {
  const int64_t H = g.hidden, I = g.intermediate, El = g.experts_per_rank(), e0 = g.first_local_expert();
  const int64_t w13_elems = 2 * I * H, w2_elems = H * I;
  const int64_t elem_bits = layout == CheckpointLayout::kBf16 ? (float_dtype == StDtype::kF32 ? 32 : 16)
                            : layout == CheckpointLayout::kFp8Block ? 8
                                                                    : 4;
  // Scale elements per matrix element, and their bytes.
  const int64_t scale_div = layout == CheckpointLayout::kFp8Block ? 128 * 128
                            : layout == CheckpointLayout::kNvfp4  ? 16
                                                                  : 32;
  const int64_t scale_bytes = layout == CheckpointLayout::kFp8Block ? 4 : 1;
  const bool has_scales = layout != CheckpointLayout::kBf16;
  st->w13.resize(static_cast<size_t>(El * w13_elems * elem_bits / 8));
  st->w2.resize(static_cast<size_t>(El * w2_elems * elem_bits / 8));
  if (has_scales) {
    st->w13_scale.resize(static_cast<size_t>(El * w13_elems / scale_div * scale_bytes));
    st->w2_scale.resize(static_cast<size_t>(El * w2_elems / scale_div * scale_bytes));
  }
  if (layout == CheckpointLayout::kNvfp4) {
    st->w13_global.resize(static_cast<size_t>(El));
    st->w2_global.resize(static_cast<size_t>(El));
  }
  *has_input_scale = false;
  for (int64_t i = 0; i < El; ++i) {
    const int64_t e = e0 + i;
    float gate_global = 0.f;
    std::string gate_global_name;
    for (int p = 0; p < 3; ++p) {
      const ProjShape ps = proj_shape(p, H, I);
      const int64_t elem_offset = (ps.w13 ? i * w13_elems : i * w2_elems) + ps.row_begin * ps.cols;
      uint8_t* data = (ps.w13 ? st->w13 : st->w2).data() + elem_offset * elem_bits / 8;
      uint8_t* scales = has_scales ? (ps.w13 ? st->w13_scale : st->w2_scale).data() + elem_offset / scale_div * scale_bytes
                                   : nullptr;
      TensorStore::Found w, s;
      const std::string wname = ld.expert_name(e, kProjs[p], "weight");
      switch (layout) {
        case CheckpointLayout::kBf16:
          MEGAMOE_RETURN_IF_ERROR(ld.require(wname, {{{float_dtype, {ps.rows, ps.cols}}}, "unquantised expert weight"}, &w));
          break;
        case CheckpointLayout::kFp8Block:
          MEGAMOE_RETURN_IF_ERROR(
              ld.require(wname, {{{StDtype::kF8E4M3, {ps.rows, ps.cols}}}, "DeepSeek-V3 fp8 expert weight"}, &w));
          MEGAMOE_RETURN_IF_ERROR(ld.require(ld.expert_name(e, kProjs[p], "weight_scale_inv"),
                                             {{{StDtype::kF32, {ps.rows / 128, ps.cols / 128}}},
                                              "DeepSeek-V3 fp32 scale per 128x128 block"},
                                             &s));
          MEGAMOE_RETURN_IF_ERROR(check_fp32_scales(s));
          break;
        case CheckpointLayout::kNvfp4:
        case CheckpointLayout::kMxfp4: {
          const bool nv = layout == CheckpointLayout::kNvfp4;
          MEGAMOE_RETURN_IF_ERROR(ld.require(
              wname,
              {{{StDtype::kU8, {ps.rows, ps.cols / 2}}, {StDtype::kF4, {ps.rows, ps.cols}}},
               nv ? "ModelOpt nvfp4 expert weight, two e2m1 per byte" : "mxfp4 expert weight, two e2m1 per byte"},
              &w));
          if (nv)
            MEGAMOE_RETURN_IF_ERROR(ld.require(ld.expert_name(e, kProjs[p], "weight_scale"),
                                               {{{StDtype::kF8E4M3, {ps.rows, ps.cols / 16}}},
                                                "ModelOpt nvfp4 e4m3 block scale per 1x16"},
                                               &s));
          else
            MEGAMOE_RETURN_IF_ERROR(ld.require(
                ld.expert_name(e, kProjs[p], "weight_scale"),
                {{{StDtype::kU8, {ps.rows, ps.cols / 32}}, {StDtype::kF8E8M0, {ps.rows, ps.cols / 32}}},
                 "mxfp4 e8m0 block scale per 1x32"},
                &s));
          MEGAMOE_RETURN_IF_ERROR(check_scale_codes(s, !nv));
          if (!nv) break;
          TensorStore::Found g2, in;
          const std::string g2name = ld.expert_name(e, kProjs[p], "weight_scale_2");
          MEGAMOE_RETURN_IF_ERROR(
              ld.require(g2name, {{{StDtype::kF32, {}}}, "ModelOpt nvfp4 fp32 global scale", true}, &g2));
          const float gv = scalar_value(g2);
          if (!(gv > 0.f) || std::isinf(gv))
            return bad_checkpoint(Loader::where(g2), "value=" + float_string(gv) + ", must be finite and > 0");
          MEGAMOE_RETURN_IF_ERROR(ld.optional(ld.expert_name(e, kProjs[p], "input_scale"),
                                              {{{StDtype::kF32, {}}}, "ModelOpt nvfp4 activation scale", true}, &in));
          if (in.tensor) {
            const float iv = scalar_value(in);
            if (!(iv > 0.f) || std::isinf(iv))
              return bad_checkpoint(Loader::where(in), "value=" + float_string(iv) + ", must be finite and > 0");
            *has_input_scale = true;
          }
          if (p == 0) {
            gate_global = gv;
            gate_global_name = g2name;
            st->w13_global[i] = gv;
          } else if (p == 1) {
            if (std::memcmp(&gv, &gate_global, sizeof(float)) != 0)
              return bad_checkpoint(
                  Loader::where(g2),
                  "value=" + float_string(gv) + " differs from " + gate_global_name + "=" + float_string(gate_global) +
                      "; megamoe's nvfp4 w13 has one global scale per expert, so gate_proj and up_proj must share "
                      "weight_scale_2 (ModelOpt exports fused gate/up layers that way)");
          } else {
            st->w2_global[i] = gv;
          }
          break;
        }
        case CheckpointLayout::kMxfp4Fused: break;  // not per expert
      }
      copy_bytes(w, data);
      if (has_scales) copy_bytes(s, scales);
    }
  }
  return Status::ok();
}

// gpt-oss: all experts of the layer in four tensors, gate/up rows interleaved.
Status load_fused_mxfp4(Loader& ld, const CheckpointConfig& config, const MoeGeometry& g, ExpertStorage* st) {
  const std::string& P = ld.prefix();
  for (const char* bias : {"gate_up_proj_bias", "down_proj_bias"}) {
    TensorStore::Found b;
    MEGAMOE_RETURN_IF_ERROR(ld.lookup(P + bias, &b));
    if (b.tensor)
      return Status(StatusCode::kInvalidArgument,
                    "unsupported checkpoint " + Loader::where(b) +
                        ": gpt-oss experts add biases and use a clamped SwiGLU (swiglu_limit); megamoe's expert FFN "
                        "is w2 . (silu(gate) * up) without biases, so this layer cannot be computed as it ships");
  }
  if (config.clamped_swiglu)
    return Status(StatusCode::kInvalidArgument,
                  "unsupported checkpoint " + config.dir +
                      ": config.json sets swiglu_limit (gpt-oss's clamped SwiGLU); megamoe's expert FFN is "
                      "w2 . (silu(gate) * up), unclamped");
  const int64_t H = g.hidden, I = g.intermediate, E = g.num_experts, El = g.experts_per_rank(),
                e0 = g.first_local_expert();
  TensorStore::Found gu_blocks, gu_scales, dn_blocks, dn_scales;
  MEGAMOE_RETURN_IF_ERROR(ld.require(P + "gate_up_proj_blocks",
                                     {{{StDtype::kU8, {E, 2 * I, H / 32, 16}}},
                                      "gpt-oss mxfp4 gate/up blocks, rows interleaved gate, up"},
                                     &gu_blocks));
  MEGAMOE_RETURN_IF_ERROR(ld.require(P + "gate_up_proj_scales",
                                     {{{StDtype::kU8, {E, 2 * I, H / 32}}, {StDtype::kF8E8M0, {E, 2 * I, H / 32}}},
                                      "gpt-oss mxfp4 gate/up e8m0 scales"},
                                     &gu_scales));
  MEGAMOE_RETURN_IF_ERROR(ld.require(P + "down_proj_blocks",
                                     {{{StDtype::kU8, {E, H, I / 32, 16}}}, "gpt-oss mxfp4 down blocks"}, &dn_blocks));
  MEGAMOE_RETURN_IF_ERROR(ld.require(P + "down_proj_scales",
                                     {{{StDtype::kU8, {E, H, I / 32}}, {StDtype::kF8E8M0, {E, H, I / 32}}},
                                      "gpt-oss mxfp4 down e8m0 scales"},
                                     &dn_scales));
  MEGAMOE_RETURN_IF_ERROR(check_scale_codes(gu_scales, true));
  MEGAMOE_RETURN_IF_ERROR(check_scale_codes(dn_scales, true));
  const int64_t w13_row = H / 2, w13_srow = H / 32;  // bytes of one w13 row and of its scales
  st->w13.resize(static_cast<size_t>(El * 2 * I * w13_row));
  st->w13_scale.resize(static_cast<size_t>(El * 2 * I * w13_srow));
  st->w2.resize(static_cast<size_t>(El * H * I / 2));
  st->w2_scale.resize(static_cast<size_t>(El * H * I / 32));
  const uint8_t* gb = gu_blocks.file->data(*gu_blocks.tensor);
  const uint8_t* gs = gu_scales.file->data(*gu_scales.tensor);
  for (int64_t i = 0; i < El; ++i) {
    const int64_t e = e0 + i;
    for (int64_t r = 0; r < 2 * I; ++r) {
      // Fused row r is gate row r/2 (even r) or up row r/2 (odd r); w13 puts gate rows first.
      const int64_t dst_row = (r % 2 == 0 ? 0 : I) + r / 2;
      const int64_t src_row = e * 2 * I + r;
      std::memcpy(st->w13.data() + (i * 2 * I + dst_row) * w13_row, gb + src_row * w13_row, w13_row);
      std::memcpy(st->w13_scale.data() + (i * 2 * I + dst_row) * w13_srow, gs + src_row * w13_srow, w13_srow);
    }
  }
  std::memcpy(st->w2.data(), dn_blocks.file->data(*dn_blocks.tensor) + e0 * H * I / 2, st->w2.size());
  std::memcpy(st->w2_scale.data(), dn_scales.file->data(*dn_scales.tensor) + e0 * H * I / 32, st->w2_scale.size());
  return Status::ok();
}

// The layout of `layer`, recognised from expert `first_expert`'s tensors (headers only).
Status detect_layout(TensorStore& store, Loader& ld, int64_t layer, int64_t first_expert, CheckpointLayout* layout,
                     StDtype* float_dtype) {
  *layout = CheckpointLayout::kBf16;
  *float_dtype = StDtype::kBF16;
  TensorStore::Found probe;
  MEGAMOE_RETURN_IF_ERROR(store.lookup(ld.prefix() + "gate_up_proj_blocks", &probe));
  if (probe.tensor) {
    *layout = CheckpointLayout::kMxfp4Fused;
    return Status::ok();
  }
  const std::string first = ld.expert_name(first_expert, "gate_proj", "weight");
  MEGAMOE_RETURN_IF_ERROR(store.lookup(first, &probe));
  if (!probe.tensor) {
    TensorStore::Found dense;
    const std::string dense_name = "model.layers." + std::to_string(layer) + ".mlp.gate_proj.weight";
    MEGAMOE_RETURN_IF_ERROR(store.lookup(dense_name, &dense));
    if (dense.tensor)
      return invalid_argument("checkpoint", "layer", std::to_string(layer),
                              "is a dense MLP layer (" + dense_name + "), it has no routed experts");
    return ld.missing(first, "the first local expert's gate projection: no routed experts of this layer");
  }
  switch (probe.tensor->dtype) {
    case StDtype::kF8E4M3: *layout = CheckpointLayout::kFp8Block; return Status::ok();
    case StDtype::kBF16:
    case StDtype::kF32: *float_dtype = probe.tensor->dtype; return Status::ok();
    case StDtype::kU8:
    case StDtype::kF4: {
      TensorStore::Found s2;
      MEGAMOE_RETURN_IF_ERROR(store.lookup(ld.expert_name(first_expert, "gate_proj", "weight_scale_2"), &s2));
      *layout = s2.tensor ? CheckpointLayout::kNvfp4 : CheckpointLayout::kMxfp4;
      return Status::ok();
    }
    default:
      return bad_checkpoint(Loader::where(probe),
                            std::string("dtype=") + io::to_string(probe.tensor->dtype) +
                                ", an expert weight must be F8_E4M3 (DeepSeek-V3 fp8), U8 / F4 (packed e2m1: "
                                "nvfp4 with weight_scale_2, else mxfp4), BF16 or F32");
  }
}

Status check_layer(const CheckpointConfig& config, int64_t layer) {
  if (layer < 0 || (config.num_layers > 0 && layer >= config.num_layers))
    return invalid_argument("checkpoint", "layer", std::to_string(layer),
                            "must be in [0, num_hidden_layers=" + std::to_string(config.num_layers) + ")");
  if (layer < config.first_dense_layers)
    return invalid_argument("checkpoint", "layer", std::to_string(layer),
                            "is a dense MLP layer (config.json first_k_dense_replace=" +
                                std::to_string(config.first_dense_layers) + "): the MoE layers start there");

  return Status::ok();
}

WeightFormat layout_format(CheckpointLayout layout) {
  switch (layout) {
    case CheckpointLayout::kFp8Block: return WeightFormat::kFp8Block;
    case CheckpointLayout::kNvfp4: return WeightFormat::kNvfp4;
    case CheckpointLayout::kMxfp4:
    case CheckpointLayout::kMxfp4Fused: return WeightFormat::kMxfp4;
    case CheckpointLayout::kBf16: break;
  }
  return WeightFormat::kBf16;
}

}  // namespace

MoeGeometry CheckpointConfig::geometry(int64_t ep_size, int64_t ep_rank, int64_t max_tokens_per_rank) const {
  MoeGeometry g;
  g.hidden = hidden;
  g.intermediate = intermediate;
  g.num_experts = num_experts;
  g.top_k = top_k;
  g.ep_size = ep_size;
  g.ep_rank = ep_rank;
  g.max_tokens_per_rank = max_tokens_per_rank;
  return g;
}

Status read_checkpoint_config(const std::string& dir, CheckpointConfig* out) {
  const std::string path = join_path(dir, "config.json");
  nlohmann::json root;
  MEGAMOE_RETURN_IF_ERROR(read_json(path, &root));
  // Multimodal configs nest the language model's keys in text_config.
  const nlohmann::json* j = &root;
  if (!root.contains("hidden_size") && root.contains("text_config") && root["text_config"].is_object())
    j = &root["text_config"];
  CheckpointConfig c;
  c.dir = dir;
  if (j->contains("model_type") && (*j)["model_type"].is_string()) c.model_type = (*j)["model_type"].get<std::string>();
  struct Key {
    int64_t* field;
    std::initializer_list<const char*> names;
  };
  const Key keys[] = {{&c.hidden, {"hidden_size"}},
                      {&c.intermediate, {"moe_intermediate_size", "intermediate_size"}},
                      {&c.num_experts, {"n_routed_experts", "num_experts", "num_local_experts"}},
                      {&c.top_k, {"num_experts_per_tok", "experts_per_token"}}};
  for (const Key& k : keys) {
    if (!find_int(*j, k.names, k.field, nullptr))
      return bad_checkpoint(path, "no integer " + key_list(k.names) + " (the MoE layer's geometry)");
    if (*k.field <= 0)
      return bad_checkpoint(path, key_list(k.names) + "=" + std::to_string(*k.field) + ", must be positive");
  }
  find_int(*j, {"num_hidden_layers"}, &c.num_layers, nullptr);
  find_int(*j, {"first_k_dense_replace"}, &c.first_dense_layers, nullptr);
  c.clamped_swiglu = j->contains("swiglu_limit");
  *out = c;
  return Status::ok();
}

const char* to_string(CheckpointLayout v) {
  switch (v) {
    case CheckpointLayout::kBf16: return "unquantised (bf16 / fp32)";
    case CheckpointLayout::kFp8Block: return "fp8-block (DeepSeek-V3 e4m3 + weight_scale_inv per 128x128)";
    case CheckpointLayout::kNvfp4: return "nvfp4 (ModelOpt e2m1 + e4m3 per 16 + weight_scale_2)";
    case CheckpointLayout::kMxfp4: return "mxfp4 (e2m1 + e8m0 weight_scale per 32)";
    case CheckpointLayout::kMxfp4Fused: return "mxfp4 (gpt-oss gate_up_proj_blocks / _scales)";
  }
  return "unknown";
}

std::string CheckpointExperts::to_string() const {
  std::ostringstream os;
  os << "layer " << layer << ", " << megamoe::to_string(layout) << ", experts [" << geometry.first_local_expert()
     << ", " << geometry.first_local_expert() + geometry.experts_per_rank() << ") of " << geometry.num_experts
     << " from " << files.size() << " file(s)";
  return os.str();
}

Status probe_checkpoint_layer(const std::string& dir, int64_t layer, CheckpointLayerInfo* out) {
  if (out == nullptr)
    return invalid_argument("checkpoint", "out", "null", "probe_checkpoint_layer needs a CheckpointLayerInfo to fill");
  CheckpointLayerInfo info;
  MEGAMOE_RETURN_IF_ERROR(read_checkpoint_config(dir, &info.config));
  MEGAMOE_RETURN_IF_ERROR(check_layer(info.config, layer));
  TensorStore store;
  MEGAMOE_RETURN_IF_ERROR(store.init(dir));
  Loader ld(&store, info.config, layer);
  StDtype float_dtype;
  MEGAMOE_RETURN_IF_ERROR(detect_layout(store, ld, layer, 0, &info.layout, &float_dtype));
  info.format = layout_format(info.layout);
  *out = info;
  return Status::ok();
}

Status load_checkpoint_experts(const std::string& dir, int64_t layer, int64_t ep_size, int64_t ep_rank,
                               int64_t max_tokens_per_rank, CheckpointExperts* out) {
  if (out == nullptr)
    return invalid_argument("checkpoint", "out", "null", "load_checkpoint_experts needs a CheckpointExperts to fill");
  CheckpointConfig config;
  MEGAMOE_RETURN_IF_ERROR(read_checkpoint_config(dir, &config));
  const MoeGeometry g = config.geometry(ep_size, ep_rank, max_tokens_per_rank);
  if (const Status st = g.validate(); !st)
    return Status(st.code(), st.message() + " (geometry from " + join_path(dir, "config.json") + ")");
  MEGAMOE_RETURN_IF_ERROR(check_layer(config, layer));
  TensorStore store;
  MEGAMOE_RETURN_IF_ERROR(store.init(dir));
  Loader ld(&store, config, layer);

  CheckpointLayout layout = CheckpointLayout::kBf16;
  StDtype float_dtype = StDtype::kBF16;
  MEGAMOE_RETURN_IF_ERROR(detect_layout(store, ld, layer, g.first_local_expert(), &layout, &float_dtype));

  auto storage = std::make_shared<ExpertStorage>();
  CheckpointExperts result;
  try {
    if (layout == CheckpointLayout::kMxfp4Fused)
      MEGAMOE_RETURN_IF_ERROR(load_fused_mxfp4(ld, config, g, storage.get()));
    else
      MEGAMOE_RETURN_IF_ERROR(load_per_expert(ld, layout, float_dtype, g, storage.get(), &result.has_input_scale));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kInternal, "load_checkpoint_experts: out of host memory for " +
                                             std::to_string(g.experts_per_rank()) + " experts of layer " +
                                             std::to_string(layer));
  }

  const int64_t H = g.hidden, I = g.intermediate, El = g.experts_per_rank();
  ExpertStorage& s = *storage;
  MoeWeights& w = result.weights;
  switch (layout) {
    case CheckpointLayout::kBf16: {
      const DType d = float_dtype == StDtype::kF32 ? DType::kFloat32 : DType::kBFloat16;
      w.w13 = TensorView(s.w13.data(), d, {El, 2 * I, H});
      w.w2 = TensorView(s.w2.data(), d, {El, H, I});
      break;
    }
    case CheckpointLayout::kFp8Block:
      w.w13 = TensorView(s.w13.data(), DType::kFloat8E4M3, {El, 2 * I, H});
      w.w13_scale = TensorView(s.w13_scale.data(), DType::kFloat32, {El, 2 * I / 128, H / 128});
      w.w2 = TensorView(s.w2.data(), DType::kFloat8E4M3, {El, H, I});
      w.w2_scale = TensorView(s.w2_scale.data(), DType::kFloat32, {El, H / 128, I / 128});
      break;
    case CheckpointLayout::kNvfp4:
      w.w13 = TensorView(s.w13.data(), DType::kFloat4E2M1x2, {El, 2 * I, H / 2});
      w.w13_scale = TensorView(s.w13_scale.data(), DType::kFloat8E4M3, {El, 2 * I, H / 16});
      w.w13_global_scale = TensorView(s.w13_global.data(), DType::kFloat32, {El});
      w.w2 = TensorView(s.w2.data(), DType::kFloat4E2M1x2, {El, H, I / 2});
      w.w2_scale = TensorView(s.w2_scale.data(), DType::kFloat8E4M3, {El, H, I / 16});
      w.w2_global_scale = TensorView(s.w2_global.data(), DType::kFloat32, {El});
      break;
    case CheckpointLayout::kMxfp4:
    case CheckpointLayout::kMxfp4Fused:
      w.w13 = TensorView(s.w13.data(), DType::kFloat4E2M1x2, {El, 2 * I, H / 2});
      w.w13_scale = TensorView(s.w13_scale.data(), DType::kFloat8E8M0, {El, 2 * I, H / 32});
      w.w2 = TensorView(s.w2.data(), DType::kFloat4E2M1x2, {El, H, I / 2});
      w.w2_scale = TensorView(s.w2_scale.data(), DType::kFloat8E8M0, {El, H, I / 32});
      break;
  }
  result.format = layout_format(layout);
  result.config = config;
  result.geometry = g;
  result.layer = layer;
  result.layout = layout;
  result.storage = storage;
  for (const std::string& f : store.used_files()) result.files.push_back(join_path(dir, f));
  *out = std::move(result);
  return Status::ok();
}

}  // namespace megamoe
