// `megamoe check --dump DIR`: meta.json plus NumPy .npy files of everything the check compared
// (docs/TOOL.md "Dump format" lists them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/config.h"
#include "megamoe/weights.h"

namespace megamoe::tool {

struct DumpFile {
  std::string name;  // relative to the dump directory
  std::string descr; // NumPy descr: <f4, <i4, <u2, |u1
  std::vector<int64_t> shape;
  std::string what;  // one line for meta.json
};

// Every file a dump of this run writes, with its shape, known before anything is computed.
std::vector<DumpFile> plan_dump(const MoeGeometry& g, const MoeConfig& c, const std::vector<int64_t>& tokens_per_rank);
int64_t dump_bytes(const std::vector<DumpFile>& plan);
constexpr int64_t kMaxDumpBytes = int64_t{4} << 30;

// What the check computed, per rank, for the dump to write.
struct DumpData {
  const std::vector<float>* w13_f32 = nullptr;  // [E, 2I, H] dequantised, global expert order
  const std::vector<float>* w2_f32 = nullptr;   // [E, H, I]
  std::vector<const PreparedWeights*> prepared; // [R] each rank's prepared (quantised) experts
  std::vector<const std::vector<uint16_t>*> x_bf16;      // [R] [T, H]
  std::vector<const std::vector<float>*> x_f32;          // [R] [T, H] as the layer consumed it
  std::vector<const std::vector<int32_t>*> topk_ids;     // [R] [T, k]
  std::vector<const std::vector<float>*> topk_weights;   // [R] [T, k]
  std::vector<const std::vector<uint16_t>*> y_bf16;      // [R] [T, H] the layer's output
};

// Writes every planned file and meta.json (= `meta` plus "files": the plan). Throws ToolError
// (kExitIo) naming the path on failure.
void write_dump(const std::string& dir, const std::vector<DumpFile>& plan, const DumpData& data, nlohmann::json meta);

}  // namespace megamoe::tool
