#include "dump.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "megamoe/formats.h"
#include "npy.h"
#include "presets.h"

namespace megamoe::tool {
namespace {

std::string dtype_name(const std::string& descr) {
  if (descr == "<f4") return "float32";
  if (descr == "<i4") return "int32";
  if (descr == "<u2") return "uint16";
  return "uint8";
}

// Shapes of one prepared weight tensor [E, N, K] in `format` (E global).
void quantised_files(const std::string& prefix, WeightFormat format, int64_t E, int64_t N, int64_t K,
                     std::vector<DumpFile>* out) {
  const std::string src = prefix == "w13" ? "w13 [E, 2I, H]" : "w2 [E, H, I]";
  switch (format) {
    case WeightFormat::kBf16:
      out->push_back({prefix + "_q.npy", "<u2", {E, N, K}, "bf16 bits of " + src});
      break;
    case WeightFormat::kFp8Block:
      out->push_back({prefix + "_q.npy", "|u1", {E, N, K}, "e4m3 codes of " + src});
      out->push_back({prefix + "_scale.npy", "<f4", {E, N / 128, K / 128}, "fp32 scale per 128x128 block"});
      break;
    case WeightFormat::kMxfp8:
      out->push_back({prefix + "_q.npy", "|u1", {E, N, K}, "e4m3 codes of " + src});
      out->push_back({prefix + "_scale.npy", "|u1", {E, N, K / 32}, "e8m0 scale codes per 1x32 along K"});
      break;
    case WeightFormat::kNvfp4:
      out->push_back({prefix + "_q.npy", "|u1", {E, N, K / 2}, "packed e2m1 codes of " + src + " (low nibble first)"});
      out->push_back({prefix + "_scale.npy", "|u1", {E, N, K / 16}, "e4m3 scale codes per 1x16 along K"});
      out->push_back({prefix + "_global_scale.npy", "<f4", {E}, "fp32 global scale per expert"});
      break;
    case WeightFormat::kMxfp4:
      out->push_back({prefix + "_q.npy", "|u1", {E, N, K / 2}, "packed e2m1 codes of " + src + " (low nibble first)"});
      out->push_back({prefix + "_scale.npy", "|u1", {E, N, K / 32}, "e8m0 scale codes per 1x32 along K"});
      break;
  }
}

void check_io(const Status& st) {
  if (!st) throw ToolError(kExitIo, st.message());
}

void make_dir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw ToolError(kExitIo, "cannot create dump directory " + dir + ": " + std::strerror(errno));
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw ToolError(kExitIo, "dump path " + dir + " exists and is not a directory");
}

const DumpFile& find(const std::vector<DumpFile>& plan, const std::string& name) {
  for (const DumpFile& f : plan)
    if (f.name == name) return f;
  throw ToolError(kExitIo, "internal: dump file " + name + " is not in the plan");
}

template <typename T>
void write_planned(const std::string& dir, const std::vector<DumpFile>& plan, const std::string& name,
                   const T* data, int64_t count) {
  const DumpFile& f = find(plan, name);
  check_io(write_npy(dir + "/" + name, f.descr, f.shape, data, count * static_cast<int64_t>(sizeof(T))));
}

// Concatenates every rank's bytes of one prepared field in rank order (= global expert order).
template <typename Get>
std::vector<uint8_t> concat_ranks(const std::vector<const PreparedWeights*>& prepared, Get get) {
  std::vector<uint8_t> all;
  for (const PreparedWeights* p : prepared) {
    const std::vector<uint8_t>& v = get(*p);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

void write_quantised(const std::string& dir, const std::vector<DumpFile>& plan, const std::string& prefix,
                     const std::vector<const PreparedWeights*>& prepared, bool is_w13) {
  auto tensor = [is_w13](const PreparedWeights& p) -> const QuantizedTensor& { return is_w13 ? p.w13 : p.w2; };
  const std::vector<uint8_t> data = concat_ranks(prepared, [&](const PreparedWeights& p) -> const std::vector<uint8_t>& {
    return tensor(p).data;
  });
  const DumpFile& q = find(plan, prefix + "_q.npy");
  check_io(write_npy(dir + "/" + q.name, q.descr, q.shape, data.data(), static_cast<int64_t>(data.size())));
  const WeightFormat format = tensor(*prepared.front()).format;
  if (format == WeightFormat::kBf16) return;
  const std::vector<uint8_t> scales =
      concat_ranks(prepared, [&](const PreparedWeights& p) -> const std::vector<uint8_t>& { return tensor(p).scales; });
  const DumpFile& s = find(plan, prefix + "_scale.npy");
  check_io(write_npy(dir + "/" + s.name, s.descr, s.shape, scales.data(), static_cast<int64_t>(scales.size())));
  if (format == WeightFormat::kNvfp4) {
    std::vector<float> global;
    for (const PreparedWeights* p : prepared)
      global.insert(global.end(), tensor(*p).global_scales.begin(), tensor(*p).global_scales.end());
    write_planned(dir, plan, prefix + "_global_scale.npy", global.data(), static_cast<int64_t>(global.size()));
  }
}

}  // namespace

std::vector<DumpFile> plan_dump(const MoeGeometry& g, const MoeConfig& c, const std::vector<int64_t>& tokens_per_rank) {
  const int64_t E = g.num_experts, H = g.hidden, I = g.intermediate, k = g.top_k;
  std::vector<DumpFile> plan;
  plan.push_back({"w13_f32.npy", "<f4", {E, 2 * I, H}, "dequantised w13 as the layer computes with it (gate rows then up rows)"});
  plan.push_back({"w2_f32.npy", "<f4", {E, H, I}, "dequantised w2 as the layer computes with it"});
  quantised_files("w13", c.weight_format, E, 2 * I, H, &plan);
  quantised_files("w2", c.weight_format, E, H, I, &plan);
  for (size_t r = 0; r < tokens_per_rank.size(); ++r) {
    const std::string d = "rank" + std::to_string(r) + "/";
    const int64_t T = tokens_per_rank[r];
    plan.push_back({d + "x_bf16.npy", "<u2", {T, H}, "bf16 bits of the layer's input x"});
    plan.push_back({d + "x_f32.npy", "<f4", {T, H}, "x as the layer consumed it (after the dispatch format)"});
    plan.push_back({d + "topk_ids.npy", "<i4", {T, k}, "global expert ids, -1 = no expert"});
    plan.push_back({d + "topk_weights.npy", "<f4", {T, k}, "routing weights"});
    plan.push_back({d + "y_f32.npy", "<f4", {T, H}, "the layer's bf16 output, widened to float32"});
  }
  return plan;
}

int64_t dump_bytes(const std::vector<DumpFile>& plan) {
  int64_t total = 0;
  for (const DumpFile& f : plan) total += npy_file_bytes(f.shape, npy_itemsize(f.descr));
  return total;
}

void write_dump(const std::string& dir, const std::vector<DumpFile>& plan, const DumpData& data, nlohmann::json meta) {
  make_dir(dir);
  write_planned(dir, plan, "w13_f32.npy", data.w13_f32->data(), static_cast<int64_t>(data.w13_f32->size()));
  write_planned(dir, plan, "w2_f32.npy", data.w2_f32->data(), static_cast<int64_t>(data.w2_f32->size()));
  write_quantised(dir, plan, "w13", data.prepared, true);
  write_quantised(dir, plan, "w2", data.prepared, false);
  for (size_t r = 0; r < data.y_bf16.size(); ++r) {
    const std::string d = "rank" + std::to_string(r);
    make_dir(dir + "/" + d);
    const auto& xb = *data.x_bf16[r];
    write_planned(dir, plan, d + "/x_bf16.npy", xb.data(), static_cast<int64_t>(xb.size()));
    write_planned(dir, plan, d + "/x_f32.npy", data.x_f32[r]->data(), static_cast<int64_t>(data.x_f32[r]->size()));
    write_planned(dir, plan, d + "/topk_ids.npy", data.topk_ids[r]->data(),
                  static_cast<int64_t>(data.topk_ids[r]->size()));
    write_planned(dir, plan, d + "/topk_weights.npy", data.topk_weights[r]->data(),
                  static_cast<int64_t>(data.topk_weights[r]->size()));
    const auto& yb = *data.y_bf16[r];
    std::vector<float> y(yb.size());
    for (size_t i = 0; i < yb.size(); ++i) y[i] = fmt::bf16_to_float(yb[i]);
    write_planned(dir, plan, d + "/y_f32.npy", y.data(), static_cast<int64_t>(y.size()));
  }
  nlohmann::json files = nlohmann::json::array();
  for (const DumpFile& f : plan)
    files.push_back({{"name", f.name}, {"dtype", dtype_name(f.descr)}, {"descr", f.descr}, {"shape", f.shape},
                     {"what", f.what}});
  meta["files"] = files;
  const std::string path = dir + "/meta.json";
  std::ofstream out(path);
  out << meta.dump(2) << "\n";
  out.close();
  if (!out) throw ToolError(kExitIo, "cannot write " + path);
}

}  // namespace megamoe::tool
